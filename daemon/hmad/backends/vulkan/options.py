"""VulkanOptions: every knob the Vulkan backend reads, in one frozen dataclass.

The daemon's config (the ``vulkan`` section) sets the first group; the rest are tuning knobs that benchmarks
sweep (bench/bench_vulkan_model.py ``--sweep attr=v1,v2``: each value is ``dataclasses.replace(options,
attr=v)`` handed to :meth:`VulkanBackend.set_options`, which drops the recordings). ``None`` means "auto":
:func:`hmad.backends.vulkan.policy.resolve` turns every auto into the value for the device, and the backend
keeps only resolved options. Why each default is what it is: docs/tuning.md.
"""

from __future__ import annotations

from dataclasses import dataclass

MATVEC_MODES = ("exact", "int8", "float")  # x as three int8 planes (float32-exact), one (q8_1), or float32
KV_DTYPES = {"float32": ("f32", 4), "float16": ("f16", 2)}
#: the fused kernels ``fuse`` turns on: q/k norms + RoPE + the cache write (norm_rope_kv.comp); the down
#: projection's int8 input from the GeGLU mat-vec (one token: matvec_qout.glsl); the q, k, v, o and down
#: GEMMs' K-split partial sums added by the ops reading them (norm_rope_kv.comp, residual_norm.comp)
FUSIONS = ("norm_rope_kv", "qout", "split_sums")


@dataclass(frozen=True)
class VulkanOptions:
    """The Vulkan backend's options (config keys first, then tuning knobs); None: auto (policy.resolve)."""

    # -- the config's vulkan section (hmad.config.VulkanConfig) and the engine's ------------------------
    device: int | str | None = None  # index or name substring; None: the best device
    device_local_bytes: int | None = None  # caps on the memory plan's heaps (None: the heap's budget)
    host_visible_bytes: int | None = None
    kv_dtype: str = "float32"  # KV_DTYPES
    matvec: str = "exact"  # MATVEC_MODES: the decode-step matmul's x
    coopmat: str = "auto"  # auto | off: the cooperative-matrix GEMM where the device has it
    coopmat_min_tokens: int = 4  # decode batches of this many tokens or more on it (at least 2)
    mmq: str = "auto"  # auto | off: the exact path's int8 cooperative-matrix GEMM
    mmq_min_tokens: int = 2  # steps of this many tokens or more on it (at least 2)
    fuse: bool | str = True  # FUSIONS: all, none, or (to measure them one by one) a "+"-joined subset
    prefetch_bytes: int | None = None  # weights read ahead into the GPU's cache at decode (None: auto)
    step_timeout_s: float = 600.0  # a step's fence not signalled by then: a GPU hang
    deterministic: bool | str = "auto"  # batch-invariant kernels (engine.deterministic)
    timestamps: bool = False  # a GPU timestamp after every command (profiling)
    # -- tuning knobs (read when recording; benchmarks sweep them) ---------------------------------------
    mmq_min_weights: int | None = None  # weights (elements) the int8 GEMM takes at least
    mmq_target: int | None = None  # its K split: about this many workgroups a dispatch
    topk_groups: int | None = None  # topk.comp's first-stage workgroups in all
    attention_min_keys: int | None = None  # keys an attention split takes at least
    attention_target: int | None = None  # attention splits for about this many workgroups
    attention_prefill_target: int | None = None  # ... and the prefill tiles' splits
    attention_kl: bool = True  # attention_decode_kl where it fits
    attention_cm: bool = True  # the prefill tiles' attention on cooperative matrices where the GEMM has them
    geglu_xh: int | None = None  # the GeGLU as the down GEMM's operand from this many tokens (0: never)
    coopmat_layout: str | None = None  # the Q4_K prefill GEMM's layout for every weight (None: the pick)
    coopmat_decode_layout: str | None = None  # ... of decode batches (None: the pick)
    coopmat_waves: bool = True  # the GEMM's K split for whole waves of its measured residency
    coopmat_prefill_target: int | None = None  # else for about this many workgroups (prefill) ...
    coopmat_decode_target: int | None = None  # ... and decode batches (None: kernels_matmul's)
    matmul_registers: str = "auto"  # auto | on | off: the many-token float mat-mat in registers
    matvec_one_lane_rows: int | None = None  # int8 mat-vecs of this many rows one lane a row group (0: never)

    def __post_init__(self):
        checks = (
            ("kv_dtype", self.kv_dtype, tuple(KV_DTYPES)),
            ("matvec", self.matvec, MATVEC_MODES),
            ("coopmat", self.coopmat, ("auto", "off")),
            ("mmq", self.mmq, ("auto", "off")),
            ("matmul_registers", self.matmul_registers, ("auto", "on", "off")),
        )
        for name, value, allowed in checks:
            if value not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
        if self.deterministic != "auto" and not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be true, false or 'auto', got {self.deterministic!r}")

    @property
    def planes(self) -> int:
        """int8 planes of x on the int8 mat-vec path: 3 (exact), 1 (int8), 0 (float: not taken)."""
        return {"exact": 3, "int8": 1}.get(self.matvec, 0)

    def fused(self, *parts: str) -> bool:
        """Whether ``fuse`` takes any of these FUSIONS."""
        if isinstance(self.fuse, str):
            return any(p in self.fuse.split("+") for p in parts)
        return bool(self.fuse)
