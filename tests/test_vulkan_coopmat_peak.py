"""shaders/coopmat_peak.comp, the kernel of bench/bench_vulkan_coopmat_peak.py (the cooperative-matrix peak).

Its interface and build entries are checked everywhere (no device needed). On a device with the float16
cooperative matrix (not lavapipe: skipped there with the reason) every variant runs a few loop iterations on
known fragments, the output poisoned with NaN first: each subgroup of the storing workgroups must hold
ROUNDS · iters · A_i B_j in its accumulator (i, j), exactly (the fragments are integers in [-2, 2]: every sum
is an integer of at most 16 · 2 · 2 · 4 · 3 = 768, exact in float32), and the workgroups at or past
``store_groups`` must leave their part of the output untouched. The staged variants (fragments from a shared
tile of float16 1.0, the tile stored each step too) must hold what their tile's values give.
"""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import pytest
from vk_harness import shader_build

pytestmark = pytest.mark.gpu

VARIANTS = ["a2x2", "a2x4", "a4x4"]
STAGED = ["a4x4_lds", "a4x4_step"]


def test_peak_registered():
    """The build list, KERNELS and the SPIR-V agree: one variant per (NA, NB) of CoopMatPeakPush.VARIANTS and
    the staged a4x4 ones, bindings A, B, C (only C written; the staged ones declare A and B unread), push
    constants (iters, store_groups, never)."""
    from hmad.backends.vulkan.program import load_spirv, reflect
    from hmad.backends.vulkan.push import CoopMatPeakPush
    from hmad.backends.vulkan.registry import KERNELS

    built = {n: d for n, src, d in shader_build().BUILD if src == "coopmat_peak.comp"}
    names = {f"coopmat_peak_a{a}x{b}": (a, b) for a, b in CoopMatPeakPush.VARIANTS}
    names |= {f"coopmat_peak_a4x4{s}": (4, 4) for s in CoopMatPeakPush.STAGED}
    assert set(built) == set(names) == {f"coopmat_peak_{v}" for v in VARIANTS + STAGED}
    assert {n for n, s in KERNELS.items() if s.source == "coopmat_peak.comp"} == set(names)
    staged = {"coopmat_peak_a4x4_lds": {"LDS": "1"}, "coopmat_peak_a4x4_step": {"LDS": "1", "STEP": "1"}}
    for name, (a, b) in names.items():
        assert built[name] == {"NA": f"{a}u", "NB": f"{b}u"} | staged.get(name, {})
        iface = reflect(load_spirv(name))
        assert iface.bindings == (0, 1, 2) and iface.written == (2,)
        assert iface.push_offsets == (0, 4, 8) and iface.push_size == ctypes.sizeof(KERNELS[name].push) == 12


@pytest.mark.parametrize("variant", VARIANTS)
def test_coopmat_peak(dev, kernels, gpu, variant):
    from hmad.backends.vulkan.kernels_coopmat import coopmat_usable
    from hmad.backends.vulkan.push import CoopMatPeakPush
    from hmad.backends.vulkan.recorder import CommandRecorder

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


@pytest.mark.parametrize("variant", STAGED)
def test_coopmat_peak_staged(dev, kernels, gpu, variant):
    """The staged variants multiply their shared tile's fragments: all float16 1.0 (``_lds``), or stored each
    step as 1.0 on even steps and 1 + 2^-10 on odd ones (``_step``): each accumulator element is ROUNDS · 16 ·
    the sum of the steps' squared values; workgroups past ``store_groups`` leave the output untouched."""
    from hmad.backends.vulkan.kernels_coopmat import coopmat_usable
    from hmad.backends.vulkan.push import CoopMatPeakPush
    from hmad.backends.vulkan.recorder import CommandRecorder

    if not coopmat_usable(dev.info):
        pytest.skip(f"{dev.info.name}: no float16 16x16x16 cooperative matrix with 32-wide subgroups")
    block, groups, stored, iters = 128, 3, 2, 5  # the GEMM's 4 subgroups; the last workgroup does not store
    sg = block // 32
    out = gpu.poison(gpu.alloc(groups * sg * 16 * 256 * 4))
    dummy = gpu.put(np.zeros(256, np.float16))
    rec = CommandRecorder(dev).begin()
    rec.dispatch(
        kernels(f"coopmat_peak_{variant}", block),
        [dummy, dummy, out],
        CoopMatPeakPush(iters, stored, CoopMatPeakPush.NAN),
        groups,
    )
    rec.end()
    rec.submit()
    rec.close()
    got = gpu.get(out, shape=(groups, sg, 4, 4, 16, 16))
    odd = 1 + 2.0**-10
    values = [odd if variant.endswith("_step") and it % 2 else 1.0 for it in range(iters)]
    want = CoopMatPeakPush.ROUNDS * 16 * sum(v * v for v in values)
    np.testing.assert_allclose(got[:stored], want, rtol=1e-6)
    assert np.isnan(got[stored:]).all(), "a workgroup past store_groups wrote its accumulators"
