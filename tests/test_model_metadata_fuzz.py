"""Model metadata is not trusted: every numeric hyper-parameter of a GGUF file or an HF config.json, set to 0,
1, -1, 2^31, 2^32-1 or 2^63 (one at a time, then several at once by hypothesis), is either refused with a
ModelFormatError that names the key, or gives a model that serves: a load, a short greedy generation through
the scheduler, and finite logits, each within seconds and bounded memory.

The loads run in one worker process under an address-space cap (RLIMIT_AS, set after its imports and one
warm-up load), so a loader that allocates in proportion to a bad value fails with MemoryError instead of
taking the machine down; each load is also timed by the test (a hang kills the worker and fails), and its
Python/numpy allocations are measured with tracemalloc.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hf_tiny
import pytest
from daemon_harness import Daemon
from gguf import GGUFValueType as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_gguf import make_tiny_gguf

HERE = Path(__file__).parent
VALUES = [0, 1, -1, 1 << 31, (1 << 32) - 1, 1 << 63]
LOAD_S = 5.0  # one load + generation, far above the ~0.1 s they take
PEAK_BYTES = 64 << 20  # traced allocations of one load + generation (the baseline's are ~1 MB)
AS_HEADROOM = 1 << 30  # address space the worker may add to what it has after warming up
PROMPT = "hello world"

# The tiny GGUF's shape: values distinct from 0, 1 and each other, so a changed key is noticed.
GGUF_SHAPE = dict(n_layers=6, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96, window=8)
GGUF_INT_KEYS = [
    "gemma3.block_count",
    "gemma3.context_length",
    "gemma3.embedding_length",
    "gemma3.feed_forward_length",
    "gemma3.attention.head_count",
    "gemma3.attention.head_count_kv",
    "gemma3.attention.key_length",
    "gemma3.attention.value_length",
    "gemma3.attention.sliding_window",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "general.alignment",
]
GGUF_FLOAT_KEYS = [
    "gemma3.attention.layer_norm_rms_epsilon",
    "gemma3.rope.freq_base",
    "gemma3.rope.scaling.factor",
]
#: keys that do not change what the model computes when accepted: its tokens must equal the baseline's
GGUF_NEUTRAL = {
    "gemma3.context_length",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "general.alignment",
}

HF_INT_KEYS = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "sliding_window",
    "sliding_window_pattern",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
]
HF_FLOAT_KEYS = [
    "rms_norm_eps",
    "rope_theta",
    "rope_local_base_freq",
    "rope_scaling.factor",
    "query_pre_attn_scalar",
    "attention_dropout",
]
HF_NEUTRAL = {
    "max_position_embeddings",
    "bos_token_id",  # hmad's HF tokenizer takes its ids from tokenizer.json
    "eos_token_id",
    "pad_token_id",
    "attention_dropout",
    "sliding_window_pattern",  # layer_types decides
}


# --- the worker ---------------------------------------------------------------------------------------------


def serve() -> None:
    """Worker loop: one JSON request per stdin line ({"path"}), one JSON answer per line on the original
    stdout. Imports, warms up on argv[1], then caps its address space."""
    import resource
    import time
    import traceback
    import tracemalloc

    import numpy as np

    from hmad.composition import load_model
    from hmad.core.errors import ModelFormatError
    from hmad.engine.generate import forward_full, generate
    from hmad.engine.sampling import SamplingParams

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints go to stderr, not into the answers

    def run(path: str) -> dict[str, Any]:
        tracemalloc.start()
        t0 = time.perf_counter()
        answer: dict[str, Any] = {}
        try:
            model = load_model(path, backend="cpu")
            res = generate(model, [PROMPT], SamplingParams(max_tokens=3, temperature=0.0))[0]
            logits = forward_full(model, res.prompt_token_ids)
            answer.update(
                tokens=res.token_ids,
                prompt=res.prompt_token_ids,
                finite=bool(np.isfinite(logits).all()),
                last=logits[-1].tolist(),
                config={k: getattr(model.config, k) for k in ("n_layers", "sliding_window", "rms_eps")},
            )
        except ModelFormatError as e:
            answer.update(refused=str(e))
        except BaseException as e:  # noqa: BLE001 - anything else is what the test is looking for
            answer.update(crashed=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
        answer.update(seconds=time.perf_counter() - t0, peak=tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        return answer

    run(sys.argv[1])  # warm-up: imports and first-use costs
    status = Path("/proc/self/status").read_text().splitlines()
    vm = next(int(x.split()[1]) * 1024 for x in status if x.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + AS_HEADROOM, vm + AS_HEADROOM))
    for line in sys.stdin:
        out.write(json.dumps(run(json.loads(line)["path"])) + "\n")
        out.flush()


class Worker:
    """The test's side of the worker process."""

    def __init__(self, warm_path: Path):
        env = {
            **os.environ,
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]),
        }
        code = "import test_model_metadata_fuzz as t; t.serve()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(warm_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)

    def load(self, path: Path, what: str, timeout: float = 20.0) -> dict[str, Any]:
        """The worker's answer for the model at ``path``; fails the test if it takes over ``timeout``."""
        self.proc.stdin.write(json.dumps({"path": str(path)}) + "\n")
        self.proc.stdin.flush()
        if not self.sel.select(timeout):
            self.close()
            pytest.fail(f"{what}: no answer in {timeout} s (the load hangs)")
        line = self.proc.stdout.readline()
        if not line:
            pytest.fail(f"{what}: the worker died (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def check_answer(a: dict[str, Any], keys: list[str], what: str, base: dict[str, Any], neutral: bool) -> None:
    """Refused naming one of ``keys``, or served (finite logits; ``neutral``: the baseline's tokens)."""
    assert "crashed" not in a, f"{what}: {a.get('crashed')}\n{a.get('trace')}"
    assert a["seconds"] < LOAD_S, f"{what}: took {a['seconds']:.1f} s"
    assert a["peak"] < PEAK_BYTES, f"{what}: allocated {a['peak'] / 2**20:.0f} MiB"
    if "refused" in a:
        named = [k for k in keys if k in a["refused"]]
        assert named, f"{what}: refused without naming {keys}: {a['refused']}"
        return
    assert a["tokens"] and a["finite"], f"{what}: served, but tokens {a['tokens']} finite {a['finite']}"
    if neutral:  # the very same computation
        assert (a["prompt"], a["tokens"], a["last"]) == (base["prompt"], base["tokens"], base["last"]), what


# --- GGUF ---------------------------------------------------------------------------------------------------


def gguf_value(key: str, value: int | float) -> tuple[Any, T]:
    """``value`` in the GGUF type the key has (u32, f32), widened where it does not fit (u64, i32, f64)."""
    if key in GGUF_FLOAT_KEYS:
        return float(value), T.FLOAT32 if abs(value) < 1e38 else T.FLOAT64
    if value < 0:
        return value, T.INT32
    return value, T.UINT32 if value < 1 << 32 else T.UINT64


def write_gguf(path: Path, changes: dict[str, tuple[Any, T]]) -> Path:
    """The tiny GGUF with ``changes``; a general.alignment the writer can honour is written with it."""
    align = changes.get("general.alignment", (None,))[0]
    honoured = isinstance(align, int) and 0 < align <= 4096 and not align & (align - 1)
    rest = {k: v for k, v in changes.items() if not (honoured and k == "general.alignment")}
    return make_tiny_gguf(path, metadata=rest, alignment=align if honoured else None, **GGUF_SHAPE)


@pytest.fixture(scope="module")
def gguf_worker(tmp_path_factory):
    base = write_gguf(tmp_path_factory.mktemp("gguf") / "base.gguf", {})
    w = Worker(base)
    answer = w.load(base, "baseline")
    assert "tokens" in answer and answer["finite"], answer
    yield w, answer
    w.close()


@pytest.mark.parametrize("key", GGUF_INT_KEYS + GGUF_FLOAT_KEYS)
def test_gguf_key_extremes(gguf_worker, tmp_path, key):
    worker, base = gguf_worker
    for value in VALUES:
        path = write_gguf(tmp_path / "m.gguf", {key: gguf_value(key, value)})
        what = f"{key} = {value}"
        check_answer(worker.load(path, what), [key], what, base, key in GGUF_NEUTRAL)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.dictionaries(
        st.sampled_from(GGUF_INT_KEYS + GGUF_FLOAT_KEYS),
        st.sampled_from(VALUES) | st.integers(0, 4096) | st.sampled_from([math.nan, math.inf, 0.5]),
        min_size=1,
        max_size=4,
    )
)
def test_gguf_keys_together(gguf_worker, tmp_path, changes):
    worker, base = gguf_worker
    for key, value in changes.items():  # floats only where the key holds floats
        if isinstance(value, float) and key not in GGUF_FLOAT_KEYS:
            changes[key] = 2
    typed = {k: gguf_value(k, v) for k, v in changes.items()}
    what = f"{changes}"
    neutral = set(changes) <= GGUF_NEUTRAL
    check_answer(
        worker.load(write_gguf(tmp_path / "m.gguf", typed), what), list(changes), what, base, neutral
    )


# --- HF config.json ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_worker(tmp_path_factory):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf") / "ck")
    w = Worker(d)
    answer = w.load(d, "baseline")
    assert "tokens" in answer and answer["finite"], answer
    yield w, d, answer
    w.close()


def write_config(d: Path, changes: dict[str, Any], drop_layer_types: bool = False) -> None:
    c = hf_tiny.text_config()
    if drop_layer_types:
        del c["layer_types"]
    for key, value in changes.items():
        if key == "rope_scaling.factor":
            c["rope_scaling"] = {**c["rope_scaling"], "factor": value}
        else:
            c[key] = value
    (d / "config.json").write_text(json.dumps(c))


HF_CASES = [(k, True) for k in HF_INT_KEYS + HF_FLOAT_KEYS] + [
    (k, False)
    for k in ("num_hidden_layers", "sliding_window_pattern")  # the pattern decides the layers
]


@pytest.mark.parametrize(("key", "layer_types"), HF_CASES, ids=[f"{k}-{t}" for k, t in HF_CASES])
def test_hf_key_extremes(hf_worker, key, layer_types):
    worker, d, base = hf_worker
    for value in VALUES:
        write_config(d, {key: value}, drop_layer_types=not layer_types)
        what = f"{key} = {value} ({'with' if layer_types else 'without'} layer_types)"
        neutral = key in HF_NEUTRAL and (layer_types or key != "sliding_window_pattern")
        check_answer(worker.load(d, what), [key], what, base, neutral)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.dictionaries(
        st.sampled_from(HF_INT_KEYS + HF_FLOAT_KEYS),
        st.sampled_from(VALUES)
        | st.integers(0, 4096)
        | st.sampled_from([0.5, 2.0, -0.0, True, None, "6", [1]]),
        min_size=1,
        max_size=4,
    ),
    st.booleans(),
)
def test_hf_keys_together(hf_worker, changes, drop_layer_types):
    worker, d, base = hf_worker
    write_config(d, changes, drop_layer_types)
    what = f"{changes} (layer_types dropped: {drop_layer_types})"
    neutral = set(changes) <= HF_NEUTRAL - ({"sliding_window_pattern"} if drop_layer_types else set())
    neutral = neutral and all(v is not None for v in changes.values())  # null: the default
    check_answer(worker.load(d, what), list(changes), what, base, neutral)


# --- the daemon ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [("gemma3.block_count", (1 << 32) - 1), ("gemma3.attention.head_count", 0), ("gemma3.context_length", 0)],
)
def test_daemon_refuses_the_model_at_once(tmp_path, key, value):
    """hmad given such a file exits 1 within seconds (before it ever serves), its log naming the key."""
    path = write_gguf(tmp_path / "bad.gguf", {key: gguf_value(key, value)})
    t0 = time.monotonic()
    d = Daemon(path, tmp_path)
    try:
        rc = d.proc.wait(timeout=30)
    finally:
        d.stop()
    assert rc == 1 and time.monotonic() - t0 < 30
    assert f"{key} = {value}" in d.log_text(), d.log_text()
