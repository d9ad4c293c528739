"""logit_bias, presence and frequency penalties on the device (shaders/logit_bias.comp, backends/vulkan/
bias.py): the kernel's rows against numpy (its buffer poisoned past the step's entries), and whole requests
whose tokens the device picks (argmax, top-k candidates, pipelined draws) against the same requests sampled
from whole rows on the host, and against the numpy backend. Needs a Vulkan device (lavapipe in CI)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from test_model_cpu import rand_ids
from tiny_gguf import make_tiny_gguf
from vk_harness import open_device

from hmad.composition import load_model
from hmad.core.batch import BIAS_DTYPE, SeqSlice, StepBatch
from hmad.engine.kvcache import KVCacheManager
from hmad.engine.request import Request
from hmad.engine.sampling import SamplingParams
from hmad.engine.scheduler import Scheduler, SchedulerConfig

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    with open_device():  # or a skip that says why
        pass
    path = make_tiny_gguf(tmp_path_factory.mktemp("pen") / "tiny.gguf", seed=3)
    cpu = load_model(path, "cpu", numerics="f32")
    vk = load_model(path, "vulkan")
    yield cpu, vk, Scheduler(cpu, CFG), Scheduler(vk, CFG)  # one each: the recordings made once
    vk.backend.close()


# no prefix cache: every run computes its prompts afresh, as the first did
CFG = SchedulerConfig(max_seqs=4, step_tokens=24, max_chunk=16, kv_tokens=1024, prefix_cache=False)
_ids = itertools.count()


def _run(sched: Scheduler, prompts, params, pipeline: bool = True) -> tuple[list[list[int]], int]:
    """Each prompt's tokens, and the steps launched fed, driving ``sched`` by hand as the engine does."""
    sched.cfg.pipeline = pipeline
    fed0, out = sched.pipelined_steps, {}
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for ids, p in zip(prompts, plist, strict=True):
        p.validate()
        rid = next(_ids)
        sched.submit(Request(rid, list(ids), dataclasses.replace(p)))
        out[rid] = []
    while sched.has_work():
        for ev in sched.step():
            if ev.kind == "token":
                out[ev.request_id] += ev.token_ids
    return list(out.values()), sched.pipelined_steps - fed0


def _batch(sched: Scheduler, n: int) -> StepBatch:
    """One sequence of ``n`` random tokens from an empty cache (the scheduler's pools, idle between its
    runs), every row's logits wanted."""
    layout, model = sched.layout, sched.model
    blocks = KVCacheManager(layout).reserve(0, n)
    s = SeqSlice(0, 0, n, 0, blocks.global_table, blocks.local_table)
    ids = rand_ids(np.random.default_rng(0), n, model.config.vocab_size)
    batch = StepBatch.build([(s, ids, True)], layout.block_size)
    batch.logit_rows = np.arange(n, dtype=np.int32)
    return batch


def _poison(be) -> None:
    """Fill both parities' adjustment buffers with entries that would wreck every row (+1e30 on token 0 of
    each row), under a count of all of them: a step must read its own count and its own entries only."""
    for buf in be.ctx.biases:
        words = buf.array(np.uint32)
        junk = np.zeros((words.size - 4) // 3, BIAS_DTYPE)
        junk["row"] = np.arange(junk.size) % 8
        junk["delta"] = 1e30
        words[4 : 4 + 3 * junk.size] = junk.view(np.uint32)
        words[0] = junk.size


def test_the_device_adds_the_deltas_before_its_argmax_and_topk(models):
    """Random entries (several per row, some forcing a token with +100 or banning the argmax with -100):
    the device's argmax and top-k candidates are those of the host's rows plus the same float32 deltas; the
    numpy backend's argmax (its reference, core.batch.add_bias) picks the same tokens."""
    cpu, vk, cpu_sched, sched = models
    be, n = vk.backend, 8
    batch, cpu_batch = _batch(sched, n), _batch(cpu_sched, n)
    raw = vk.forward(batch)  # the copy tail: rows as computed, without the deltas
    rng = np.random.default_rng()
    vocab = raw.shape[1]
    for _ in range(3):
        entries = []
        for r in range(n):
            toks = rng.choice(vocab, int(rng.integers(0, 12)), replace=False)
            deltas = rng.uniform(-30, 30, toks.size)
            kind = rng.integers(3)
            if kind == 1:  # ban the argmax
                toks, deltas = np.append(toks[toks != raw[r].argmax()], raw[r].argmax()), None
            elif kind == 2:  # force a token
                toks, deltas = np.append(toks, (raw[r].argmax() + 1 + rng.integers(vocab - 1)) % vocab), None
            if deltas is None:
                deltas = np.append(rng.uniform(-30, 30, toks.size - 1), -100.0 if kind == 1 else 100.0)
            if r == 0:  # one sure change of an argmax: a token lifted past the row's maximum
                t = (raw[0].argmax() + 1) % vocab
                toks, deltas = np.array([t]), np.array([raw[0].max() - raw[0][t] + 1.0])
            toks, idx = np.unique(toks, return_index=True)
            entries += [(r, int(t), float(d)) for t, d in zip(toks, np.asarray(deltas)[idx], strict=True)]
        batch.bias = cpu_batch.bias = np.array(entries, BIAS_DTYPE)
        want = raw.copy()
        want[batch.bias["row"], batch.bias["token"]] += batch.bias["delta"]
        assert not np.array_equal(want.argmax(axis=1), raw.argmax(axis=1))
        assert np.array_equal(cpu.backend.greedy(cpu.backend.run(cpu.net, cpu_batch)), want.argmax(axis=1))
        for _ in range(2):  # both parities
            _poison(be)
            assert np.array_equal(be.greedy(be.run(vk.net, batch)), want.argmax(axis=1))
        _poison(be)
        ids, vals, _ = be.topk(be.run(vk.net, batch))
        assert np.array_equal(vals, np.take_along_axis(want, ids, axis=1))  # the adjusted values, bit for bit
        k = ids.shape[1]
        best = -np.sort(-want, axis=1)[:, :k]
        assert np.array_equal(vals, best)
        _poison(be)
        assert np.array_equal(vk.forward(batch), raw)  # full rows come back without them


def test_a_step_over_the_buffer_refuses_the_device_tails(models):
    _, vk, _, sched = models
    be = vk.backend
    batch = _batch(sched, 2)
    batch.bias = np.zeros(be.bias_max + 1, BIAS_DTYPE)
    batch.bias["token"] = np.arange(be.bias_max + 1)
    with pytest.raises(ValueError, match="logit adjustments are more than"):
        be.greedy(be.run(vk.net, batch))
    assert vk.forward(batch).shape[0] == 2  # the host path still runs


# The tiny model's top logit leads the rest by ~90 (its tied embeddings repeat the last token): each request
# also lifts 50 tokens by 95 (``_near``), the best of them then within a few units of the top, where the
# penalties (2 + 2 x count at most) decide.
KINDS = [
    dict(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0),
    dict(temperature=0.0, logit_bias={"5": 60.0, "9": -40.0}, frequency_penalty=1.5, presence_penalty=-1.0),
    dict(temperature=10.0, top_k=40, top_p=0.9, presence_penalty=2.0, logit_bias={"3": 90.0}, seed=7),
    dict(temperature=8.0, top_k=64, frequency_penalty=-2.0, repetition_penalty=1.2, seed=8),
]


def _near(prompts) -> dict[str, float]:
    """+95 on 50 tokens no prompt holds (a prompt's own last token would lead by ~200 then)."""
    held = {int(t) for p in prompts for t in p}
    return {str(t): 95.0 for t in [t for t in range(262, 341) if t not in held][:50]}


@pytest.mark.parametrize("kw", KINDS, ids=["greedy-penalties", "greedy-bias", "sampled", "sampled-repeat"])
def test_device_picks_equal_host_rows(models, kw, monkeypatch):
    """The same requests with their tokens picked on the device (argmax, or top-k candidates) and from whole
    rows on the host: the same tokens."""
    _, vk, cpu, sched = models
    be = vk.backend
    rng = np.random.default_rng(5)
    prompts = [rand_ids(rng, n, vk.config.vocab_size) for n in (4, 11, 2)]
    params = SamplingParams(
        max_tokens=8, **{**kw, "logit_bias": {**_near(prompts), **kw.get("logit_bias", {})}}
    )
    params.validate()
    picked = {"greedy": 0}
    real_greedy = be.greedy

    def counted(x):
        picked["greedy"] += 1
        return real_greedy(x)

    monkeypatch.setattr(be, "greedy", counted)
    before = be.topk_steps + be.sampled_steps
    got, _ = _run(sched, prompts, params)
    assert picked["greedy"] + be.topk_steps + be.sampled_steps > before, "no device path was taken"
    monkeypatch.setattr(be, "greedy_on_device", False)
    monkeypatch.setattr(be, "topk_max", 0)
    assert _run(sched, prompts, params)[0] == got
    if params.temperature == 0:  # the numpy backend's too; and the penalties decide its near ties
        assert _run(cpu, prompts, params)[0] == got
        bias_only = SamplingParams(**{**vars(params), "presence_penalty": 0.0, "frequency_penalty": 0.0})
        assert _run(sched, prompts, bias_only)[0] != got
    else:  # draws among the lifted tokens (the candidates were the adjusted row's), not one argmax
        drawn = {t for toks in got for t in toks}
        assert len(drawn) > 1 and drawn <= {int(t) for t in params.logit_bias}


def test_a_logit_bias_pipelines_and_penalties_do_not(models):
    """A logit_bias alone does not depend on the tokens so far: its requests pipeline (the device adds it
    before each launched step's argmax or draw), with the tokens of steps run one by one; a presence
    penalty needs the token in flight, so those steps wait for it, to the same tokens."""
    _, vk, _, sched = models
    rng = np.random.default_rng(9)
    prompts = [rand_ids(rng, n, vk.config.vocab_size) for n in (5, 9, 3)]
    near = _near(prompts)
    biased = [
        SamplingParams(max_tokens=8, temperature=0.0, logit_bias={**near, "2": -80.0}),
        SamplingParams(max_tokens=8, temperature=3.0, top_k=64, seed=3, logit_bias=near),
        SamplingParams(max_tokens=8, temperature=0.0, logit_bias={str(t): 20.0 for t in range(0, 60, 3)}),
    ]
    want, fed = _run(sched, prompts, biased, pipeline=False)
    assert fed == 0
    got, fed = _run(sched, prompts, biased)
    assert got == want and fed > 5
    assert got[:2] != _run(sched, prompts[:2], SamplingParams(max_tokens=8, temperature=0.0))[0]
    penalised = SamplingParams(max_tokens=6, temperature=0.0, presence_penalty=1.0, logit_bias=near)
    want, _ = _run(sched, prompts, penalised, pipeline=False)
    got, fed = _run(sched, prompts, penalised)
    assert got == want and fed == 0
