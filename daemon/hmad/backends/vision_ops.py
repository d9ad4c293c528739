"""The ops Gemma 3's vision tower (SigLIP) and multimodal projector are written over, in numpy.

``VisionOps`` is the op interface ``hmad.model.siglip.VisionTower`` calls, one method per op over plain
arrays, and these numpy implementations are **the reference numerics**: float32 in, float32 out, the math
of transformers' SiglipVisionModel and Gemma3MultiModalProjector. Another backend (Vulkan) subclasses this
class and overrides ops one at a time; its results are checked against these.

Shapes: ``n`` images, ``P`` patches per image, ``D`` the vision width, ``H`` heads, ``E`` the text width.
Weights are float32 in the numpy (PyTorch) layout: a linear weight is (out_features, in_features).
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


class VisionOps:
    """Reference (numpy, float32) implementations of the vision encoder's ops. Subclass to accelerate."""

    def run(self, tower, pixels: np.ndarray) -> np.ndarray:
        """``tower.encode(pixels)`` as a host array (n, mm_tokens, E) float32: what the engine calls. A device
        backend records the encode and replays it."""
        return np.asarray(tower.encode(pixels), dtype=F32)

    def prepare(self, tower) -> None:
        """Make the tower resident before the KV cache takes the device's memory (a device backend uploads
        its weights and records an encode); nothing here."""

    def patch_embed(self, pixels: np.ndarray, w: np.ndarray, b: np.ndarray, patch: int) -> np.ndarray:
        """The stride-``patch`` convolution: pixels (n, C, S, S), w (D, C, p, p), b (D,) -> (n, P, D).

        Patch ``y * (S // p) + x`` is the one at row ``y``, column ``x`` (PyTorch's ``flatten(2)`` order).
        """
        n, c, s, _ = pixels.shape
        g = s // patch
        x = pixels.reshape(n, c, g, patch, g, patch).transpose(0, 2, 4, 1, 3, 5)  # (n, g, g, C, p, p)
        x = x.reshape(n, g * g, c * patch * patch)  # (n, P, C*p*p)
        return (x @ w.reshape(w.shape[0], -1).T + b).astype(F32)  # (n, P, D)

    def linear(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
        """x (..., in) @ w (out, in).T + b (out,) -> (..., out)."""
        y = x @ w.T
        return (y if b is None else y + b).astype(F32)

    def matmul(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x (..., in) @ w (in, out) -> (..., out): the projector's weight is stored (D, E), untransposed."""
        return (x @ w).astype(F32)

    def layer_norm(self, x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
        """LayerNorm over the last axis (biased variance), then ``* w + b``."""
        mean = x.mean(axis=-1, keepdims=True)
        d = x - mean
        var = (d * d).mean(axis=-1, keepdims=True)
        return (d / np.sqrt(var + F32(eps)) * w + b).astype(F32)

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """``x / sqrt(mean(x^2) + eps) * w`` over the last axis; ``w`` holds Gemma's ``1 + weight``."""
        ms = (x * x).mean(axis=-1, keepdims=True)
        return (x / np.sqrt(ms + F32(eps)) * w).astype(F32)

    def gelu_tanh(self, x: np.ndarray) -> np.ndarray:
        """GELU, tanh approximation (PyTorch's ``gelu(approximate="tanh")``)."""
        c = F32(np.sqrt(2.0 / np.pi))
        return (F32(0.5) * x * (F32(1.0) + np.tanh(c * (x + F32(0.044715) * x * x * x)))).astype(F32)

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Elementwise sum (residuals; the position embedding broadcast over images)."""
        return (a + b).astype(F32)

    def attention(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, n_heads: int, scale: float
    ) -> np.ndarray:
        """Dense non-causal multi-head attention within each image: q, k, v (n, P, H*Dh) -> (n, P, H*Dh).

        ``softmax(q k^T * scale) v`` per head; every patch sees every patch of its own image. One image and
        head at a time, so the scores take P x P floats (Gemma 3's 4096 patches: 64 MiB), not n x H times it.
        """
        n, p, width = q.shape
        dh = width // n_heads
        out = np.empty((n, p, width), dtype=F32)
        for i in range(n):
            for h in range(n_heads):
                cols = slice(h * dh, (h + 1) * dh)
                s = q[i, :, cols] @ k[i, :, cols].T * F32(scale)  # (P, P)
                s = np.exp(s - s.max(axis=-1, keepdims=True))
                s /= s.sum(axis=-1, keepdims=True)
                out[i, :, cols] = s @ v[i, :, cols]  # (P, Dh)
        return out

    def avg_pool(self, x: np.ndarray, side: int, k: int) -> np.ndarray:
        """Average ``k x k`` blocks of the ``side x side`` patch grid: (n, side^2, D) -> (n, (side/k)^2, D).

        Output token ``r * (side // k) + c`` averages grid rows ``r*k ..`` and columns ``c*k ..``.
        """
        n, _, d = x.shape
        t = side // k
        g = x.reshape(n, t, k, t, k, d)  # (n, row block, row in block, col block, col in block, D)
        return g.mean(axis=(2, 4), dtype=F32).reshape(n, t * t, d).astype(F32)
