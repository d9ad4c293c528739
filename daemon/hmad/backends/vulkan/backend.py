"""VulkanBackend: the Gemma 3 forward pass recorded into a command buffer once per batch-size bucket.

Design (why not "ops become no-ops on replay"): :meth:`Backend.run` is the step entry point
(``Model.forward`` calls ``backend.run(net, batch)``; the CPU backend's ``run`` is just ``net.forward``).
Here ``run`` does, per step:

1. **bucket** (graph.py): T tokens -> ``T_b`` (1, 2, 4 ... 512, then multiples of 512), S_out logit rows ->
   ``O_b`` (the same ladder, at least 1); the key ``(T_b, O_b)`` names one recording;
2. **metadata** (stepmeta.py): :class:`StepMetaLayout` ``(T_b, T_b, max_table)`` packs the real batch for
   the metadata buffer of the next parity; rows past T are padding (token 0, slots NONE, so kv_write skips
   them and attention writes zeros; logit rows past S_out point at row 0, never read back);
3. **record once** (recording.py): with no recording for the key, ``net.forward`` runs *once* on a
   shape-only batch while the ops below append dispatches instead of computing;
4. ``to_numpy`` / ``greedy`` / ``topk`` / ``launch_greedy`` / ``launch_sampled`` submit the step's command
   buffer between a tiny *head* (its metadata into device memory) and a tiny per-bucket *tail* (the logits
   read back, argmaxed, top-k'd or sampled: tails.py) in **one** vkQueueSubmit with one fence wait
   (steps.py; ``launch_*`` + ``collect``: the same, split, two steps in flight at most).

The rooms: the options resolved once (options.py, policy.resolve) and the kernel choices as pure functions of
them (policy.py); :class:`~.context.RecordContext` holds what every op reads while recording (device,
options, kernels, scratch, the bound buffers); the ops are functions of it (ops_norm.py, ops_matmul.py,
ops_attention.py), which the methods below point at it; placement.py plans and uploads the weights and KV
pools. This class is the facade: the op interface of backends/base.py and the step's life cycle.

Fused (the ops of backends/base.py that Gemma3 calls): residual_norm (post-norm + residual + next pre-norm,
one dispatch that also writes h as the mat-vec's int8 planes), normed_attention (per-head q/k norm + RoPE +
the KV-cache write in one dispatch, norm_rope_kv.comp), geglu_matmul (gate and up projections + GeGLU in one
mat-vec dispatch; at one token its last workgroups also quantize the output for the down projection,
matvec_qout.glsl); attention's reduce pass also writes its output as int8 planes; the GEMMs' K-split partial
sums go unsummed into the op reading them, which adds them (q, k, v: norm_rope_kv; o, down: residual_norm;
matmuls_for_attention, matmul_for_residual). ``fuse`` (FUSIONS) turns the norm_rope_kv, q8-tail and
split-sum fusions off (to measure them, or on a driver where cross-workgroup reads misbehave). Where a fused
op cannot take its shapes it is composed from the plain ops (backends/base.py's defaults).
Deterministic (``deterministic``, engine.deterministic; docs/determinism.md): one kernel and one reduction
order per row whatever the step's row count, so a sequence's logits are bit-identical alone or in any mix:
every matmul on the mat-vec (the int8 one in one fixed layout, else the float one), 8 tokens a dispatch,
never the cooperative-matrix or tiled mat-mat; the int8 planes of x always made by the op before (the
residual norm, attention's reduce pass); attention in DETERMINISTIC_SPLITS splits for every bucket (a
split's keys then depend on the row's position only) and never the prefill tiles.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from hmad.backends.base import Backend
from hmad.backends.vulkan import ops_attention, ops_matmul, ops_norm, policy
from hmad.backends.vulkan.activations import Act
from hmad.backends.vulkan.bias import BIAS_ENTRIES
from hmad.backends.vulkan.context import RecordContext
from hmad.backends.vulkan.device import Device
from hmad.backends.vulkan.graph import BUCKETS, Launched, StepOutput, bucket, buckets_upto
from hmad.backends.vulkan.options import FUSIONS, KV_DTYPES, VulkanOptions
from hmad.backends.vulkan.placement import Placement, VkWeight
from hmad.backends.vulkan.policy import Q8_MAX_T
from hmad.backends.vulkan.recording import Recordings
from hmad.backends.vulkan.steps import Submitter
from hmad.backends.vulkan.tails import TOPK_CANDIDATES, Readback
from hmad.core.batch import SeqSlice, StepBatch
from hmad.core.kv_layout import KVLayout
from hmad.core.tensors import WeightTensor

__all__ = ["VulkanBackend"]


def _check_bias(x: StepOutput) -> None:
    """A tail that adds the step's logit adjustments needs them all in its buffer (bias.py)."""
    if not x.bias_ok:
        raise ValueError(f"the step's logit adjustments are more than the {BIAS_ENTRIES} its tails take")


def _option(name: str) -> property:
    """A read-only attribute of the backend that is its resolved option ``name``."""
    return property(lambda self: getattr(self.ctx.options, name), doc=f"options.{name} (read-only)")


class VulkanBackend(Backend):
    """The forward pass on a Vulkan device; see the module docstring for the recording scheme."""

    name = "vulkan"
    greedy_on_device = True
    sample_on_device = True
    #: engine.deterministic auto: off until its price on a GPU is measured (bench/bench_determinism.py;
    #: docs/determinism.md): on if it costs at most 10 % at decode 1/8/32 and prefill 512 on both shapes
    deterministic_auto = False
    topk_max = TOPK_CANDIDATES
    #: a step's logit adjustments (StepBatch.bias) its argmax, top-k and draw tails add at most (bias.py)
    bias_max = BIAS_ENTRIES

    def __init__(self, options: VulkanOptions | None = None, **changes):
        """``options`` (else the defaults) with ``changes`` (VulkanOptions' field names: the config's
        vulkan section passes its keys this way); every auto resolved for the device (policy.resolve)."""
        opts = replace(options, **changes) if options is not None else VulkanOptions(**changes)
        self.dev = Device(opts.device)
        self.caps = policy.caps_of(self.dev)
        self.device = self.dev.name
        resolved = policy.resolve(opts, self.caps, self.deterministic_auto)
        self.ctx = RecordContext(self.dev, self.caps, resolved)
        self.place = Placement(self.dev, (opts.device_local_bytes, opts.host_visible_bytes), self.ctx.align)
        self.recorded = Recordings(self.ctx)
        self.submit = Submitter(self.ctx, self.place)
        self.readback = Readback(self.ctx)
        self.topk_steps = 0  # steps sampled from on-device top-k candidates
        self.sampled_steps = 0  # steps drawn on the device (launch_sampled)
        self.row_steps = 0  # steps whose whole logits rows were read back (to_numpy)

    @property
    def options(self) -> VulkanOptions:
        """The resolved options the recordings follow (``set_options`` changes them)."""
        return self.ctx.options

    def set_options(self, options: VulkanOptions) -> None:
        """Record later graphs with ``options`` (resolved for the device; the device, memory caps and KV
        dtype stay as constructed): every recording is dropped. Benchmarks sweep a knob this way."""
        self.ctx.options = policy.resolve(options, self.caps, self.deterministic_auto)
        self.recorded.drop()

    def set_timestamps(self, on: bool) -> None:
        """Record later graphs with (or without) a GPU timestamp after every command (profiling; it costs
        time per dispatch). Drops the existing recordings."""
        self.set_options(replace(self.options, timestamps=on))

    # -- what status, tests and benchmarks read ----------------------------------------------------------
    matvec = _option("matvec")
    planes = _option("planes")  # int8 planes of x on the int8 mat-vec path: 3, 1, or 0 (not taken)
    kv_dtype = _option("kv_dtype")
    timestamps = _option("timestamps")
    prefetch_bytes = _option("prefetch_bytes")
    attention_kl = _option("attention_kl")

    @property
    def deterministic(self) -> bool:
        return self.options.deterministic

    @deterministic.setter
    def deterministic(self, on: bool) -> None:  # bench/bench_determinism.py sets it this way
        self.set_options(replace(self.options, deterministic=on))

    @property
    def coopmat(self) -> bool:
        """The cooperative-matrix GEMM at all (policy.coopmat_on)."""
        return policy.coopmat_on(self.options, self.caps)

    @property
    def coopmat_min_t(self) -> int:
        return max(2, self.options.coopmat_min_tokens)

    @property
    def mmq_k(self) -> int | None:
        """The int8 GEMM's product K where the device has it and the options allow it, else None."""
        return ops_matmul.mmq_k(self.ctx)

    graphs = property(lambda self: self.recorded.graphs, doc="the recordings by (T_b, O_b)")
    recordings = property(lambda self: self.recorded.count, doc="forward passes recorded")
    steps = property(lambda self: self.submit.steps, doc="steps submitted and waited for")
    last_gpu_ns = property(lambda self: self.submit.last_gpu_ns, doc="the last step's GPU time (timestamps)")
    weights_plan = property(lambda self: self.place.weights_plan, doc="the weights' memory plan")
    kv_layout = property(lambda self: self.ctx.kv_layout, doc="the KV pools' layout (alloc_kv)")

    # -- residency -------------------------------------------------------------------------------------
    def load_weights(
        self,
        tensors: dict[str, WeightTensor],
        progress: Callable[..., None] | None = None,
        background: bool = False,
    ) -> dict[str, VkWeight]:
        """Plan, allocate and upload every weight (placement.py; ``background``: Placement.load_weights)."""
        return self.place.load_weights(tensors, progress, background)

    def wait_resident(self) -> None:
        """Until a background upload is done (raises its error, if it failed)."""
        self.place.wait_resident()

    def unsupported(self, cfg) -> str | None:
        return ops_attention.attention_limits(cfg.head_dim, cfg.n_heads // cfg.n_kv_heads)

    def alloc_kv(self, layout: KVLayout) -> None:
        """Plan and allocate the paged pools (one K and one V range per layer) where the weights left room.

        The same layout again (a new Scheduler of the same configuration) keeps the pools and the recorded
        graphs: a new scheduler starts with every block free, and a position is written before it is read.
        """
        if layout == self.ctx.kv_layout and self.place.kv_mem is not None:
            return
        self.recorded.drop()
        self.ctx.kv_layout, self.ctx.kv_views = layout, {}
        self.ctx.kv_views = self.place.alloc_kv(layout, KV_DTYPES[self.kv_dtype][1])
        self.recorded.ensure_meta(BUCKETS[-1])

    def describe(self) -> dict[str, Any]:
        mem = self.place.memory()
        mem["device-local: scratch activations"] = self.ctx.scratch.nbytes
        if self.ctx.embeds is not None:  # the steps' input embeddings (an image's soft tokens), both parities
            mem["host-visible: input embeddings"] = self.ctx.embeds.nbytes
        return {
            "backend": self.name,
            "device": self.device,
            "memory": mem,
            "matmul": {
                "matvec": self.matvec,
                "coopmat": f">= {self.coopmat_min_t} tokens"
                if self.coopmat
                else "off (device lacks it or config)",
                "int8 gemm": self._mmq_status(),
                "fused": [f for f in FUSIONS if self.options.fused(f)],
                "prefetch": f"{self.prefetch_bytes} bytes a matmul at decode"
                if self.prefetch_bytes
                else "off",
            },
            "deterministic": self.deterministic,
            "recordings": self.recordings,
            "buckets": sorted(self.graphs),
        }

    def _mmq_status(self) -> str:
        """What ``hmactl status`` says of the int8 GEMM (policy.mmq_for)."""
        if not self.mmq_k:
            return "off (device lacks int8 cooperative matrices, or config)"
        if self.planes != 3 or self.deterministic:
            return "off (matvec is not exact, or deterministic mode)"
        top = self.coopmat_min_t - 1 if self.coopmat else Q8_MAX_T  # the float16 GEMM takes the rest
        mmq_min_t = max(2, self.options.mmq_min_tokens)
        takes = [b for b in BUCKETS if mmq_min_t <= b <= min(top, Q8_MAX_T)]  # steps run padded to these
        if not takes:
            return f"not used: the float16 GEMM takes steps of {self.coopmat_min_t}+ tokens"
        weights = self.options.mmq_min_weights
        return f"steps of {takes[0]}..{takes[-1]} tokens on Q4_K weights of {weights}+ elements"

    def close(self) -> None:
        with contextlib.suppress(Exception):  # an upload that failed: its error was the caller's to see
            self.wait_resident()
        self.dev.wait_idle()
        if self.__dict__.get("_vision_ops") is not None:
            self._vision_ops.close()
        self.recorded.drop()
        self.ctx.close_kernels()
        self.place.close()
        self.ctx.close_meta()
        self.readback.close()
        self.ctx.close_rings()
        self.submit.close()
        self.dev.close()

    # -- the step: bucket, metadata, record once, replay ----------------------------------------------
    def prepare(self, net, max_tokens: int, max_rows: int) -> None:
        """Record every bucket a step of up to ``max_tokens`` tokens can fall in, largest first (so the
        metadata and candidate buffers are sized once), each with its top-k tail. From here on a step
        computes the logits of min(tokens, bucket(max_rows)) rows whatever its own count: one recording per
        token bucket, not one per (tokens, rows) pair (the extra rows cost the output projection a few
        rows more: noise beside a step)."""
        rec = self.recorded
        rec.logit_rows_b = bucket(max(1, max_rows))
        top = bucket(max(1, max_tokens))
        rec.ensure_meta(top)
        for t_b in reversed(buckets_upto(top)):
            o_b = min(t_b, rec.logit_rows_b)
            graph = rec.graphs.get((t_b, o_b)) or rec.record(net, t_b, o_b)
            for parity in (0, 1):
                self.readback.topk_tail(graph, parity)
                self.readback.sample_tail(graph, parity)
        if self.dev.info.is_cpu:  # lavapipe: no first-submit cost to hide, and each replay a whole prefill
            return
        for t_b in buckets_upto(top):  # each replayed once: no request pays a recording's first submit
            self.greedy(self.run(net, self._warm_up_batch(t_b)))

    def _warm_up_batch(self, n: int) -> StepBatch:
        """One sequence of ``n`` prompt tokens in the first blocks of the pools: a step that replays a bucket
        before any request runs (nothing is cached yet: the blocks it writes belong to no sequence)."""
        lay = self.ctx.kv_layout
        glob = np.arange(min(-(-n // lay.block_size), lay.n_global_blocks), dtype=np.int32)
        loc = np.arange(min(lay.ring_blocks, lay.n_local_blocks), dtype=np.int32)
        s = SeqSlice(0, 0, n, 0, glob, loc)
        return StepBatch.build([(s, [0] * n, True)], lay.block_size)

    def run(self, net, batch: StepBatch) -> StepOutput:
        assert self.ctx.kv_layout is not None, "alloc_kv() before the first step"
        return self.submit.pack(self.recorded.for_batch(net, batch), batch)

    @property
    def pipelined(self) -> bool:
        """Whether ``launch_greedy`` may be called with a step still in flight (not while profiling: two
        pending submits of one recording would share its timestamp queries)."""
        return not self.timestamps

    def launch_greedy(self, x: StepOutput) -> Launched:
        """Submit step ``x`` with the argmax on the GPU and return without waiting; ``collect`` reads its
        ids. Rows of its batch with a ``feed`` entry take their token from the ids of the step launched
        just before it (which may still be running). At most two steps in flight."""
        _check_bias(x)
        return self.submit.launch(x, x.graph.argmax_tails[self.submit.parity])

    def launch_sampled(self, x: StepOutput) -> Launched:
        """As ``launch_greedy``, each row's token drawn on the GPU from its top-k candidates with the
        batch's ``sampling`` (sample_topk.comp); ``collect`` reads the ids, then ``candidates`` the
        candidates they were drawn from."""
        _check_bias(x)
        done = self.submit.launch(x, self.readback.sample_tail(x.graph, self.submit.parity), sampled=True)
        self.sampled_steps += 1
        return done

    def collect(self, done: Launched) -> np.ndarray:
        """Wait for a launched step and read back its token ids (S_out,) int64."""
        self.submit.wait(done)
        return self.ctx.ids[done.parity].array(np.uint32)[: done.n_out].astype(np.int64)

    def candidates(self, done: Launched) -> tuple[np.ndarray, np.ndarray]:
        """A collected ``launch_sampled`` step's candidates (ids, values), as ``topk`` returns them (no
        log-sum-exps); read before the next launch on its parity."""
        if not done.sampled or self.submit.in_flight[done.parity] is done:
            raise RuntimeError("candidates(): a sampled step, once collected")
        return self.readback.candidates(self.readback.cands[done.parity], done.graph, done.n_out)

    def to_numpy(self, x) -> np.ndarray:
        """Run the step and read back its logits rows (S_out, V) float32."""
        if not isinstance(x, StepOutput):
            raise TypeError("VulkanBackend.to_numpy reads a step's logits (what run() returns)")
        self.submit.run_alone(x, self.readback.copy_tail(x.graph))
        self.row_steps += 1
        return self.readback.logits(x.n_out, x.shape[1])

    def greedy(self, x) -> np.ndarray:
        """Run the step with the argmax on the GPU; read back one token id per logits row."""
        if x.feed:
            raise ValueError("only launch_greedy takes a batch with fed rows")
        return self.collect(self.launch_greedy(x))

    def topk(self, x) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Run the step with topk.comp, row_lse.comp and row_gather.comp on the GPU; read back the best
        TOPK_CANDIDATES (id, value) pairs of each logits row and its log-sum-exp (8 bytes a candidate and 4
        a row, not the row's V floats); its target's logit waits in the buffer for ``topk_targets``."""
        _check_bias(x)
        self.submit.run_alone(x, self.readback.topk_tail(x.graph, self.submit.parity))
        self.topk_steps += 1
        ids, vals = self.readback.candidates(self.readback.topk_buf, x.graph, x.n_out)
        return ids, vals, self.readback.lse(x.graph, x.n_out)

    def topk_targets(self, x) -> np.ndarray:
        """Step ``x``'s targets' logits (S_out,) float32, NaN where a row has none: what its ``topk`` tail
        gathered (row_gather.comp, 4 bytes a row); read before the next top-k step."""
        return self.readback.targets(x.graph, x.n_out)

    def vision_ops(self):
        """The vision encoder's ops on this device (vision.py's VulkanVisionOps), made once, so the weights
        it uploads stay on the device across encodes."""
        from hmad.backends.vulkan.vision import VulkanVisionOps

        if self.__dict__.get("_vision_ops") is None:
            self._vision_ops = VulkanVisionOps(self.ctx)
        return self._vision_ops

    # -- ops: append dispatches (ops_norm, ops_matmul, ops_attention); the fused ones fall back to the
    # compositions of backends/base.py where their kernels cannot take the shapes ---------------------------
    def embed(self, table: VkWeight, tokens, scale: float) -> Act:
        return ops_norm.embed(self.ctx, table, tokens, scale)

    def put_rows(self, x: Act, idx, values) -> Act:
        """x as it is, no dispatch: x is ``embed``'s output, whose recorded gather already takes each row's
        input embedding at replay (the metadata's embed_src rows, from the embeds buffer the step's launch
        fills: ops_norm.embed, steps.py). The forward pass runs here only to be recorded, on a shape-only
        batch without embeds, so it does not call this; were it called, x would already hold the rows."""
        return x

    def rms_norm(self, x: Act, w: VkWeight, eps: float) -> Act:
        return ops_norm.rms_norm(self.ctx, x, w, eps)

    def residual_norm(self, x: Act, a: Act, w_a: VkWeight, w_next: VkWeight | None, eps: float):
        done = ops_norm.residual_norm(self.ctx, x, a, w_a, w_next, eps)
        if done is None:
            return super().residual_norm(x, ops_norm.summed(self.ctx, a), w_a, w_next, eps)
        return done

    def norm_rope(self, x: Act, w: VkWeight, eps: float, positions, base: float, scale: float) -> Act:
        return ops_norm.norm_rope(self.ctx, x, w, eps, base, scale)

    def rope(self, x: Act, positions, base: float, scale: float) -> Act:
        return ops_norm.rope(self.ctx, x, base, scale)

    def geglu(self, gate: Act, up: Act) -> Act:
        return ops_norm.geglu(self.ctx, gate, up)

    def add(self, a: Act, b: Act) -> Act:
        return ops_norm.add(self.ctx, a, b)

    def rows(self, x: Act, idx) -> Act:
        """Gather the step's logit rows (indices from the metadata) with the float32 embed kernel."""
        return ops_norm.gather_rows(self.ctx, x, idx)

    def reshape(self, x: Act, shape: tuple[int, ...]) -> Act:
        return ops_norm.reshape(x, shape)

    def matmul(self, x: Act, w: VkWeight, keep: bool = False) -> Act:
        """y = x · wᵀ (ops_matmul.matmul; ``keep``: its K-split partial sums left for y's reader)."""
        return ops_matmul.matmul(self.ctx, x, w, keep)

    def matmuls_for_attention(self, x: Act, ws: list[VkWeight]) -> list[Act]:
        """matmuls whose K-split partial sums norm_rope_kv adds as it reads them (where normed_attention runs
        it): the three projections' split_reduce dispatches fewer."""
        keep = self.options.fused("split_sums") and self.options.fused("norm_rope_kv")
        return [self.matmul(x, w, keep=keep) for w in ws]

    def matmul_for_residual(self, x: Act, w: VkWeight) -> Act:
        """matmul whose K-split partial sums (the cooperative-matrix or int8 GEMM's, W in one bind range)
        residual_norm adds as it reads them: no split_reduce dispatch, and y's floats not written."""
        return self.matmul(x, w, keep=self.options.fused("split_sums"))

    def geglu_matmul(self, x: Act, gate: VkWeight, up: VkWeight) -> Act:
        y = ops_matmul.geglu_matmul(self.ctx, x, gate, up)
        return super().geglu_matmul(x, gate, up) if y is None else y

    def ffn(self, x: Act, gate: VkWeight, up: VkWeight, down: VkWeight) -> Act:
        """The feed-forward block; the GeGLU straight into the down GEMM's operand where policy.geglu_xh
        says so (ops_matmul.ffn_geglu_xh)."""
        if not policy.geglu_xh(self.options, self.caps, x.shape[0], gate, up, down):
            return super().ffn(x, gate, up, down)
        return ops_matmul.ffn_geglu_xh(self.ctx, x, gate, up, down)

    def prefetch(self, ws: list[VkWeight]) -> None:
        ops_matmul.prefetch(self.ctx, ws)

    def attention(self, q: Act, k: Act, v: Act, layer: int, batch, window: int | None, scale: float) -> Act:
        return ops_attention.attention(self.ctx, q, k, v, layer, window, scale)

    def normed_attention(self, q, k, v, wq, wk, eps: float, batch, rope, layer: int, window, scale: float):
        """The q and k norms, RoPE and the cache write in one dispatch (ops_attention.normed_attention),
        unless ``fuse`` leaves norm_rope_kv out."""
        if not self.options.fused("norm_rope_kv"):
            q, k, v = (ops_norm.summed(self.ctx, a) for a in (q, k, v))
            return super().normed_attention(q, k, v, wq, wk, eps, batch, rope, layer, window, scale)
        return ops_attention.normed_attention(self.ctx, q, k, v, wq, wk, eps, rope, layer, window, scale)
