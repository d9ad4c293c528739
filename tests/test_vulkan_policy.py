"""Kernel choice without a GPU: hmad.backends.vulkan.policy over fake device capabilities and shapes.

The cooperative-matrix and int8-GEMM paths that lavapipe cannot run are chosen here for NVIDIA- and
RDNA3-like capabilities. ``test_choices_unchanged`` holds the whole table of choices (5 devices x 18 option
sets x 7 weights x 12 step sizes, the fused paths, the attention kernels) to the digest of what the backend
chose before the choices moved into policy.py: a refactor that changes any choice on any device fails it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import replace
from types import SimpleNamespace as NS

import pytest

from hmad.backends.vulkan import policy
from hmad.backends.vulkan.kernels_q8 import q8_matvec_layout
from hmad.backends.vulkan.options import VulkanOptions
from hmad.backends.vulkan.policy import DeviceCaps
from hmad.core.tensors import QType

DEVICES = {  # name -> (type, coopmat, mmq_k, mmq_n8, subgroup size, shuffle, arithmetic, offset align, range)
    "nvidia": ("discrete", True, 32, True, 32, True, True, 16, (4 << 30) - 1),
    "rdna3": ("integrated", True, 16, False, 64, True, True, 4, (4 << 30) - 1),
    "intel": ("integrated", False, None, False, 16, True, True, 64, 1 << 30),
    "old": ("discrete", False, None, False, 64, False, False, 256, 1 << 27),
    "lavapipe": ("cpu", False, None, False, 8, True, True, 16, 1 << 27),
}
WEIGHTS = [
    (QType.Q4_K, 21504, 5376),
    (QType.Q4_K, 640, 1024),
    (QType.Q5_0, 2048, 640),
    (QType.Q8_0, 262144, 640),
    (QType.Q6_K, 640, 2048),
    (QType.F16, 256, 640),
    (QType.F32, 64, 64),
]
TOKENS = (1, 2, 3, 4, 8, 9, 16, 32, 33, 64, 256, 512)
OPTIONS = list(itertools.product(("exact", "int8", "float"), (False, True), (True, False, "split_sums")))
BYTES_PER_WEIGHT = {
    QType.Q4_K: 144 / 256,
    QType.Q5_0: 22 / 32,
    QType.Q8_0: 34 / 32,
    QType.Q6_K: 210 / 256,
    QType.F16: 2,
    QType.F32: 4,
}
#: sha256 of the table the backend's methods made before the move (same grid, same serialization), with the
#: changes made since on purpose, all in the lavapipe rows: no fused GeGLU tail, since every int8 mat-vec
#: there is one-lane (24 entries, fused_tail True -> False); attention on attention_split_l1 and no prefill
#: tiles (432 entries); G = 8 on attention_split_l1's 4-head arrays in 2 slices, not 8-head ones (108);
#: and in the nvidia and rdna3 rows, the exact path's 2-token steps on the int8 GEMM (mmq_min_tokens 2: 6);
#: the lavapipe rows' register mat-mat on its storage-texel-buffer variant (``mul_mat_reg_<t>_texel``: 882)
DIGEST_BEFORE = "a3fb6d65ef08fc98c18dc4269e005fe14cb13313a8148ca61b1e4229983736d2"


def caps(name: str, threads: int = 2) -> DeviceCaps:
    typ, cm, mk, n8, sub, shuf, arith, align, rng = DEVICES[name]
    return DeviceCaps(typ, cm, mk, n8, sub, shuf, arith, align, rng, threads, texel_loads=typ == "cpu")


def weight(q: QType, n: int, k: int):
    return NS(qtype=q, shape=(n, k), nbytes=int(n * k * BYTES_PER_WEIGHT[q]))


def options(matvec="exact", deterministic=False, fuse=True, c: DeviceCaps | None = None) -> VulkanOptions:
    o = VulkanOptions(matvec=matvec, deterministic=deterministic, fuse=fuse)
    return policy.resolve(o, c or caps("nvidia"))


def choices(o: VulkanOptions, c: DeviceCaps) -> list:
    out = []
    for (q, n, k), t in itertools.product(WEIGHTS, TOKENS):
        w = weight(q, n, k)
        out.append(
            [
                policy.q8_path(o, c, t, w),
                policy.coopmat_for(o, c, t, w),
                policy.mmq_for(o, c, t, w),
                policy.fused_tail(o, c, t, w),
                policy.matvec_name(o, c, t, w),
                policy.coopmat_steps(o, c, t),
            ]
        )
    g, u, d = weight(QType.Q4_K, 2048, 640), weight(QType.Q4_K, 2048, 640), weight(QType.Q4_K, 640, 2048)
    out.append([policy.geglu_xh(o, c, t, g, u, d) for t in TOKENS])
    out.append([o.fused(f) for f in ("norm_rope_kv", "qout", "split_sums")])
    for pool, dh, grp in itertools.product(("f32", "f16"), (64, 128, 256), (1, 2, 4, 8)):
        out.append([policy.attention_kernel(o, c, pool, dh, grp), policy.prefill_kernel(o, c, pool, dh, grp)])
    return out


def test_choices_unchanged():
    table = {}
    for d in DEVICES:
        for m, det, f in OPTIONS:
            c = caps(d)
            table[f"{d}/{m}/{det}/{f}"] = choices(options(m, det, f, c), c)
    blob = json.dumps(table, sort_keys=True).encode()
    assert hashlib.sha256(blob).hexdigest() == DIGEST_BEFORE


def test_prefill_on_coopmat_gpus_and_register_tiles_on_cpu():
    big = weight(QType.Q4_K, 21504, 5376)
    for name in ("nvidia", "rdna3"):
        c = caps(name)
        o = options(c=c)
        assert policy.coopmat_for(o, c, 512, big) and not policy.q8_path(o, c, 512, big)
        assert policy.prefill_kernel(o, c, "f32", 256, 4) == "attention_prefill_cm_f32_d256"
    kernels = {"intel": "mul_mat_q4_k", "old": "mul_mat_q4_k", "lavapipe": "mul_mat_reg_q4_k_texel"}
    for name, kernel in kernels.items():
        c = caps(name)
        o = options(c=c)
        assert not policy.coopmat_for(o, c, 512, big)
        assert policy.matvec_name(o, c, 512, big) == kernel
    c = caps("lavapipe")
    assert policy.matvec_name(policy.resolve(VulkanOptions(matmul_registers="off"), c), c, 64, big) == (
        "mul_mat_q4_k"
    )
    # a GPU told to take the register kernel reads W and x as storage buffers (it makes no texel buffers)
    c = caps("intel")
    assert policy.matvec_name(policy.resolve(VulkanOptions(matmul_registers="on"), c), c, 64, big) == (
        "mul_mat_reg_q4_k"
    )


def test_int8_gemm_where_the_device_has_it():
    big = weight(QType.Q4_K, 21504, 5376)
    c = caps("nvidia")
    o = replace(options(c=c), coopmat_min_tokens=9)  # the float16 GEMM from 9 tokens: 2..8 on the int8 one
    assert [policy.mmq_for(o, c, t, big) for t in (1, 2, 3, 8)] == [False, True, True, True]
    assert not policy.mmq_for(replace(o, mmq_min_tokens=3), c, 2, big)
    assert policy.mmq_for(options(c=c), c, 2, big)  # the defaults: bucket 2 on the int8 GEMM, 4+ on float16
    assert not policy.mmq_for(replace(o, mmq="off"), c, 8, big)
    assert not policy.mmq_for(replace(o, matvec="int8"), c, 8, big)
    assert not policy.mmq_for(o, caps("intel"), 8, big)


def test_cpu_split_targets_follow_the_host_threads():
    gpu, cpu = caps("nvidia"), caps("lavapipe", threads=2)
    assert policy.resolve(VulkanOptions(), gpu).attention_target == policy.ATTENTION_TARGET_GROUPS
    o = policy.resolve(VulkanOptions(), cpu)
    assert o.attention_target == o.attention_prefill_target == 2 * policy.CPU_GROUPS_PER_THREAD
    assert policy.resolve(VulkanOptions(attention_target=64), cpu).attention_target == 64  # a sweep's value
    assert policy.resolve(VulkanOptions(), caps("lavapipe", threads=1000)).attention_target == 256


def test_options_are_checked_and_frozen():
    with pytest.raises(ValueError, match="matvec"):
        VulkanOptions(matvec="fast")
    with pytest.raises(ValueError, match="deterministic"):
        VulkanOptions(deterministic="yes")
    o = VulkanOptions()
    with pytest.raises(AttributeError):
        o.fuse = False  # type: ignore[misc]
    assert replace(o, fuse="qout").fused("qout") and not replace(o, fuse="qout").fused("split_sums")
    assert o.planes == 3 and replace(o, matvec="int8").planes == 1 and replace(o, matvec="float").planes == 0


def test_one_lane_matvec_on_cpu_implementations_only():
    """Every int8 mat-vec of a CPU implementation one invocation per row group: 16 rows an invocation on
    a Q8_0 LM head (8 on one of another type, and on a GeGLU pair), 4 on smaller weights, one token or
    eight; no fused tail there; GPUs keep 32 lanes a row group; 0 turns it off, a row count keeps it to
    larger weights."""
    head, ffn, q = 262144, 2048, 1024
    cpu = policy.resolve(VulkanOptions(), caps("lavapipe"))
    assert all(policy.q8_one_lane(cpu, n) for n in (head, ffn, q, 1))
    for t in (1, 8):
        assert q8_matvec_layout(t, head, 640, one_lane=True, t_name="q8_0") == "_l16"
        assert q8_matvec_layout(t, head, 640, one_lane=True, t_name="q6_k") == "_l8"
        assert q8_matvec_layout(t, head, 640, one_lane=True) == "_l8"
        assert q8_matvec_layout(t, ffn, 640, geglu=True, one_lane=True) == "_l8"
        assert q8_matvec_layout(t, q, 640, one_lane=True) == "_l4"
    gate = weight(QType.Q5_0, ffn, 640)
    assert not policy.fused_tail(cpu, caps("lavapipe"), 1, gate)
    for name in ("nvidia", "rdna3", "intel", "old"):
        assert not policy.q8_one_lane(policy.resolve(VulkanOptions(), caps(name)), head)
    off = policy.resolve(VulkanOptions(matvec_one_lane_rows=0), caps("lavapipe"))
    assert not policy.q8_one_lane(off, head)
    big = policy.resolve(VulkanOptions(matvec_one_lane_rows=32768), caps("lavapipe"))
    assert policy.q8_one_lane(big, head) and not policy.q8_one_lane(big, q)
    # the one-lane layouts read texel buffers: a CPU implementation without them keeps 32 lanes, and a GPU
    # told to take them is refused with the reason
    no_texels = replace(caps("lavapipe"), texel_loads=False)
    assert not policy.q8_one_lane(policy.resolve(VulkanOptions(), no_texels), head)
    assert not policy.attention_one_lane(no_texels)
    with pytest.raises(ValueError, match="texel buffers"):
        policy.resolve(VulkanOptions(matvec_one_lane_rows=1), caps("nvidia"))


def test_attention_on_cpu_implementations_one_lane_without_tiles():
    """A CPU implementation's every attention row on attention_split_l1 (its arrays sized for G, or for 4
    heads of a slice where G is larger), with no
    prefill tiles, about attention_target workgroups of ATTENTION_ONE_LANE_BLOCK splits, and enough splits
    for ONE_LANE_MAX_KEYS keys a split; GPUs keep their subgroup kernels and tiles."""
    from hmad.backends.vulkan.ops_attention import ONE_LANE_MAX_KEYS, attention_splits, one_lane_splits
    from hmad.backends.vulkan.shapes import ATTENTION_ONE_LANE_BLOCK

    c = caps("lavapipe")
    o = options(c=c)
    assert policy.attention_kernel(o, c, "f32", 256, 4) == "attention_split_l1_f32_g4"
    assert policy.attention_kernel(o, c, "f16", 128, 3) == "attention_split_l1_f16_g4"
    assert policy.attention_kernel(o, c, "f32", 64, 1) == "attention_split_l1_f32_g1"
    assert policy.attention_kernel(o, c, "f32", 256, 8) == "attention_split_l1_f32_g4"  # in 2 slices
    assert [policy.attention_one_lane_heads(g) for g in (1, 2, 3, 4, 8)] == [1, 2, 4, 4, 4]
    assert policy.prefill_kernel(o, c, "f32", 256, 4) is None
    assert attention_splits(o, 6, 4, 1, False, ATTENTION_ONE_LANE_BLOCK) == 64  # 8 x 64 / 6, capped
    assert attention_splits(o, 512, 4, 1, False, ATTENTION_ONE_LANE_BLOCK) == 1
    # ... and a split's keys bounded (llvmpipe's loop guard): 512-key windows one, 32K-key rows 16
    assert ONE_LANE_MAX_KEYS == 2048 and one_lane_splits(512) == 1 and one_lane_splits(32768) == 16
    assert one_lane_splits(10**6) == 64
    for name in ("nvidia", "rdna3", "intel", "old"):
        g = caps(name)
        assert not policy.attention_kernel(options(c=g), g, "f32", 256, 4).startswith("attention_split_l1")
