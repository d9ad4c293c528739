"""hmad with backend: npu as a real process on a real socket, on the XRT stand-in (tests/fake_pyxrt.py) and a
tiny random GGUF model: requests answered as the cpu backend answers them (greedy), also when the fake NPU
fails in the middle of a request, and hmactl status saying which ops ran where and why.

(The tiny random models' greedy continuations are repetitive, so equal token ids are a weak check on their
own; tests/test_npu_backend.py compares logits.)"""

from __future__ import annotations

import pytest
from daemon_harness import Daemon
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client
from hmad.composition import load_model
from hmad.engine.generate import generate
from hmad.engine.sampling import SamplingParams

PROMPTS = [
    "hello world the cat and the dog is in the model of the world that is in the cat",
    "the model is a dog and the world is a cat",
    "a b c d e f g h i j k l m n o p",
]
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=7, types=MIXED)


@pytest.fixture(scope="module")
def cpu_answers(tiny_path):
    model = load_model(tiny_path, backend="cpu")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return [r.token_ids for r in generate(model, PROMPTS, params)]


def npu_daemon(tiny_path, tmp_path, fake_npu, monkeypatch, **failures) -> Daemon:
    for key, value in fake_npu.env(**failures).items():
        monkeypatch.setenv(key, value)
    sets = [f"npu.xclbin_dir={fake_npu.kernels}", "npu.idle_s=0", "npu.min_rows=4"]
    return Daemon(tiny_path, tmp_path, *sets, backend="npu").wait_ready()


def ask_all(d: Daemon) -> tuple[list[list[int]], dict]:
    with Client(d.socket, timeout=120) as c:
        answers = [c.generate(p, raw=True, max_tokens=MAX_TOKENS, temperature=0).token_ids for p in PROMPTS]
        return answers, c.status()


def test_npu_daemon_answers_as_the_cpu_backend(tiny_path, cpu_answers, tmp_path, fake_npu, monkeypatch):
    d = npu_daemon(tiny_path, tmp_path, fake_npu, monkeypatch)
    try:
        answers, status = ask_all(d)
    finally:
        assert d.stop() == 0, d.log_text()
    assert answers == cpu_answers
    npu = status["npu"]
    assert status["backend"] == "npu" and npu["used"] and npu["xrt"] == "fake_pyxrt (a stand-in, not the NPU)"
    assert npu["ops"]["gemm_int8"].startswith("npu (checked") and npu["runs"] > 0
    assert npu["ops"]["attention_prefill"].startswith("npu (checked")
    assert "not the real NPU" in d.log_path.read_text()


@pytest.mark.parametrize(
    "failure, at, reason",
    [
        ("run_error_at", 40, "NPU run failed"),  # run 40 is inside the first request's prefill
        ("timeout_at", 40, "NPU run timed out"),
        ("wrong_output_at", 1, "first-use check"),  # caught where each op is first used
    ],
)
def test_npu_failing_mid_request_still_answers(
    tiny_path, cpu_answers, tmp_path, fake_npu, monkeypatch, failure, at, reason
):
    d = npu_daemon(tiny_path, tmp_path, fake_npu, monkeypatch, **{failure: at})
    try:
        answers, status = ask_all(d)
    finally:
        assert d.stop() == 0, d.log_text()
    assert answers == cpu_answers
    ops = status["npu"]["ops"]
    assert ops["gemm_int8"].startswith("cpu: ") and reason in ops["gemm_int8"]
    assert "moves to the CPU" in d.log_path.read_text()


def test_npu_required_but_absent_stops_the_daemon(tiny_path, tmp_path, fake_npu, monkeypatch):
    monkeypatch.setenv("HMAD_ACCEL_DIR", str(tmp_path / "no-accel"))
    d = Daemon(tiny_path, tmp_path, "npu.enabled=true", backend="npu")
    assert d.proc.wait(60) == 1
    assert "NPU unavailable: no accel device node" in d.log_text()
