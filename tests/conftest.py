"""Shared fixtures: tiny generated models and the embedded Gemma 3 270M."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# One OpenBLAS float32 kernel family for every test run, set before numpy loads OpenBLAS. OpenBLAS picks its
# GEMM kernel by CPU model (AVX2 "Haswell", AVX-512 "SkylakeX"/Zen, ...), each summing in its own order, and
# the numpy reference backend's ggml roundings (activations quantized to int8 before every matmul) carry
# that order into the logits: on an AMD EPYC with the AVX-512 kernels, test_fidelity_llamacpp's
# teacher-forced check saw 9 of its positions disagree with llama.cpp, one at a top-two margin of 0.72
# (its tolerance is 0.5); with the Haswell kernels, which every x86-64 CI machine runs, none do (2026-11-23).
if platform.machine() in ("x86_64", "AMD64"):
    os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")

# Parallel workers (pytest-xdist, `-n`) share the cores instead of each spreading over all of them: lavapipe's
# compute threads wait for each other at the end of every dispatch, so two workers' thread pools on the same
# cores stall each other. Each worker (and every hmad it starts) gets cores / workers threads for lavapipe
# and for numpy's BLAS. Set before numpy and the Vulkan driver load; a variable already set wins.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    for _name in ("LP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(_name, _threads)


@pytest.hookimpl(trylast=True)  # after pytest's own grouping by fixture parameters, which the sort keeps
def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` start first (a stable sort), so that with parallel workers none of them is left
    running alone at the end while the other workers idle."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def embedded_model_path() -> Path:
    """The embedded default model (``HMAD_TEST_MODEL`` overrides); assembled from its package if needed."""
    if os.environ.get("HMAD_TEST_MODEL"):
        return Path(os.environ["HMAD_TEST_MODEL"])
    from hmad.model.default import install_default_model

    return install_default_model()


# -- Vulkan (tests/vk_harness.py) ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def dev():
    from vk_harness import open_device

    d = open_device()
    yield d
    d.close()


@pytest.fixture
def kernels(dev):
    from vk_harness import Kernels

    k = Kernels(dev)
    yield k
    k.close()


@pytest.fixture
def gpu(dev):
    from vk_harness import Gpu

    g = Gpu(dev)
    yield g
    g.close()


# -- NPU on the XRT stand-in (tests/fake_pyxrt.py, tests/npu_fixtures.py) ---------------------------------
@pytest.fixture
def fake_npu(tmp_path, monkeypatch):
    """hmad's NPU runtime pointed at the fake XRT, with a fake /dev/accel node and fake kernels installed."""
    from npu_fixtures import FakeNpu, write_fake_kernels

    from hmad.backends.npu.xrt import forget_device

    accel = tmp_path / "accel"
    accel.mkdir()
    (accel / "accel0").touch()
    monkeypatch.setenv("HMAD_PYXRT", "fake_pyxrt")
    monkeypatch.setenv("HMAD_ACCEL_DIR", str(accel))
    monkeypatch.delenv("HMAD_FAKE_XRT", raising=False)
    npu = FakeNpu(write_fake_kernels(tmp_path / "kernels"), accel)
    npu.fail()
    yield npu
    forget_device()


@pytest.fixture(scope="session")
def run_shared_dir(tmp_path_factory) -> Path:
    """A folder that every worker of this test run shares (with `-n`, each worker's own temp folders sit in
    it), for checks that span tests the workers share out (test_vulkan_backend's greedy groups)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
