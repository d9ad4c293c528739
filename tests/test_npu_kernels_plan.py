"""npu_kernels/ without the toolchain: the designs' parameters agree with the runtime's catalogue, the GEMM
data movement they describe (access patterns, tile order, broadcast, join) computes A @ B^T when replayed in
numpy, the designs and core code name the same functions, and build.py says what is missing.

What this cannot check: that mlir-aie accepts the designs, that Peano compiles the core code, or that the
NPU computes the right thing. None of that has run (see npu_kernels/README.md)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

KERNELS = Path(__file__).resolve().parent.parent / "npu_kernels"


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def build():
    return load(KERNELS / "build.py", "hmad_npu_build")


@pytest.mark.parametrize("family", ["npu1", "npu2"])
def test_plans_match_the_runtime_catalogue(build, family):
    plans = build.check_plans(family)  # asserts names and buffer shapes against hmad's CATALOGUE
    assert set(plans) == {"gemm_int8", "gemm_bf16", "softmax_bf16"}


def replay_gemm(p, a: np.ndarray, b: np.ndarray, walk) -> np.ndarray:
    """What the design's DMAs and cores compute, step by step, for one invocation."""
    n_k = p.K // p.k
    c = np.full(p.M * p.N, -1, dtype=np.int64)
    a_stream = [a.reshape(-1)[walk(*p.a_tap(i))].reshape(p.tiles_per_core, n_k, p.m, p.k) for i in range(4)]
    for j in range(p.n_cols):
        b_stream = b.reshape(-1)[walk(*p.b_tap(j))].reshape(p.tiles_per_core, n_k, p.n, p.k)
        joined = []  # mem tile j: the 4 cores' (m, n) tiles stacked into (M, n) per output tile
        for t in range(p.tiles_per_core):
            tiles = [sum(a_stream[i][t, kb] @ b_stream[t, kb].T for kb in range(n_k)) for i in range(4)]
            joined.append(np.concatenate(tiles))
        c[walk(*p.c_tap(j))] = np.concatenate(joined).reshape(-1)
    return c.reshape(p.M, p.N)


@pytest.mark.parametrize("family", ["npu1", "npu2"])
@pytest.mark.parametrize("name", ["gemm_int8", "gemm_bf16"])
def test_gemm_access_patterns_compute_the_product(build, family, name):
    plans = load(KERNELS / "designs" / "plans.py", "hmad_npu_plans")
    p = plans.plans(family)[name]
    rng = np.random.default_rng(0)
    a = rng.integers(-9, 10, (p.M, p.K))
    b = rng.integers(-9, 10, (p.N, p.K))
    c = replay_gemm(p, a, b, plans.walk)
    np.testing.assert_array_equal(c, a @ b.T)  # every element written once, with the right sum


def test_designs_and_core_code_name_the_same_functions():
    gemm = (KERNELS / "designs" / "gemm.py").read_text()
    softmax = (KERNELS / "designs" / "softmax.py").read_text()
    zero = (KERNELS / "cores" / "zero.cc").read_text()
    sm = (KERNELS / "cores" / "softmax_masked.cc").read_text()
    assert 'f"hmad_zero_{p.dtype_out}"' in gemm and "hmad_zero_i32(" in zero and "hmad_zero_f32(" in zero
    assert '"hmad_softmax_masked"' in softmax and re.search(r"void hmad_softmax_masked\(", sm)
    for src in (KERNELS / "designs").glob("*.py"):
        compile(src.read_text(), str(src), "exec")  # at least valid Python (mlir-aie is not here to run them)


def test_build_without_toolchain_names_what_is_missing(tmp_path):
    r = subprocess.run(
        [sys.executable, str(KERNELS / "build.py"), "--family", "npu1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    if r.returncode == 0:
        pytest.skip("the NPU kernel toolchain is installed here")
    assert r.returncode == 2, r.stderr
    assert "the NPU kernel toolchain is not installed; missing:" in r.stderr
    assert "mlir-aie's Python package 'aie'" in r.stderr and "see npu_kernels/README.md" in r.stderr
