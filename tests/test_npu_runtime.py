"""The NPU runtime's host side against the XRT stand-in (tests/fake_pyxrt.py): finding and opening the device
(once), the kernel manifest, one context per kernel with its buffer objects made once, the documented run
argument layout, sync directions, and every XRT failure turned into a named error."""

from __future__ import annotations

import json

import fake_pyxrt
import numpy as np
import pytest

from hmad.backends.npu import xrt
from hmad.backends.npu.context import KernelContext
from hmad.backends.npu.errors import (
    NpuContextError,
    NpuKernelsMissing,
    NpuRunError,
    NpuTimeout,
    NpuUnavailable,
)
from hmad.backends.npu.kernels import CATALOGUE, find_kernels, read_insts

TO_DEV, FROM_DEV = "XCL_BO_SYNC_BO_TO_DEVICE", "XCL_BO_SYNC_BO_FROM_DEVICE"


def gemm_context(fake_npu, name: str = "gemm_int8", **kw) -> KernelContext:
    dev = xrt.open_device()
    return KernelContext(dev, find_kernels(dev.family, str(fake_npu.kernels), [name])[name], **kw)


# -- finding and opening the device ---------------------------------------------------------------------
def test_no_accel_node_is_named(fake_npu, tmp_path, monkeypatch):
    monkeypatch.setenv("HMAD_ACCEL_DIR", str(tmp_path / "nothing"))
    with pytest.raises(NpuUnavailable, match="no accel device node in .*nothing"):
        xrt.open_device()


def test_missing_xrt_module_is_named(fake_npu, monkeypatch):
    monkeypatch.setenv("HMAD_PYXRT", "no_such_xrt_module")
    with pytest.raises(NpuUnavailable, match="cannot import no_such_xrt_module"):
        xrt.open_device()


def test_device_opened_once_per_process(fake_npu):
    assert xrt.open_device() is xrt.open_device()
    assert fake_npu.state.device_opens == 1


def test_transient_open_failure_is_retried(fake_npu, monkeypatch):
    monkeypatch.setattr(xrt, "OPEN_RETRIES_S", (0.0, 0.0, 0.0))
    fake_npu.fail(no_device=2)
    dev = xrt.open_device()
    assert (fake_npu.state.open_attempts, fake_npu.state.device_opens) == (3, 1)
    assert (dev.name, dev.family) == ("RyzenAI-npu1", "npu1")


def test_device_that_never_opens(fake_npu, monkeypatch):
    monkeypatch.setattr(xrt, "OPEN_RETRIES_S", (0.0, 0.0))
    fake_npu.fail(no_device=-1)
    with pytest.raises(NpuUnavailable, match=r"xrt.device\(0\) failed 3 times: No such device"):
        xrt.open_device()


@pytest.mark.parametrize(
    "name, family",
    [("RyzenAI-npu1", "npu1"), ("NPU Phoenix", "npu1"), ("RyzenAI-npu4", "npu2"), ("NPU Strix Halo", "npu2"),
     ("RyzenAI-npu6", "npu2"), ("Alveo U250", None)],
)  # fmt: skip
def test_device_name_to_family(name, family):
    assert xrt.npu_family(name) == family


def test_unknown_device_is_refused(fake_npu):
    fake_npu.fail(device_name="Alveo U250")
    with pytest.raises(NpuUnavailable, match="unknown NPU 'Alveo U250'"):
        xrt.open_device()


# -- the installed kernels --------------------------------------------------------------------------------
def test_manifest_found_and_checked(fake_npu, tmp_path):
    files = find_kernels("npu1", str(fake_npu.kernels), list(CATALOGUE))
    assert set(files) == set(CATALOGUE) and files["gemm_int8"].kernel_name == "MLIR_AIE"
    with pytest.raises(NpuKernelsMissing, match="no npu2 kernels installed"):
        find_kernels("npu2", str(fake_npu.kernels), ["gemm_int8"])
    manifest = fake_npu.kernels / "npu1" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["kernels"]["gemm_int8"]["args"][0][2] = [128, 256]
    manifest.write_text(json.dumps(doc))
    with pytest.raises(
        NpuKernelsMissing, match="gemm_int8 was built with arguments .*rebuild with npu_kernels"
    ):
        find_kernels("npu1", str(fake_npu.kernels), ["gemm_int8"])
    del doc["kernels"]["gemm_int8"]
    manifest.write_text(json.dumps(doc))
    with pytest.raises(NpuKernelsMissing, match="kernel 'gemm_int8' is not installed"):
        find_kernels("npu1", str(fake_npu.kernels), ["gemm_int8"])


def test_instruction_stream_formats(tmp_path):
    words = np.array([0x06030100, 0x00000105, 0xFFFFFFFF], dtype=np.uint32)
    words.astype("<u4").tofile(tmp_path / "insts.bin")
    (tmp_path / "insts.txt").write_text("".join(f"{w:08x}\n" for w in words))
    np.testing.assert_array_equal(read_insts(str(tmp_path / "insts.bin")), words)
    np.testing.assert_array_equal(read_insts(str(tmp_path / "insts.txt")), words)


# -- a context: made once, buffers reused, the documented argument layout --------------------------------
def test_context_layout_and_buffers_made_once(fake_npu):
    ctx = gemm_context(fake_npu)
    st = fake_npu.state
    assert st.contexts == ["gemm_int8"] and len(st.registered) == 1
    instr = [b for b in st.bos if b[2] == fake_pyxrt.kernel.GROUP_BASE + 1]
    assert instr == [(96 * 4, fake_pyxrt.bo.cacheable, 101)]  # 96 instruction words, group_id(1)
    data = [b for b in st.bos if b[2] != 101]
    spec = CATALOGUE["gemm_int8"]
    expected = [(a.nbytes, fake_pyxrt.bo.host_only, 103 + i) for i, a in enumerate(spec.args)]
    assert data == expected * 3  # two pipelined sets and the warm-up set
    n_bos = len(st.bos)
    rng = np.random.default_rng(0)
    for _ in range(4):
        a = rng.integers(-127, 128, (256, 256), dtype=np.int8)
        b = rng.integers(-127, 128, (512, 256), dtype=np.int8)
        bufs = ctx.sets[0]
        bufs.views[0][...], bufs.views[1][...] = a, b
        (c,) = ctx.run(bufs)
        np.testing.assert_array_equal(c, a.astype(np.int64) @ b.astype(np.int64).T)
    assert len(st.bos) == n_bos and st.contexts == ["gemm_int8"], "buffers or contexts made per call"
    assert st.misuse == [] and ctx.runs == 4


def test_sync_directions(fake_npu):
    ctx = gemm_context(fake_npu)
    bufs = ctx.sets[1]
    a_id, b_id, c_id = (bo.id for bo in bufs.bos)
    fake_npu.state.syncs.clear()
    ctx.run(bufs)
    assert fake_npu.state.syncs == [(a_id, TO_DEV), (b_id, TO_DEV), (c_id, FROM_DEV)]


def test_inputs_not_synced_are_not_seen(fake_npu):
    """The fake keeps host and device copies apart: it would catch a runtime that forgot a sync."""
    ctx = gemm_context(fake_npu)
    bufs = ctx.sets[0]
    bufs.views[0][...] = 1
    bufs.views[1][...] = 1
    ctx.run(bufs)
    bufs.views[0][...] = 2  # written to the host copy only
    run = ctx.kernel(3, ctx.instr_bo, ctx.n_instr, *bufs.bos)
    run.wait(1000)
    assert int(bufs.bos[2].device.view(np.int32)[0]) == 256  # still 1 * 1 * 256: the 2s never reached it


def test_context_limit_is_named(fake_npu):
    fake_npu.fail(context_limit=0)
    with pytest.raises(NpuContextError, match="hw_context for gemm_int8 .*CREATE_HWCTX"):
        gemm_context(fake_npu)


def test_run_error_is_named(fake_npu):
    ctx = gemm_context(fake_npu)
    fake_npu.state.run_error_at = 1
    with pytest.raises(NpuRunError, match="gemm_int8: run ended in state ERROR"):
        ctx.run(ctx.sets[0])


def test_timeout_retires_the_context(fake_npu):
    ctx = gemm_context(fake_npu, timeout_s=0.25)
    fake_npu.state.timeout_at = 1
    with pytest.raises(NpuTimeout, match="no completion within 250 ms"):
        ctx.run(ctx.sets[0])
    fake_npu.state.timeout_at = 0
    with pytest.raises(NpuRunError, match="not used again after a run timed out"):
        ctx.run(ctx.sets[0])


def test_warm_up_after_idle_never_waits_on_the_caller(fake_npu):
    ctx = gemm_context(fake_npu)
    assert not ctx.is_cold(5.0)
    ctx.last_run -= 10.0  # ten seconds idle: Phoenix's first run would take ~120 ms
    runs = len(fake_npu.state.runs)
    assert ctx.is_cold(5.0) and ctx.warming is not None
    assert fake_npu.state.events[-1] == ("start", runs + 1)  # started, not waited for
    assert not ctx.is_cold(5.0) and ctx.warming is None  # finished: the NPU is warm again
    assert not ctx.is_cold(0.0)
