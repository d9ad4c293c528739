"""The op interface every backend implements; the forward pass (model/gemma3.py) is written against it.

Activations are backend arrays (numpy on the CPU, buffer handles when a backend records a graph); the
forward pass never inspects their values, so the same code runs eagerly (CPU) or is recorded once per
batch shape and replayed (Vulkan). Shapes in comments: T tokens in the step, D model width, H query heads,
Hkv KV heads, Dh head dim, N output features, S_out rows whose logits are wanted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

from hmad.backends.vision_ops import VisionOps
from hmad.core.batch import StepBatch
from hmad.core.kv_layout import KVLayout
from hmad.core.tensors import WeightTensor

Act = Any  # a backend's activation array
Weight = Any  # a backend's resident weight


class Backend(ABC):
    """Op provider. ``name`` identifies it in status; ``device`` names the hardware.

    Failures: an exception from ``run`` (or from reading its result back) fails that step's requests only,
    and the next step runs as usual, so a backend must leave itself usable after raising. One that cannot
    (its device is lost) raises ``hmad.core.errors.BackendUnusable`` (or a subclass, as the Vulkan backend's
    ``DeviceLost``): the engine then answers every request and the daemon exits 1.
    """

    name: str = "base"
    device: str = ""
    #: ``greedy()`` runs on the device and reads back only token ids (the scheduler uses it when every
    #: sequence of a step is greedy); False: it would read the logits back anyway.
    greedy_on_device: bool = False
    #: ``launch_greedy``/``collect`` exist: a step may be submitted before the ids of the one before it are
    #: read, its decode rows' tokens taken on the device from that step (engine/scheduler.py, "Pipelining")
    pipelined: bool = False
    #: ``launch_sampled``/``candidates`` exist too: a pipelined step's sampling requests (top_k within
    #: ``topk_max``, no repetition penalty, no grammar) draw their tokens on the device
    sample_on_device: bool = False
    #: ``topk(logits, k)`` selects on the device and reads back k candidates per row (the scheduler uses it
    #: when every sampling request of a step can be served from its best ``topk_max`` logits); 0: never.
    topk_max: int = 0
    #: batch-invariant numerics: a sequence's logits do not depend on what else the step holds (the rows
    #: of other sequences, its place in the batch, how its prompt was chunked); engine.deterministic
    #: "auto" means ``deterministic_auto``, each backend's choice by its measured cost (docs/determinism.md)
    deterministic: bool = False
    deterministic_auto: bool = False

    def resolve_deterministic(self, value: bool | str) -> bool:
        """engine.deterministic (True, False or "auto") for this backend."""
        if value == "auto":
            return self.deterministic_auto
        if not isinstance(value, bool):
            raise ValueError(f"deterministic must be true, false or 'auto', got {value!r}")
        return value

    # -- residency -------------------------------------------------------------------------------------
    @abstractmethod
    def load_weights(
        self, tensors: dict[str, WeightTensor], progress: Callable[..., None] | None = None, background=False
    ) -> dict[str, Weight]:
        """Make every weight resident; returns handles keyed like ``tensors``. ``progress(message, done_bytes,
        total_bytes)`` may be called while uploading (the service shows it in status and systemd's STATUS=).
        ``background``: a backend may return before its upload is done; ``wait_resident`` then waits."""

    def unsupported(self, cfg) -> str | None:
        """Why this backend cannot run a model of ``cfg`` (a ModelConfig), or None where it can. load_model
        asks before any weight is uploaded and refuses the model with this reason. Default: any model."""
        return None

    @abstractmethod
    def alloc_kv(self, layout: KVLayout) -> None:
        """Allocate the paged KV pools described by ``layout``."""

    def prepare(self, net, max_tokens: int, max_rows: int) -> None:  # noqa: B027 - optional hook
        """Make ready every step shape of up to ``max_tokens`` tokens and ``max_rows`` logit rows, so that no
        step pays a one-time cost later (the daemon calls this before READY). Default: nothing to do."""

    def wait_resident(self) -> None:  # noqa: B027 - optional hook
        """Until the weights a ``load_weights(..., background=True)`` started uploading are resident
        (raises the upload's error). Default: load_weights was synchronous."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the device's resources (buffers, pipelines); the backend is unusable afterwards.
        Default: nothing is held outside Python objects."""

    def begin_step(self, batch: StepBatch) -> None:  # noqa: B027 - optional hook
        """Called before a step's ops: a recording backend uploads the per-step values here."""

    def run(self, net, batch: StepBatch) -> Act:
        """One step's logits handle. Eager backends call ``net.forward(batch)``; a recording backend
        records the forward pass once per batch-size bucket and replays it (backends/vulkan/backend.py)."""
        return net.forward(batch)

    def greedy(self, logits: Act) -> np.ndarray:
        """Argmax token id of each logits row (ties: the lowest id), as int64."""
        return np.argmax(self.to_numpy(logits), axis=-1).astype(np.int64)

    def launch_greedy(self, logits: Act) -> Any:
        """Start the step (``run``'s output) with its argmax and return a handle for ``collect`` without
        waiting. The rows with a ``batch.feed`` entry take their token from the ids of the step launched
        just before (still running, maybe). At most two steps in flight. Only where ``pipelined``."""
        raise NotImplementedError(f"{self.name} backend does not pipeline steps")

    def launch_sampled(self, logits: Act) -> Any:
        """As ``launch_greedy``, each row's token drawn on the device from its ``topk_max`` best logits with
        its ``batch.sampling`` (temperature 0: the argmax). Only where ``sample_on_device``."""
        raise NotImplementedError(f"{self.name} backend does not sample on the device")

    def collect(self, launched: Any) -> np.ndarray:
        """The token ids (S_out,) int64 of a launched step, once it is done."""
        raise NotImplementedError(f"{self.name} backend does not pipeline steps")

    def candidates(self, launched: Any) -> tuple[np.ndarray, np.ndarray]:
        """A collected ``launch_sampled`` step's candidates (ids, values), as ``topk`` returns them, without
        the log-sum-exps (the host checks each device-drawn token against its own draw from them)."""
        raise NotImplementedError(f"{self.name} backend does not sample on the device")

    def topk(self, logits: Act) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids int64, values float32), each (S_out, topk_max): the best logits of each row, largest first,
        equal values lowest id first (shaders/topk.comp's order); and each row's log-sum-exp (S_out,)
        float32 over the whole row, NaN counted as -inf (a token's logprob is its value minus it: engine/
        logprobs.py; a row with no finite maximum gives a non-finite one). Both after the step's
        ``batch.bias`` adjustments. Only where ``topk_max`` > 0."""
        raise NotImplementedError(f"{self.name} backend has no on-device top-k")

    def topk_targets(self, logits: Act) -> np.ndarray:
        """After ``topk(logits)`` (before the next step): each row's logit of its ``batch.targets`` token
        (S_out,) float32, after the same adjustments (a prompt token's logprob is it minus the row's
        log-sum-exp), NaN on a row with no target. Only where ``topk_max`` > 0."""
        raise NotImplementedError(f"{self.name} backend has no on-device top-k")

    # -- ops ---------------------------------------------------------------------------------------------
    @abstractmethod
    def embed(self, table: Weight, tokens: Act, scale: float) -> Act:
        """(T,) token ids -> (T, D) rows of ``table`` times ``scale``."""

    @abstractmethod
    def rms_norm(self, x: Act, w: Weight, eps: float) -> Act:
        """Normalise the last dim: x / sqrt(mean(x^2) + eps) * w. x (..., D), w (D,)."""

    @abstractmethod
    def matmul(self, x: Act, w: Weight) -> Act:
        """(T, K) x (N, K)^T -> (T, N), ``w`` in its stored (possibly quantized) format."""

    @abstractmethod
    def rope(self, x: Act, positions: Act, base: float, scale: float) -> Act:
        """NeoX-style rotary embedding of (T, H, Dh): pairs (i, i + Dh/2), angle pos/scale * base^(-2i/Dh)."""

    @abstractmethod
    def attention(
        self, q: Act, k: Act, v: Act, layer: int, batch: StepBatch, window: int | None, scale: float
    ) -> Act:
        """Write k, v (T, Hkv, Dh) into ``layer``'s paged cache, then causal attention of q (T, H, Dh)
        over each sequence's cached positions (the last ``window`` only, if given) -> (T, H * Dh). A row
        with ``batch.visible`` sees up to that position instead of its own (an image's soft tokens see the
        whole image); the window still counts back from the row's own position."""

    @abstractmethod
    def geglu(self, gate: Act, up: Act) -> Act:
        """gelu_tanh(gate) * up, elementwise on (T, F)."""

    @abstractmethod
    def add(self, a: Act, b: Act) -> Act:
        """a + b, same shapes."""

    @abstractmethod
    def rows(self, x: Act, idx: Act) -> Act:
        """(T, D) -> (len(idx), D): gather rows."""

    def vision_ops(self) -> VisionOps:
        """The op interface the vision tower runs on (model/siglip.py); the numpy reference by default."""
        return VisionOps()

    def put_rows(self, x: Act, idx: np.ndarray, values: np.ndarray) -> Act:
        """(T, D) with rows ``idx`` (R,) replaced by ``values`` (R, D) float32 (an image's soft tokens)."""
        raise NotImplementedError(f"the {self.name} backend cannot take input embeddings (image input)")

    # -- fused ops: the forward pass calls these; the defaults compose the primitives above, and a backend
    # overrides one where doing it in one pass pays (the Vulkan backend: fewer dispatches and barriers) ---
    def matmuls(self, x: Act, ws: list[Weight]) -> list[Act]:
        """Several projections of one input (q, k and v): ``[matmul(x, w) for w in ws]``."""
        return [self.matmul(x, w) for w in ws]

    def norm_rope(self, x: Act, w: Weight, eps: float, positions: Act, base: float, scale: float) -> Act:
        """Per-head RMS norm, then RoPE: x (T, H, Dh), w (Dh,) -> (T, H, Dh)."""
        return self.rope(self.rms_norm(x, w, eps), positions, base, scale)

    def prefetch(self, ws: list[Weight]) -> None:  # noqa: B027 - optional hook
        """A hint: the next op reads the weights ``ws`` (together); a backend whose device has a cache that
        holds part of them may start loading them now, beside the last op (which, at decode sizes, waits on
        latency rather than on memory bandwidth). Default: nothing."""

    def normed_attention(
        self,
        q: Act,
        k: Act,
        v: Act,
        wq: Weight,
        wk: Weight,
        eps: float,
        batch: StepBatch,
        rope: tuple[float, float],
        layer: int,
        window: int | None,
        scale: float,
    ) -> Act:
        """Attention with its inputs' per-head norm and RoPE: ``norm_rope`` of q (T, H, Dh) and of k (T, Hkv,
        Dh) with ``rope`` = (base, scale) at the batch's positions, then ``attention`` -> (T, H * Dh)."""
        base, rscale = rope
        q = self.norm_rope(q, wq, eps, batch.positions, base, rscale)
        k = self.norm_rope(k, wk, eps, batch.positions, base, rscale)
        return self.attention(q, k, v, layer, batch, window, scale)

    def geglu_matmul(self, x: Act, gate: Weight, up: Weight) -> Act:
        """gelu_tanh(x · gateᵀ) * (x · upᵀ): x (T, D) -> (T, F)."""
        return self.geglu(self.matmul(x, gate), self.matmul(x, up))

    def ffn(self, x: Act, gate: Weight, up: Weight, down: Weight) -> Act:
        """The feed-forward block: ``geglu_matmul(x, gate, up) · downᵀ``: x (T, D) -> (T, D). Its result,
        as :meth:`matmul_for_residual`'s, is read only as ``residual_norm``'s ``a``."""
        return self.matmul_for_residual(self.geglu_matmul(x, gate, up), down)

    def matmuls_for_attention(self, x: Act, ws: list[Weight]) -> list[Act]:
        """``matmuls`` (q, k, v) whose results are read only by ``normed_attention`` (through ``reshape``), so
        a backend may leave them in a form only that op reads (Vulkan: K-split partial sums)."""
        return self.matmuls(x, ws)

    def matmul_for_residual(self, x: Act, w: Weight) -> Act:
        """``matmul`` whose result is read only as ``residual_norm``'s ``a``, so a backend may leave it in a
        form only that op reads (Vulkan: a GEMM's K-split partial sums, which residual_norm adds)."""
        return self.matmul(x, w)

    def residual_norm(
        self, x: Act, a: Act, w_a: Weight, w_next: Weight | None, eps: float
    ) -> tuple[Act, Act | None]:
        """The step between sub-layers: x' = x + rms_norm(a, w_a), and h = rms_norm(x', w_next) (None when
        ``w_next`` is None). x, a (T, D) -> (x', h)."""
        x = self.add(x, self.rms_norm(a, w_a, eps))
        return x, None if w_next is None else self.rms_norm(x, w_next, eps)

    @abstractmethod
    def reshape(self, x: Act, shape: tuple[int, ...]) -> Act:
        """A view of x with a new shape (same element count)."""

    @abstractmethod
    def to_numpy(self, x: Act):
        """Read an activation back to the host as a numpy array."""

    def describe(self) -> dict[str, Any]:
        """Backend facts for status: name, device, memory placement."""
        return {"backend": self.name, "device": self.device}
