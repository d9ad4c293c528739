"""The exact int8 cooperative-matrix GEMM (shaders/mul_mmq_coopmat.comp, backends/vulkan/kernels_mmq.py).

Everywhere (no device): the build list, KERNELS and the SPIR-V agree; the names parse; the device check
takes NVIDIA's and RDNA3's int8 shapes and refuses the rest; K splits cover K in whole steps.

On a device with int8 16 × 16 × K cooperative matrices and 32-wide subgroups (not lavapipe: skipped there
with the reason; the device machine runs them): every built layout with the device's K against float64
products of the dequantized Q4_K weights, at 1 to 19 tokens (two token tiles), with K split and not, N not a
multiple of the tile, y poisoned with NaN first; within TOL of the output scale, the x3 mat-vec's class
(both join the three planes' integer dots exactly and differ by float32 roundings of the block terms), and
within TOL of the x3 mat-vec itself. The GeGLU pair likewise. Then the backend: 8-token decode steps of a
Q4_K model run it (its label in the recording) and give the logits of mmq="off" within TOL_STEP.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from test_vulkan_matmul import _shared_bytes
from vk_harness import shader_build

pytestmark = pytest.mark.gpu
TOL = 2e-6  # of the output scale (float32 roundings of K / 32 block terms; x with a few large values)
TOL_STEP = 1e-5  # logits, a whole model's steps against the x3 mat-vec's


def test_mmq_registered():
    from hmad.backends.vulkan.kernels_mmq import (
        MMQ_BLOCK,
        MMQ_LAYOUTS,
        mmq_kernel_name,
        mmq_layout,
        mmq_pick,
        mmq_shared_bytes,
    )
    from hmad.backends.vulkan.program import load_spirv, reflect
    from hmad.backends.vulkan.push import CoopMatPush
    from hmad.backends.vulkan.registry import KERNELS

    built = {n: d for n, src, d in shader_build().BUILD if src == "mul_mmq_coopmat.comp"}
    names = {mmq_kernel_name(*lay): lay for lay in MMQ_LAYOUTS}
    assert set(built) == set(names)
    assert {mmq_pick(32), mmq_pick(16), mmq_pick(32, 8, n8=True), mmq_pick(16, 8, n8=True)} <= set(names)
    assert "_n8" in mmq_pick(32, 8, n8=True) and "_n8" not in mmq_pick(32, 9, n8=True) + mmq_pick(32, 8)
    for name, (mr, nt, mk, jb, nb, fb) in names.items():
        assert mmq_layout(name) == (mr, nt, mk, jb, nb, fb)
        want = {"MR": f"{mr}u", "NT": f"{nt}u", "MK": f"{mk}u", "JB": f"{jb}u", "NB": f"{nb}u"}
        assert built[name] == want | ({"FB": "1"} if fb else {})
        spec = KERNELS[name]
        assert (spec.n_buffers, spec.push, spec.block_size) == (4, CoopMatPush, MMQ_BLOCK)
        iface = reflect(load_spirv(name))
        assert iface.bindings == (0, 1, 2, 3) and iface.written == (3,)
        assert iface.push_size == ctypes.sizeof(CoopMatPush)
        assert mmq_shared_bytes(name) == _shared_bytes(load_spirv(name)) <= 48 << 10, name  # NVIDIA's limit
    assert mmq_shared_bytes(mmq_pick(32, 8, n8=True)) <= 36 << 10
    with pytest.raises(ValueError, match="not a mul_mmq"):
        mmq_layout("mul_mmq_coopmat_q4_k_m2n1k32")


def _info(shapes, subgroup=32, api=(1, 3)):
    return SimpleNamespace(coopmat_shapes=shapes, subgroup={"size": subgroup}, api_version=(*api, 0))


def test_mmq_shape_k():
    from hmad.backends.vulkan.kernels_mmq import mmq_has_n8, mmq_shape_k, mmq_usable

    def s8(m, n, k, scope=True):
        return {
            "M": m,
            "N": n,
            "K": k,
            "A": "s8",
            "B": "s8",
            "C": "s32",
            "result": "s32",
            "subgroup_scope": scope,
        }

    f16 = {
        "M": 16,
        "N": 16,
        "K": 16,
        "A": "f16",
        "B": "f16",
        "C": "f32",
        "result": "f32",
        "subgroup_scope": True,
    }
    nvidia, rdna3 = _info([f16, s8(16, 8, 32), s8(16, 16, 32)]), _info([f16, s8(16, 16, 16)])
    assert mmq_shape_k(nvidia) == 32 and mmq_has_n8(nvidia, 32)
    assert mmq_shape_k(rdna3) == 16 and not mmq_has_n8(rdna3, 16)  # wave32
    assert mmq_shape_k(_info([f16, s8(16, 16, 16)], subgroup=64)) is None
    assert mmq_shape_k(_info([f16, s8(16, 16, 32)], api=(1, 2))) is None
    assert mmq_shape_k(_info([f16, s8(16, 8, 32), s8(16, 16, 32, scope=False)])) is None
    assert mmq_shape_k(_info([])) is None
    # the picks' shared memory: within NVIDIA's 48 KiB and RDNA3's 64, not within 32
    assert mmq_usable(nvidia, {"maxComputeSharedMemorySize": 48 << 10}) == 32
    assert mmq_usable(rdna3, {"maxComputeSharedMemorySize": 64 << 10}) == 16
    assert mmq_usable(nvidia, {"maxComputeSharedMemorySize": 32 << 10}) is None


@pytest.mark.parametrize("k,n,t", [(5376, 21504, 8), (21504, 5376, 8), (4096, 5376, 16), (256, 64, 1)])
def test_mmq_splits(k, n, t):
    from hmad.backends.vulkan.kernels_mmq import MMQ_BK, MMQ_MIN_STEPS, mmq_splits

    splits, k_split = mmq_splits(k, n, t, (16, 128))
    assert k_split % MMQ_BK == 0 and (splits - 1) * k_split < k <= splits * k_split
    assert splits == 1 or k_split >= MMQ_MIN_STEPS * MMQ_BK


# -- on a device with int8 cooperative matrices ---------------------------------------------------------


def _mmq_k(dev) -> int:
    from hmad.backends.vulkan.kernels_mmq import mmq_shape_k

    mk = mmq_shape_k(dev.info)
    if mk is None:
        pytest.skip(
            f"{dev.info.name}: no int8 16x16 cooperative matrix with 32-wide subgroups and Vulkan 1.3"
        )
    return mk


def _layouts(dev, mk: int) -> list[str]:
    """The built layouts the device runs: its K, and 16 × 8 products where it has them."""
    from hmad.backends.vulkan.kernels_mmq import MMQ_LAYOUTS, mmq_has_n8, mmq_kernel_name

    n8 = mmq_has_n8(dev.info, mk)
    return [mmq_kernel_name(*lay) for lay in MMQ_LAYOUTS if lay[2] == mk and (lay[4] == 16 or n8)]


class Case:
    """Q4_K W (n, k) and x (t_max, k) with a few large values, x's three planes made on the GPU."""

    def __init__(self, dev, gpu, kernels, n, k, t_max, seed, weights=1):
        from hmad.backends.vulkan.kernels_matmul import weight_row_bytes
        from hmad.backends.vulkan.push import QuantizeQ8Push
        from hmad.backends.vulkan.recorder import CommandRecorder
        from hmad.core.quants import dequantize, random_blocks
        from hmad.core.tensors import QType

        rng = np.random.default_rng(seed)
        self.n, self.k, self.gpu = n, k, gpu
        rb = weight_row_bytes(QType.Q4_K, k)
        self.ws, self.wref = [], []
        for _ in range(weights):
            host = np.ascontiguousarray(random_blocks(QType.Q4_K, (n, k), rng)).view(np.uint8)
            w = gpu.put(host)
            w.row_bytes = rb
            self.ws.append(w)
            self.wref.append(dequantize(host.reshape(-1), QType.Q4_K, (n, k)).astype(np.float64))
        x = rng.standard_normal((t_max, k)).astype(np.float32)
        x[:, rng.integers(0, k, 3)] *= 40.0
        self.x = x.astype(np.float64)
        self.xq, self.xd = gpu.alloc(3 * t_max * k), gpu.alloc(t_max * k // 32 * 8)
        self.y = gpu.alloc(t_max * n * 4)
        self.part = gpu.alloc(64 * t_max * n * 4)
        rec = CommandRecorder(dev).begin()
        rec.dispatch(kernels("quantize_x3"), [gpu.put(x), self.xq, self.xd], QuantizeQ8Push(k, t_max, k), 64)
        rec.end()
        rec.submit()
        rec.close()

    def run(self, dev, record, t: int) -> np.ndarray:
        from hmad.backends.vulkan.recorder import CommandRecorder

        self.gpu.poison(self.y)
        rec = CommandRecorder(dev).begin()
        record(rec)
        rec.end()
        rec.submit()
        rec.close()
        return self.gpu.get(self.y)[: t * self.n].reshape(t, self.n)


def _recorder(fn, *args, **kw):
    """``rec -> fn(rec, *args, **kw)``: one recording of a test's dispatches."""
    return lambda rec: fn(rec, *args, **kw)


def _err(got, want) -> float:
    assert np.isfinite(got).all(), f"{int((~np.isfinite(got)).sum())} unwritten or non-finite outputs"
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("split", [False, True])
def test_mmq_matches_float64(dev, gpu, kernels, split):
    from hmad.backends.vulkan.kernels_mmq import record_mmq
    from hmad.backends.vulkan.kernels_q8 import record_matvec_q8

    mk = _mmq_k(dev)
    n, k = 200, 2048  # N not a multiple of any tile; K 16 steps (split in up to 4); rows of 1152 bytes
    c = Case(dev, gpu, kernels, n, k, 19, seed=5)
    reduce = kernels("split_reduce")
    target = 4096 if split else 1
    for name in _layouts(dev, mk):
        kern = kernels(name)
        for t in (1, 2, 5, 8, 16, 19):
            want = c.x[:t] @ c.wref[0].T
            args = (c.ws[0], c.xq, c.xd, c.y, k, n, t)
            got = c.run(dev, _recorder(record_mmq, kern, reduce, *args, c.part, target=target), t)
            assert _err(got, want) <= TOL, (name, t)
            if t <= 8:
                mv = kernels("mul_mat_vec_x3_q4_k" + ("_t1" if t == 1 else ""))
                ref = c.run(dev, _recorder(record_matvec_q8, mv, *args), t)
                assert _err(got, ref) <= TOL, (name, t, "against the x3 mat-vec")
        # W bound in ranges of 64 rows (as a weight over maxStorageBufferRange would be)
        args = (c.ws[0], c.xq, c.xd, c.y, k, n, 8, c.part)
        ranges = _recorder(record_mmq, kern, reduce, *args, max_range=64 * 1152, target=target)
        assert _err(c.run(dev, ranges, 8), c.x[:8] @ c.wref[0].T) <= TOL, (name, "ranges")


def test_mmq_geglu_matches_float64(dev, gpu, kernels):
    from hmad.backends.vulkan.kernels_mmq import mmq_pick, record_mmq_geglu

    mk = _mmq_k(dev)
    n, k, t = 320, 1024, 8
    c = Case(dev, gpu, kernels, n, k, t, seed=6, weights=2)
    made = []

    def part(nbytes):
        made.append(gpu.alloc(nbytes))
        return made[-1]

    from hmad.backends.vulkan.kernels_mmq import mmq_has_n8

    kern, reduce = kernels(mmq_pick(mk, t, mmq_has_n8(dev.info, mk))), kernels("split_reduce_geglu")
    got = c.run(
        dev, lambda rec: record_mmq_geglu(rec, kern, reduce, *c.ws, c.xq, c.xd, c.y, k, n, t, part), t
    )
    g, u = (c.x @ w.T for w in c.wref)
    want = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * u
    assert _err(got, want) <= TOL


def test_backend_runs_mmq_at_eight_tokens(tmp_path):
    """A Q4_K model (every matmul but the embedding's): 8 and 5 sequences decoded together run the int8 GEMM
    (its kernel in the recordings; none with mmq="off") and give the logits of mmq="off" within TOL_STEP."""
    from test_model_cpu import rand_ids, run_chunks
    from tiny_gguf import MIXED, make_tiny_gguf

    from hmad.backends.vulkan.device import Device
    from hmad.backends.vulkan.kernels_mmq import mmq_shape_k
    from hmad.composition import load_model
    from hmad.core.tensors import QType

    with Device() as d:
        if mmq_shape_k(d.info) is None:
            pytest.skip(
                f"{d.info.name}: no int8 16x16 cooperative matrix with 32-wide subgroups and Vulkan 1.3"
            )
    types = {kind: QType.Q4_K for kind in MIXED if kind != "token_embd"}
    path = make_tiny_gguf(tmp_path / "q4k.gguf", seed=4, types=types)
    for n_seqs in (8, 5):  # 8-token steps, and 5 (tokens past T in the products' tiles)
        seqs = [rand_ids(np.random.default_rng(20 + i), 5, 300) for i in range(n_seqs)]
        out = {}
        for mmq in ("auto", "off"):
            vk = load_model(path, "vulkan", mmq=mmq)
            # a tiny model's weights (the default takes big ones only)
            vk.backend.set_options(replace(vk.backend.options, mmq_min_weights=0))
            try:
                out[mmq] = run_chunks(vk, seqs, 1)
                out[mmq + "_labels"] = {lab for g in vk.backend.graphs.values() for lab in g.rec.labels}
            finally:
                vk.backend.close()
        assert any(lab.startswith("mul_mmq_coopmat") for lab in out["auto_labels"]), n_seqs
        assert not any(lab.startswith("mul_mmq_coopmat") for lab in out["off_labels"])
        for a, b in zip(out["auto"], out["off"], strict=True):
            assert _err(a, b) <= TOL_STEP, n_seqs
