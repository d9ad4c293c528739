"""backend: npu on the XRT stand-in: the CPU backend with matmuls and prefill attention on the (fake) NPU,
first uses checked against the CPU, and every failure (no device, no kernels, context limit, run error,
timeout, wrong output) ending in the CPU's answer with the reason in status. Also backend auto, the status
entry of the other backends, and the npu config keys."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_gguf import MIXED, make_tiny_gguf

from hmad.backends.npu.backend import NpuBackend
from hmad.backends.npu.errors import NpuContextError, NpuUnavailable, NpuUnsupportedShape
from hmad.backends.npu.routing import Route, Router
from hmad.backends.npu.status import VULKAN_GRAPH_REASON, npu_status, vulkan_npu_status
from hmad.composition import load_model, resolve_backend_name
from hmad.config import ConfigError, load_config
from hmad.engine.generate import forward_full, generate
from hmad.engine.sampling import SamplingParams

TOKENS = list(range(262, 302))  # 40 tokens: one prefill step, every matmul >= min_rows


@pytest.fixture(scope="module")
def quant_model(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("npu") / "mixed.gguf", seed=11, types=MIXED)


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("npu") / "f32.gguf", seed=12)


@pytest.fixture(scope="module")
def cpu_logits(quant_model):
    return forward_full(load_model(quant_model, backend="cpu"), TOKENS)


def npu_model(path, fake_npu, **opts):
    opts = {"xclbin_dir": str(fake_npu.kernels), "idle_s": 0.0, "min_rows": 1, **opts}
    return load_model(path, backend="npu", **opts)


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def ops_of(model) -> dict[str, str]:
    return model.backend.npu_status()["ops"]


# -- the happy path ------------------------------------------------------------------------------------------
def test_quantized_model_runs_int8_gemms_and_attention_on_the_npu(quant_model, cpu_logits, fake_npu):
    m = npu_model(quant_model, fake_npu)
    logits = forward_full(m, TOKENS)
    assert rel(logits, cpu_logits) < 0.03
    ops = ops_of(m)
    assert ops["gemm_int8"].startswith("npu (checked") and ops["attention_prefill"].startswith("npu (checked")
    assert ops["gemm_bf16"].startswith("npu (not used yet")
    st = m.backend.npu_status()
    assert st["used"] and st["xrt"] == "fake_pyxrt (a stand-in, not the NPU)" and st["runs"] > 0
    assert st["device"].startswith("RyzenAI-npu1 (npu1)")
    mem = m.backend.describe()["memory"]
    assert mem["host RAM: NPU weight copies"] > 0 and mem["host RAM: NPU buffer objects"] > 0
    assert fake_npu.state.misuse == []


def test_context_and_buffers_reused_across_requests(quant_model, fake_npu):
    m = npu_model(quant_model, fake_npu)
    forward_full(m, TOKENS)
    contexts, bos, runs = list(fake_npu.state.contexts), len(fake_npu.state.bos), len(fake_npu.state.runs)
    assert sorted(contexts) == ["gemm_bf16", "gemm_int8", "softmax_bf16"]
    for _ in range(2):
        forward_full(m, TOKENS[:35])
    assert fake_npu.state.contexts == contexts and len(fake_npu.state.bos) == bos
    assert len(fake_npu.state.runs) > runs and fake_npu.state.device_opens == 1
    npu_model(quant_model, fake_npu)  # a second backend in the process: same device, same contexts
    assert fake_npu.state.contexts == contexts and fake_npu.state.device_opens == 1


def test_float_model_runs_bf16_gemms(float_model, fake_npu):
    m = npu_model(float_model, fake_npu)
    ref = forward_full(load_model(float_model, backend="cpu"), TOKENS)
    assert rel(forward_full(m, TOKENS), ref) < 0.01
    assert ops_of(m)["gemm_bf16"].startswith("npu (checked") and "not used yet" in ops_of(m)["gemm_int8"]


def test_greedy_output_equals_the_cpu_backend(quant_model, fake_npu):
    prompts = ["hello world the cat and the dog is in the model of the world that is " * 2, "a b c d e f g h"]
    p = SamplingParams(temperature=0, max_tokens=6)
    cpu = [r.token_ids for r in generate(load_model(quant_model, backend="cpu"), prompts, p)]
    m = npu_model(quant_model, fake_npu, min_rows=8)
    assert [r.token_ids for r in generate(m, prompts, p)] == cpu
    assert "checked" in ops_of(m)["gemm_int8"]


def test_small_matmuls_stay_on_the_cpu(quant_model, fake_npu):
    m = npu_model(quant_model, fake_npu, min_rows=32, ops=["gemm_int8"])
    runs = len(fake_npu.state.runs)
    forward_full(m, TOKENS[:20])
    assert len(fake_npu.state.runs) == runs  # 20 rows < min_rows: nothing went to the NPU
    assert ops_of(m)["attention_prefill"] == "cpu: not in npu.ops"


def test_idle_npu_is_warmed_up_while_the_cpu_works(quant_model, fake_npu):
    m = npu_model(quant_model, fake_npu, idle_s=5.0, ops=["gemm_int8"])
    ctx = m.backend.offload.contexts["gemm_int8"]
    route = m.backend.offload.router.routes["gemm_int8"]
    ctx.last_run -= 10.0
    forward_full(m, TOKENS)
    assert route.cpu_calls == 1 and route.npu_calls > 0  # the first matmul waited for nothing


# -- every failure ends in the CPU's answer ----------------------------------------------------------------
def test_no_device_means_cpu_with_the_reason(quant_model, cpu_logits, fake_npu, tmp_path, monkeypatch):
    monkeypatch.setenv("HMAD_ACCEL_DIR", str(tmp_path / "empty"))
    fake_npu.fail()
    m = npu_model(quant_model, fake_npu)
    np.testing.assert_array_equal(forward_full(m, TOKENS), cpu_logits)
    st = m.backend.npu_status()
    assert not st["used"] and st["reason"].startswith("NPU unavailable: no accel device node")
    assert all(v.startswith("cpu: NPU unavailable") for v in st["ops"].values())
    with pytest.raises(NpuUnavailable):
        npu_model(quant_model, fake_npu, enabled=True)


def test_no_kernels_means_cpu_with_the_reason(quant_model, fake_npu, tmp_path):
    m = npu_model(quant_model, fake_npu, xclbin_dir=str(tmp_path / "none"))
    assert m.backend.npu_status()["reason"].startswith("NPU kernels missing: no npu1 kernels installed")


def test_context_limit(quant_model, cpu_logits, fake_npu):
    fake_npu.fail(context_limit=2)  # gemm_bf16 and gemm_int8 get theirs; softmax_bf16 is refused
    m = npu_model(quant_model, fake_npu)
    assert rel(forward_full(m, TOKENS), cpu_logits) < 0.03
    ops = ops_of(m)
    assert ops["attention_prefill"].startswith("cpu: NPU context refused: hw_context for softmax_bf16")
    assert ops["gemm_int8"].startswith("npu (checked")
    fake_npu.fail(context_limit=0)
    with pytest.raises(NpuContextError, match="hw_context for gemm_bf16"):
        npu_model(quant_model, fake_npu, enabled=True)


@pytest.mark.parametrize(
    "failure, reason",
    [("run_error_at", "run ended in state ERROR"), ("timeout_at", "timed out"),
     ("wrong_output_at", "first-use check of")],
)  # fmt: skip
def test_npu_failing_mid_run_falls_back(quant_model, cpu_logits, fake_npu, failure, reason):
    m = npu_model(quant_model, fake_npu)
    first = forward_full(m, TOKENS)  # every op checked on the NPU
    setattr(fake_npu.state, failure, len(fake_npu.state.runs) + 1)
    if failure == "wrong_output_at":  # wrong output is caught on an op's first use: use a new shape
        m.backend.offload.router.routes["gemm_int8"].checked.clear()
        m.backend.offload.router.routes["attention_prefill"].checked.clear()
    second = forward_full(m, TOKENS)
    ops = ops_of(m)
    assert reason in ops["gemm_int8"] and ops["gemm_int8"].startswith("cpu: ")
    assert rel(second, cpu_logits) < 0.03 and rel(first, cpu_logits) < 0.03
    np.testing.assert_array_equal(forward_full(m, TOKENS), cpu_logits)  # all on the CPU now
    assert fake_npu.state.misuse == []


def test_wrong_output_on_first_use_returns_the_cpu_result(quant_model, cpu_logits, fake_npu):
    fake_npu.fail(wrong_output_at=1)
    m = npu_model(quant_model, fake_npu)
    np.testing.assert_array_equal(forward_full(m, TOKENS), cpu_logits)
    assert all("first-use check" in ops_of(m)[op] for op in ("gemm_int8", "attention_prefill"))


def test_router_unsupported_shape_keeps_the_op():
    router = Router({"gemm_bf16": Route("gemm_bf16", True)})

    def npu():
        raise NpuUnsupportedShape("too many keys")

    assert router.call("gemm_bf16", "k", [], npu, lambda: np.ones(2)).tolist() == [1, 1]
    assert router.routes["gemm_bf16"].on_npu and router.routes["gemm_bf16"].cpu_calls == 1


# -- backend auto, status of other backends, config ----------------------------------------------------
def test_auto_picks_the_npu_when_present_and_says_why_not_otherwise(fake_npu, tmp_path, monkeypatch):
    assert resolve_backend_name("auto", {"xclbin_dir": str(fake_npu.kernels)}) == "npu"
    assert resolve_backend_name("auto", {"xclbin_dir": str(fake_npu.kernels), "enabled": False}) == "cpu"
    monkeypatch.setenv("HMAD_ACCEL_DIR", str(tmp_path / "empty"))
    fake_npu.fail()
    assert resolve_backend_name("auto", {}) == "cpu"
    cpu = load_model(make_tiny_gguf(tmp_path / "m.gguf", n_layers=1), backend="cpu").backend
    st = npu_status(cpu)
    assert not st["used"] and "backend auto found no usable NPU: NPU unavailable: no accel" in st["reason"]


def test_vulkan_status_says_npu_offload_is_not_used():
    class Vk:
        name = "vulkan"

    assert npu_status(Vk()) == vulkan_npu_status() == {"used": False, "reason": VULKAN_GRAPH_REASON}
    assert VULKAN_GRAPH_REASON.startswith("NPU offload is not used with the Vulkan graph backend: ")


def test_npu_config():
    cfg = load_config(overrides={"backend": "npu", "npu.min_rows": 64, "cpu.kv_dtype": "float16"}, env={})
    opts = cfg.backend_options("npu")
    assert opts["min_rows"] == 64 and opts["kv_dtype"] == "float16" and opts["timeout_s"] == 5.0
    with pytest.raises(ConfigError, match="npu.enabled: is false, but backend is npu"):
        load_config(overrides={"backend": "npu", "npu.enabled": False}, env={})
    with pytest.raises(ConfigError, match="npu.timeout_s: must be a number in"):
        load_config(overrides={"npu.timeout_s": 0}, env={})
    backend = NpuBackend(**{**opts, "enabled": False})
    assert backend.kv_dtype == "float16" and backend.npu_status()["reason"] == "npu.enabled is false"
