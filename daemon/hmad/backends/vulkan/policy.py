"""Which kernel runs for which step: pure functions of the options, the device's capabilities and the shapes.

Nothing here touches a device: :class:`DeviceCaps` holds the few facts of a device the choices read (made
once by :func:`caps_of`), so that every choice is testable without a GPU, the cooperative-matrix paths that
lavapipe cannot run included (tests/test_vulkan_policy.py). The recording code (backend.py) asks these
functions and records what they say. Every tuned constant here has one line of why; the sweeps and figures
behind it are in docs/tuning.md.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Protocol

from hmad.backends.vulkan.kernels_coopmat import COOPMAT_TYPES, coopmat_usable
from hmad.backends.vulkan.kernels_matmul import MATMUL_TYPES, MATVEC_MAX_T, UNIT_TYPES
from hmad.backends.vulkan.kernels_mmq import MMQ_TARGET_GROUPS, mmq_has_n8, mmq_usable
from hmad.backends.vulkan.options import VulkanOptions
from hmad.backends.vulkan.shapes import ATTENTION_PREFILL_TILE, TOPK_GROUPS
from hmad.backends.vulkan.variants import (
    ATTENTION_DECODE_DPL,
    ATTENTION_DECODE_GROUPS,
    ATTENTION_DECODE_KL_GROUPS,
    ATTENTION_ONE_LANE_GROUPS,
    ATTENTION_PREFILL_CM_DH,
    ATTENTION_PREFILL_DPL,
)
from hmad.core.tensors import QType

# -- tuned constants (docs/tuning.md has the sweep behind each) -----
#: steps of up to this many tokens (decode batches) run the int8 mat-vec, MATVEC_MAX_T tokens a dispatch
Q8_MAX_T = 32
#: attention splits per (token, KV head) = clamp(TARGET / (tokens * KV heads), 1, MAX): fewer splits cost
#: less in partials written and reduced than they lose in parallel keys (tuning: attention_target)
ATTENTION_TARGET_GROUPS = 256
ATTENTION_MAX_SPLITS = 64
#: keys an attention_decode(_kl) split takes at least (tuning: attention_min_keys)
ATTENTION_MIN_KEYS = 32
#: the prefill tiles' splits for about this many workgroups (tuning: attention_prefill_target)
ATTENTION_PREFILL_TARGET_GROUPS = 256
#: decode batches run the cooperative-matrix GEMM on weights of at least this many elements
COOPMAT_DECODE_MIN_WEIGHTS = 4 << 20
#: the coopmat GEMM's K split in prefill steps: about this many workgroups (tuning: coopmat_prefill_target)
COOPMAT_PREFILL_TARGET_GROUPS = 512
#: weights (elements) the int8 GEMM takes at decode sizes (tuning: mmq_min_weights)
MMQ_MIN_WEIGHTS = 4 << 20
#: the fewest tokens of a step whose FFN writes its GeGLU as the down GEMM's operand (tuning: geglu_xh)
GEGLU_XH_MIN_TOKENS = 64
#: prefetch_bytes auto on a discrete GPU (an integrated GPU's cache is too small to hold them; tuning)
PREFETCH_AUTO_BYTES = 8 << 20
#: workgroups a split-K dispatch aims for per host thread of a CPU implementation: a few, so that the
#: threads finish together, without the empty splits a GPU-sized target leaves (tuning: CPU drivers)
CPU_GROUPS_PER_THREAD = 4
#: on a CPU implementation, int8 mat-vecs of this many rows or more (all of them) run one invocation per
#: row group ("_l4", "_l8"): its SIMD runs invocations side by side, and 32 lanes on one row's short K sit
#: idle and then add through shared memory (tuning: matvec_one_lane_rows)
CPU_ONE_LANE_MIN_ROWS = 1


@dataclass(frozen=True)
class DeviceCaps:
    """The device facts the kernel choices read."""

    type: str = "discrete"  # VkPhysicalDeviceType: discrete | integrated | virtual | cpu | other
    coopmat: bool = False  # the float16 cooperative-matrix GEMM's shapes (kernels_coopmat.coopmat_usable)
    mmq_k: int | None = None  # the int8 product K of the int8 GEMM, or None (kernels_mmq.mmq_usable)
    mmq_n8: bool = False  # 16 x 8 int8 products too
    subgroup_size: int = 0
    subgroup_shuffle: bool = False
    subgroup_arithmetic: bool = False
    offset_align: int = 256  # minStorageBufferOffsetAlignment
    max_range: int = 1 << 27  # maxStorageBufferRange
    host_threads: int = 1  # the host's CPUs (a CPU implementation runs one workgroup on each)
    texel_loads: bool = False  # kernels read large inputs as storage texel buffers (physical.texel_loads)

    @property
    def is_cpu(self) -> bool:
        return self.type == "cpu"


def caps_of(dev) -> DeviceCaps:
    """The :class:`DeviceCaps` of an open :class:`~hmad.backends.vulkan.device.Device`."""
    mmq_k = mmq_usable(dev.info, dev.limits)
    return DeviceCaps(
        type=dev.info.type,
        coopmat=bool(coopmat_usable(dev.info)),
        mmq_k=mmq_k,
        mmq_n8=bool(mmq_k) and mmq_has_n8(dev.info, mmq_k),
        subgroup_size=dev.info.subgroup.get("size") or 0,
        subgroup_shuffle=bool(dev.caps["subgroup_shuffle"]),
        subgroup_arithmetic=bool(dev.caps["subgroup_arithmetic"]),
        offset_align=dev.limits["minStorageBufferOffsetAlignment"],
        max_range=dev.limits["maxStorageBufferRange"],
        host_threads=len(os.sched_getaffinity(0)),
        texel_loads=dev.texel_loads,
    )


def resolve(o: VulkanOptions, c: DeviceCaps, deterministic_auto: bool = False) -> VulkanOptions:
    """``o`` with every auto (None, "auto") replaced by its value on device ``c``; the other values kept."""
    parallel = c.host_threads if c.is_cpu else None

    def pick(value, default):
        return default if value is None else value

    det = deterministic_auto if o.deterministic == "auto" else o.deterministic
    return replace(
        o,
        deterministic=det,
        prefetch_bytes=pick(o.prefetch_bytes, PREFETCH_AUTO_BYTES if c.type == "discrete" else 0),
        mmq_min_weights=pick(o.mmq_min_weights, MMQ_MIN_WEIGHTS),
        mmq_target=pick(o.mmq_target, MMQ_TARGET_GROUPS),
        topk_groups=pick(o.topk_groups, TOPK_GROUPS),
        attention_min_keys=pick(o.attention_min_keys, ATTENTION_MIN_KEYS),
        attention_target=pick(o.attention_target, workgroup_target(ATTENTION_TARGET_GROUPS, parallel)),
        attention_prefill_target=pick(
            o.attention_prefill_target, workgroup_target(ATTENTION_PREFILL_TARGET_GROUPS, parallel)
        ),
        geglu_xh=pick(o.geglu_xh, GEGLU_XH_MIN_TOKENS),
        coopmat_prefill_target=pick(o.coopmat_prefill_target, COOPMAT_PREFILL_TARGET_GROUPS),
        matmul_registers="on" if matmul_registers(o.matmul_registers, c.type) else "off",
        matvec_one_lane_rows=one_lane_rows(o.matvec_one_lane_rows, c),
    )


def one_lane_rows(rows: int | None, c: DeviceCaps) -> int:
    """``matvec_one_lane_rows`` resolved: auto, CPU_ONE_LANE_MIN_ROWS on CPU implementations that read texel
    buffers (the one-lane layouts read W and x as texel buffers), else 0. A row count set where the device
    reads no texel buffers is refused (ValueError)."""
    if rows is None:
        return CPU_ONE_LANE_MIN_ROWS if c.is_cpu and c.texel_loads else 0
    if rows and not c.texel_loads:
        raise ValueError(
            f"matvec_one_lane_rows {rows}: the one-lane mat-vec layouts read texel buffers, which hmad "
            "uses on CPU implementations only (0 turns them off)"
        )
    return rows


class Weight(Protocol):
    """What the choices read of a weight: its type, (N, K) and stored bytes."""

    qtype: QType
    shape: tuple[int, ...]
    nbytes: int


# -- the matmuls -----
def matmul_registers(mode: str, device_type: str) -> bool:
    """Whether the many-token float mat-mat runs on the register-tiled kernel (mul_mat_reg.comp) rather
    than the shared-memory tiles (mul_mat.comp). ``auto``: on CPU implementations (device type ``cpu``),
    where a buffer or shared-memory load costs tens of products and a barrier suspends every invocation of
    the workgroup, so only reuse in registers pays (docs/tuning.md, "Large steps without cooperative
    matrices"); GPUs keep the shared-memory tiles."""
    return mode == "on" or (mode == "auto" and device_type == "cpu")


def matmul_kernel(t_name: str, registers: bool, texel: bool = False) -> str:
    """The float mat-mat of a step over MATVEC_MAX_T tokens for weights of type ``t_name``; the register
    kernel's ``_texel`` variant where the device reads texel buffers (``DeviceCaps.texel_loads``)."""
    if not registers:
        return f"mul_mat_{t_name}"
    return f"mul_mat_reg_{t_name}" + ("_texel" if texel else "")


def coopmat_on(o: VulkanOptions, c: DeviceCaps) -> bool:
    """The cooperative-matrix GEMM at all: the device has it and the options allow it."""
    return o.coopmat == "auto" and c.coopmat


def coopmat_steps(o: VulkanOptions, c: DeviceCaps, t: int) -> bool:
    """Whether a step of ``t`` tokens may run the cooperative-matrix mat-mat (on some weight)."""
    return coopmat_on(o, c) and not o.deterministic and t >= max(2, o.coopmat_min_tokens)


def coopmat_for(o: VulkanOptions, c: DeviceCaps, t: int, w: Weight) -> bool:
    """The cooperative-matrix mat-mat for steps over Q8_MAX_T tokens, and for decode batches of
    ``coopmat_min_tokens`` or more on big weights (there it reads W once where the 8-token int8 mat-vec
    reads it per 8 tokens; on small weights its extra dispatches cost more)."""
    if not coopmat_steps(o, c, t) or w.qtype not in COOPMAT_TYPES.values():
        return False
    return t > Q8_MAX_T or math.prod(w.shape) >= COOPMAT_DECODE_MIN_WEIGHTS


def q8_path(o: VulkanOptions, c: DeviceCaps, t: int, w: Weight) -> bool:
    """Decode-sized steps (up to Q8_MAX_T tokens, unless coopmat_for takes them) of a weight type the int8
    mat-vec reads (unless ``matvec="float"``); steps over MATVEC_MAX_T tokens need chunk offsets the
    device can bind. In deterministic mode every row count or none (whether it is taken must not depend
    on t)."""
    n, k = w.shape
    if coopmat_for(o, c, t, w):
        return False
    det, planes = o.deterministic, o.planes
    if not (planes and (det or t <= Q8_MAX_T) and w.qtype in UNIT_TYPES.values() and k % 64 == 0):
        return False
    step = MATVEC_MAX_T
    aligned = all(b % c.offset_align == 0 for b in (step * k * planes, step * k // 4, step * 4 * n))
    return aligned if det else t <= step or aligned


def q8_one_lane(o: VulkanOptions, n: int) -> bool:
    """Whether the int8 mat-vec of an N-row weight runs one invocation per row group (``_l4``, ``_l8``)."""
    return bool(o.matvec_one_lane_rows) and n >= o.matvec_one_lane_rows


def mmq_for(o: VulkanOptions, c: DeviceCaps, t: int, w: Weight) -> bool:
    """Whether an exact-path step of ``t`` tokens on ``w`` runs the int8 cooperative-matrix GEMM: Q4_K
    weights of ``mmq_min_weights`` or more, ``mmq_min_tokens`` or more (fewer: the mat-vec is faster), a
    device with int8 products; not in deterministic mode (one layout for every row count)."""
    ok = c.mmq_k and o.mmq == "auto" and o.planes == 3 and not o.deterministic
    ok = ok and t >= max(2, o.mmq_min_tokens)
    big = math.prod(w.shape) >= o.mmq_min_weights
    return bool(ok) and big and w.qtype == QType.Q4_K and w.shape[1] % 256 == 0


def fused_tail(o: VulkanOptions, c: DeviceCaps, t: int, w: Weight) -> bool:
    """Whether a matmul of ``t`` tokens on ``w`` can run the one-token int8 mat-vec with a fused tail (not
    in deterministic mode, which never runs the one-token variants; not in the one-lane layouts, whose
    workgroups hold more rows than a tail's 32): W in one bind range, its output a whole number of 64-value
    groups."""
    if not (t == 1 and not o.deterministic and q8_path(o, c, t, w)) or q8_one_lane(o, w.shape[0]):
        return False
    return w.nbytes <= c.max_range and w.shape[0] % 64 == 0


def matvec_name(o: VulkanOptions, c: DeviceCaps, t: int, w: Weight, geglu: bool = False) -> str:
    """The float kernel of a step of ``t`` tokens that no int8/coopmat path takes: the unit mat-vec
    (quantized W, ``_t1`` for one token, ``_geglu`` fused), mul_mat_vec (float W) or the mat-mat."""
    t_name = type_name(w.qtype, MATMUL_TYPES)
    if t > MATVEC_MAX_T:
        return matmul_kernel(t_name, o.matmul_registers == "on", c.texel_loads)
    if w.qtype in UNIT_TYPES.values():
        return f"mul_mat_vec_{t_name}" + ("_geglu" if geglu else "") + t1(t)
    return f"mul_mat_vec_{t_name}" + ("_subgroup" if c.subgroup_arithmetic else "")


def geglu_xh(o: VulkanOptions, c: DeviceCaps, t: int, gate: Weight, up: Weight, down: Weight) -> bool:
    """Whether the FFN fuses the GeGLU into the down GEMM's operand: ``geglu_xh`` tokens or more, gate and
    up alike, each in one bind range, and the three on the cooperative-matrix GEMM."""
    n = gate.shape[0]
    alike = gate.qtype == up.qtype and gate.shape == up.shape and down.shape[1] == n and n % 8 == 0
    one_range = max(gate.nbytes, up.nbytes) <= c.max_range
    coopmat = coopmat_for(o, c, t, gate) and coopmat_for(o, c, t, down)
    return 0 < o.geglu_xh <= t and alike and one_range and coopmat


def t1(t: int) -> str:
    """The suffix of the mat-vec variants built for one token."""
    return "_t1" if t == 1 else ""


def type_name(qtype: QType, table: dict[str, QType]) -> str:
    """The variant suffix of ``qtype`` in a kernel table (MATMUL_TYPES, UNIT_TYPES)."""
    return next(s for s, q in table.items() if q == qtype)


# -- attention -----
def parallel_groups(device_type: str, host_threads: int) -> int | None:
    """How many workgroups the device runs at once, where that is known without measuring: a CPU
    implementation runs one a host thread; None for GPUs (their split targets are measured constants)."""
    return max(1, host_threads) if device_type == "cpu" else None


def workgroup_target(target: int, parallel: int | None) -> int:
    """A split-K dispatch's workgroup target (sized to fill a GPU) for a device that runs ``parallel``
    workgroups at once (None: unknown, the target as is)."""
    return target if parallel is None else min(target, CPU_GROUPS_PER_THREAD * parallel)


def attention_one_lane(c: DeviceCaps) -> bool:
    """Whether every attention row runs attention_split_l1 (one invocation per row, KV head and split, its
    inputs read as texel buffers): on CPU implementations such as lavapipe, where a workgroup's barriers and
    shared-memory loads cost more than its products (then no prefill tiles), that read texel buffers."""
    return c.is_cpu and c.texel_loads


def attention_one_lane_heads(g: int) -> int:
    """The query heads an attention_split_l1 invocation holds where a KV head has ``g``: the smallest
    variant that takes them all, else the largest (a KV head's heads then go in ceil(g / it) slices)."""
    return next((m for m in ATTENTION_ONE_LANE_GROUPS if g <= m), ATTENTION_ONE_LANE_GROUPS[-1])


def attention_kernel(o: VulkanOptions, c: DeviceCaps, pool_t: str, dh: int, g: int) -> str:
    """attention_split_l1 where :func:`attention_one_lane`; attention_decode_kl (8 lanes per key) for heads
    of up to 128 dims and G <= 4 on a GPU with subgroup shuffles, else attention_decode (a key's dims over
    the whole subgroup) with subgroup arithmetic where a variant holds the head; else attention_split."""
    sub = c.subgroup_size
    if attention_one_lane(c):
        return f"attention_split_l1_{pool_t}_g{attention_one_lane_heads(g)}"
    if sub < 8 or 256 // sub > 32:
        return f"attention_split_{pool_t}"
    if o.attention_kl and c.subgroup_shuffle and sub % 8 == 0 and dh % 4 == 0:
        mg = next((m for m in ATTENTION_DECODE_KL_GROUPS if g <= m), None)
        if dh <= 128 and mg:
            return f"attention_decode_kl_{pool_t}_g{mg}"
    if c.subgroup_arithmetic:
        dpl = next((d for d in ATTENTION_DECODE_DPL if dh <= d * sub), None)
        mg = next((m for m in ATTENTION_DECODE_GROUPS if g <= m), None)
        if dpl and mg:
            return f"attention_decode_{pool_t}_dpl{dpl}_g{mg}"
    return f"attention_split_{pool_t}"


def prefill_kernel(o: VulkanOptions, c: DeviceCaps, pool_t: str, dh: int, g: int) -> str | None:
    """attention_prefill's variant for this head shape: on cooperative matrices (attention_prefill_cm)
    where the GEMM runs on them and a variant has the head dims, else the scalar one; None where the device
    or the shape allows neither (8-lane shuffle clusters inside subgroups; G dividing the 32 rows of a
    tile; Dh / 4 dividing 256), and where attention_split_l1 takes every row (:func:`attention_one_lane`)."""
    sub = c.subgroup_size
    if attention_one_lane(c) or not c.subgroup_shuffle or sub < 8 or sub % 8 or ATTENTION_PREFILL_TILE % g:
        return None
    if o.attention_cm and coopmat_on(o, c) and dh in ATTENTION_PREFILL_CM_DH:
        return f"attention_prefill_cm_{pool_t}_d{dh}"
    if dh % 4 or 256 % (dh // 4):  # whole vec4s per invocation
        return None
    dpl = next((d for d in ATTENTION_PREFILL_DPL if dh <= 8 * d), None)
    return f"attention_prefill_{pool_t}_dpl{dpl}" if dpl else None
