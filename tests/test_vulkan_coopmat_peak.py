"""shaders/coopmat_peak.comp, the kernel of bench/bench_vulkan_coopmat_peak.py (the cooperative-matrix peak).

Its interface and build entries are checked everywhere (no device needed). On a device with the float16
cooperative matrix (not lavapipe: skipped there with the reason) every variant runs a few loop iterations on
known fragments, the output poisoned with NaN first: each subgroup of the storing workgroups must hold
ROUNDS · iters · A_i B_j in its accumulator (i, j), exactly (the fragments are integers in [-2, 2]: every sum
is an integer of at most 16 · 2 · 2 · 4 · 3 = 768, exact in float32), and the workgroups at or past
``store_groups`` must leave their part of the output untouched.
"""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import pytest
from vk_harness import shader_build

pytestmark = pytest.mark.gpu

VARIANTS = ["a2x2", "a2x4", "a4x4"]


def test_peak_registered():
    """The build list, KERNELS and the SPIR-V agree: one variant per (NA, NB) of CoopMatPeakPush.VARIANTS,
    bindings A, B, C (only C written), push constants (iters, store_groups, never)."""
    from hmad.backends.vulkan.pipelines import KERNELS, CoopMatPeakPush
    from hmad.backends.vulkan.program import load_spirv, reflect

    built = {n: d for n, src, d in shader_build().BUILD if src == "coopmat_peak.comp"}
    names = {f"coopmat_peak_a{a}x{b}": (a, b) for a, b in CoopMatPeakPush.VARIANTS}
    assert set(built) == set(names) == {f"coopmat_peak_{v}" for v in VARIANTS}
    assert {n for n, s in KERNELS.items() if s.source == "coopmat_peak.comp"} == set(names)
    for name, (a, b) in names.items():
        assert built[name] == {"NA": f"{a}u", "NB": f"{b}u"}
        iface = reflect(load_spirv(name))
        assert iface.bindings == (0, 1, 2) and iface.written == (2,)
        assert iface.push_offsets == (0, 4, 8) and iface.push_size == ctypes.sizeof(KERNELS[name].push) == 12


@pytest.mark.parametrize("variant", VARIANTS)
def test_coopmat_peak(dev, kernels, gpu, variant):
    from hmad.backends.vulkan.kernels_matmul import coopmat_usable
    from hmad.backends.vulkan.pipelines import CommandRecorder, CoopMatPeakPush

    if not coopmat_usable(dev.info):
        pytest.skip(f"{dev.info.name}: no float16 16x16x16 cooperative matrix with 32-wide subgroups")
    na, nb = (int(v) for v in variant.removeprefix("a").split("x"))
    rng = np.random.default_rng(zlib.crc32(variant.encode()))
    a, b = (rng.integers(-2, 3, (n, 16, 16)).astype(np.float16) for n in (na, nb))
    block, groups, stored, iters = 64, 3, 2, 3  # 2 subgroups a workgroup; the last workgroup does not store
    sg = block // 32
    out = gpu.poison(gpu.alloc(groups * sg * na * nb * 256 * 4))
    k = kernels(f"coopmat_peak_{variant}", block)
    push = CoopMatPeakPush(iters, stored, CoopMatPeakPush.NAN)
    rec = CommandRecorder(dev).begin()
    rec.dispatch(k, [gpu.put(a), gpu.put(b), out], push, groups)
    rec.end()
    rec.submit()
    rec.close()
    got = gpu.get(out, shape=(groups, sg, na, nb, 16, 16))
    prod = np.einsum("imk,jkn->ijmn", a.astype(np.float64), b.astype(np.float64))
    want = np.broadcast_to(CoopMatPeakPush.ROUNDS * iters * prod, (stored, sg, na, nb, 16, 16))
    np.testing.assert_array_equal(got[:stored], want)
    assert np.isnan(got[stored:]).all(), "a workgroup past store_groups wrote its accumulators"
