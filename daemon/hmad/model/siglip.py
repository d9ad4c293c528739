"""Gemma 3's vision encoder (SigLIP) and multimodal projector, written once over ``VisionOps``.

``VisionTower(cfg, weights, ops).encode(pixels)`` turns normalized images into the soft tokens the language
model embeds in place of its ``<image_soft_token>`` placeholders::

    pixels (n, 3, S, S) -> patch conv + position embedding              (n, P, D)
      -> n_layers x [ x += attn(LN1(x)) ; x += fc2(gelu_tanh(fc1(LN2(x)))) ]   (attention non-causal,
      -> post LayerNorm                                                         within one image)
      -> avg pool k x k over the sqrt(P) x sqrt(P) grid                   (n, T, D)
      -> RMSNorm (weight 1 + w) -> @ input_projection (D, E)               (n, T, E)

The math of transformers' SiglipVisionModel + Gemma3MultiModalProjector (and of llama.cpp's gemma3 clip
graph). ``weights`` are the canonical tensors of ``hmad.model.vision`` (float32 numpy arrays, or whatever
array type ``ops`` works on); ``ops`` decides where and how each op runs (``VisionOps``: the numpy
reference).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hmad.backends.vision_ops import VisionOps
from hmad.model.vision import VisionConfig, expected_shapes, shape_problem


class VisionTower:
    """The encoder + projector of one model; ``encode`` may be called any number of times."""

    def __init__(self, cfg: VisionConfig, weights: dict[str, Any], ops: VisionOps):
        problems = [
            shape_problem(n, tuple(weights[n].shape), cfg) if n in weights else f"missing tensor {n}"
            for n in expected_shapes(cfg)
        ]
        problems = [p for p in problems if p]
        if problems:
            raise ValueError(f"vision weights do not fit the config: {'; '.join(problems[:3])}")
        self.cfg, self.w, self.ops = cfg, weights, ops

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """pixels (n, 3, S, S) float32, already normalized -> soft tokens (n, mm_tokens, text_hidden)."""
        c, s = self.cfg, self.cfg.image_size
        if pixels.ndim != 4 or pixels.shape[1:] != (3, s, s) or pixels.shape[0] < 1:
            raise ValueError(f"pixels of shape {pixels.shape}, expected (n, 3, {s}, {s})")
        x = self.embed(np.ascontiguousarray(pixels, dtype=np.float32))  # (n, P, D)
        for i in range(c.n_layers):
            x = self.layer(x, i)  # (n, P, D)
        x = self.ops.layer_norm(x, self.w["v.post_ln.weight"], self.w["v.post_ln.bias"], c.eps)
        return self.project(x)  # (n, T, E)

    def embed(self, pixels: np.ndarray) -> Any:
        """(n, 3, S, S) -> patch embeddings + learned positions (n, P, D)."""
        w, p = self.w, self.cfg.patch_size
        x = self.ops.patch_embed(pixels, w["v.patch_embd.weight"], w["v.patch_embd.bias"], p)  # (n, P, D)
        return self.ops.add(x, w["v.position_embd.weight"])  # (P, D) broadcast over images

    def layer(self, x: Any, i: int) -> Any:
        """One pre-norm encoder layer: (n, P, D) -> (n, P, D)."""
        p, eps = f"v.blk.{i}.", self.cfg.eps
        h = self.ops.layer_norm(x, self.w[p + "ln1.weight"], self.w[p + "ln1.bias"], eps)
        x = self.ops.add(x, self.attention(h, p))
        h = self.ops.layer_norm(x, self.w[p + "ln2.weight"], self.w[p + "ln2.bias"], eps)
        return self.ops.add(x, self.mlp(h, p))

    def attention(self, h: Any, p: str) -> Any:
        """Multi-head self-attention over each image's patches, scale head_dim ** -0.5: (n, P, D)."""
        q, k, v = (self.linear(h, p + name) for name in ("attn_q", "attn_k", "attn_v"))  # (n, P, D) each
        o = self.ops.attention(q, k, v, self.cfg.n_heads, self.cfg.head_dim**-0.5)  # (n, P, D)
        return self.linear(o, p + "attn_out")

    def mlp(self, h: Any, p: str) -> Any:
        """fc2(gelu_tanh(fc1(h))): (n, P, D) -> (n, P, F) -> (n, P, D)."""
        return self.linear(self.ops.gelu_tanh(self.linear(h, p + "ffn_up")), p + "ffn_down")

    def linear(self, x: Any, name: str) -> Any:
        return self.ops.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def project(self, x: Any) -> Any:
        """Gemma3MultiModalProjector: (n, P, D) -> pooled (n, T, D) -> normed -> (n, T, E)."""
        c = self.cfg
        pooled = self.ops.avg_pool(x, c.patches_per_side, c.pool)  # (n, T, D)
        normed = self.ops.rms_norm(pooled, self.w["mm.soft_emb_norm.weight"], c.eps)  # (n, T, D)
        return self.ops.matmul(normed, self.w["mm.input_projection.weight"])  # (n, T, E)
