"""Logprobs on the Vulkan backend (lavapipe in CI) against the numpy backend: the same requests (greedy and
sampled, one alone and several in a step beside requests without logprobs) give the same tokens and the
same logprobs within a tolerance, since the rows come from different backends; generated tokens' from the
top-k tail's candidates and row log-sum-exps (row_lse.comp, tested alone here too), no whole row read
back; prompt tokens' (prompt_logprobs) likewise, with each prompt token's logit gathered from the row before
it (row_gather.comp, tested alone here too). Needs a Vulkan device."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from test_model_cpu import rand_ids
from tiny_gguf import make_tiny_gguf, tiny_vocab
from vk_harness import open_device

from hmad.composition import load_model
from hmad.core.batch import BIAS_DTYPE, SeqSlice, StepBatch
from hmad.engine.kvcache import KVCacheManager
from hmad.engine.request import Request
from hmad.engine.sampling import SamplingParams
from hmad.engine.scheduler import Scheduler, SchedulerConfig

pytestmark = pytest.mark.gpu

# relative to the value: the backends' logits of the tiny model reach ~100 and differ in their last bits
TOL = 1e-4
CFG = SchedulerConfig(max_seqs=4, step_tokens=24, max_chunk=16, kv_tokens=1024, prefix_cache=False)
_ids = itertools.count()


@pytest.fixture(scope="module")
def scheds(tmp_path_factory):
    with open_device():  # or a skip that says why
        pass
    path = make_tiny_gguf(tmp_path_factory.mktemp("lp") / "tiny.gguf", seed=3)
    cpu = load_model(path, "cpu", numerics="f32")
    vk = load_model(path, "vulkan")
    yield Scheduler(cpu, CFG), Scheduler(vk, CFG), path
    vk.backend.close()


def _run(sched: Scheduler, prompts, params: list[SamplingParams]) -> list[tuple[list[int], list[dict]]]:
    """Each request's (token ids, logprobs entries), driving ``sched`` as the engine does."""
    out = {}
    for ids, p in zip(prompts, params, strict=True):
        p.validate()
        rid = next(_ids)
        sched.submit(Request(rid, list(ids), dataclasses.replace(p)))
        out[rid] = ([], [])
    while sched.has_work():
        for ev in sched.step():
            if ev.kind == "token":
                out[ev.request_id][0].extend(ev.token_ids)
                out[ev.request_id][1].extend(ev.logprobs or [])
    return list(out.values())


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(b))


def _lse64(rows: np.ndarray) -> np.ndarray:
    """Each row's log-sum-exp in float64, NaN as -inf; -inf for a row with no finite value."""
    x = np.where(np.isnan(rows), -np.inf, rows.astype(np.float64))
    m = x.max(axis=1, keepdims=True)
    safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return (safe + np.log(np.exp(x - safe).sum(axis=1, keepdims=True)))[:, 0]


# row_lse.comp alone: float32 exponentials summed in float32 per invocation, then merged; against float64
LSE_TOL = 1e-5  # relative to max(1, |lse|)


TINY_V = len(tiny_vocab()[0])


@pytest.mark.parametrize(
    ("vocab", "chunk"),
    [(TINY_V, TINY_V), (TINY_V, 256), (262_144, 262_144), (262_144, 4096), (262_144, 5000)],
)
def test_row_lse_equals_numpys_float64(dev, kernels, gpu, vocab, chunk):
    """row_lse.comp as the tails record it: one stage when ``chunk`` >= V, else each chunk's (max, sum) then
    each row's merged (row_lse_chunks_f32, row_lse_merge_f32; a last chunk shorter than the others). Random
    rows of the tiny model's vocabulary and of Gemma 3's, with -inf entries, a NaN, large and very negative
    values, one finite entry, and rows of only -inf or NaN (-inf out); rows ``stride`` apart with +1e30 in
    the gap (never read); the outputs and the chunks' buffers poisoned with NaN first."""
    from hmad.backends.vulkan.push import RowLsePush
    from hmad.backends.vulkan.recorder import CommandRecorder

    rng = np.random.default_rng(vocab)
    s, stride = 9, vocab + 5
    rows = (rng.standard_normal((s, vocab)) * 3).astype(np.float32)
    rows[1, rng.integers(0, vocab, vocab // 3)] = -np.inf  # a grammar's mask
    rows[2, rng.integers(0, vocab)] = np.nan  # counted as -inf
    rows[3] = rows[3] * 10 + 100  # Gemma's peaked rows: a few far above the rest
    rows[3, rng.integers(0, vocab, 3)] = 130.0
    rows[4] = rows[4] - 1e4  # every exp(x) underflows without the max subtracted
    rows[5] = -np.inf
    rows[5, vocab - 1] = 2.5  # one finite value, the last: lse is it
    rows[6] = -np.inf  # nothing allowed: -inf
    rows[7] = np.nan
    rows[8, : vocab // 2] = -np.inf  # the max late in the row, after a run of -inf
    padded = np.full((s, stride), 1e30, np.float32)
    padded[:, :vocab] = rows
    b_in = gpu.put(padded)
    b_out = gpu.poison(gpu.alloc(4 * s))
    n = -(-vocab // chunk)
    rec = CommandRecorder(dev).begin()
    if n == 1:
        k = kernels("row_lse_f32")
        rec.dispatch(k, [b_in, b_out], RowLsePush(s, vocab, stride, vocab), k.groups_for(s))
    else:
        first, merge = kernels("row_lse_chunks_f32"), kernels("row_lse_merge_f32")
        c_max, c_sum = gpu.poison(gpu.alloc(4 * s * n)), gpu.poison(gpu.alloc(4 * s * n))
        rec.dispatch(
            first, [b_in, c_max, c_sum], RowLsePush(s, vocab, stride, chunk), first.groups_for(s * n)
        )
        rec.dispatch(merge, [c_max, b_out, c_sum], RowLsePush(s, n, n, n), merge.groups_for(s))
    rec.end()
    rec.submit()
    rec.close()
    got, want = gpu.get(b_out).astype(np.float64), _lse64(rows)
    assert np.isneginf(got[6]) and np.isneginf(got[7]) and np.isneginf(want[[6, 7]]).all()
    assert got[5] == 2.5
    finite = [0, 1, 2, 3, 4, 5, 8]
    err = np.abs(got[finite] - want[finite]) / np.maximum(1.0, np.abs(want[finite]))
    assert (err <= LSE_TOL).all(), (err, got, want)


def _batch(sched: Scheduler, n: int) -> StepBatch:
    """One sequence of ``n`` random tokens from an empty cache (the scheduler's pools, idle between its
    runs), every row's logits wanted."""
    blocks = KVCacheManager(sched.layout).reserve(0, n)
    s = SeqSlice(0, 0, n, 0, blocks.global_table, blocks.local_table)
    ids = rand_ids(np.random.default_rng(4), n, sched.model.config.vocab_size)
    batch = StepBatch.build([(s, ids, True)], sched.layout.block_size)
    batch.logit_rows = np.arange(n, dtype=np.int32)
    return batch


def test_the_topk_tails_lse_is_of_the_adjusted_rows(scheds):
    """Backend.topk's log-sum-exps (candidates buffer poisoned first) are those of the step's whole rows,
    read back by the copy tail, plus its logit adjustments, in float64, within LSE_TOL; both parities."""
    _, sched, _ = scheds
    be = sched.model.backend
    batch = _batch(sched, 6)
    raw = sched.model.forward(batch)  # (6, V): the copy tail reads the rows as computed
    lift = [(r, t, raw[r].max() - raw[r, t] + d) for r, t, d in ((0, 3, 2.0), (2, 7, 1.0), (5, 1, 4.0))]
    batch.bias = np.array([*lift, (3, int(raw[3].argmax()), -30.0)], BIAS_DTYPE)  # each row's lse moves
    want = raw.astype(np.float64)
    want[batch.bias["row"], batch.bias["token"]] += batch.bias["delta"]
    be.topk(be.run(sched.model.net, batch))  # the candidates buffer exists from here on
    for _ in range(2):
        be.readback.topk_buf.array(np.uint32)[:] = 0x7FC00000  # NaN everywhere: ids, values and lse
        ids, _, lse = be.topk(be.run(sched.model.net, batch))
        assert lse.shape == (6,) and lse.dtype == np.float32
        assert np.allclose(lse, _lse64(want), rtol=LSE_TOL, atol=LSE_TOL)
        assert np.array_equal(ids[:, 0], want.argmax(axis=1))


def test_vulkan_logprobs_equal_numpys(scheds):
    cpu, vk, _ = scheds
    rng = np.random.default_rng(0)
    vocab = cpu.model.config.vocab_size
    prompts = [rand_ids(rng, n, vocab) for n in (5, 9, 3)]
    bias = {int(t): 100.0 for t in rng.integers(4, vocab, 3)}  # a real distribution (the model is peaked)
    params = [
        SamplingParams(temperature=0.0, max_tokens=5, logprobs=5, logit_bias=bias),
        SamplingParams(temperature=0.8, top_k=8, seed=7, max_tokens=5, logprobs=20, logit_bias=bias),
        SamplingParams(temperature=0.0, max_tokens=5),  # none asked, in the same steps
    ]
    be = vk.model.backend
    before = be.topk_steps, be.row_steps
    mine_all = _run(vk, prompts, params)
    assert be.topk_steps > before[0] and be.row_steps == before[1], "logprobs read whole rows back"
    _assert_equal(mine_all, _run(cpu, prompts, params))
    before = be.topk_steps, be.row_steps
    assert [len(e) for _, e in _run(vk, prompts[:1], params[:1])] == [5]  # alone: the same count
    assert be.topk_steps > before[0] and be.row_steps == before[1]


def _assert_equal(got, ref) -> None:
    """The same tokens, and logprobs and alternatives within TOL, the alternatives in the same order."""
    for mine, theirs in zip(got, ref, strict=True):
        assert mine[0] == theirs[0]
        assert len(mine[1]) == len(theirs[1])
        for a, b in zip(mine[1], theirs[1], strict=True):
            assert a["token_id"] == b["token_id"] and _close(a["logprob"], b["logprob"]), (a, b)
            assert [i for i, _, _ in a["top"]] == [i for i, _, _ in b["top"]]
            assert all(_close(x[1], y[1]) for x, y in zip(a["top"], b["top"], strict=True))


def test_logprobs_with_a_repetition_penalty_read_whole_rows(scheds):
    """The device's log-sum-exp is of the row before the repetition penalty: such a request's steps read
    whole rows, and still equal numpy's."""
    cpu, vk, _ = scheds
    rng = np.random.default_rng(6)
    vocab = cpu.model.config.vocab_size
    prompts = [rand_ids(rng, 6, vocab)]
    bias = {int(t): 100.0 for t in rng.integers(4, vocab, 3)}
    params = [
        SamplingParams(temperature=0.0, max_tokens=3, logprobs=3, repetition_penalty=1.5, logit_bias=bias)
    ]
    be = vk.model.backend
    before = be.topk_steps, be.row_steps
    got = _run(vk, prompts, params)
    assert be.topk_steps == before[0] and be.row_steps > before[1]
    _assert_equal(got, _run(cpu, prompts, params))


def test_vulkan_prompt_logprobs_over_chunks_equal_numpys_and_the_whole_pass(scheds):
    """A 40-token prompt in chunks of 16 beside another request: every prompt token's entry on both backends
    equals the log-softmax of one pass over the whole prompt (forward_full) at the position before it."""
    from hmad.engine.generate import forward_full

    cpu, vk, path = scheds
    rng = np.random.default_rng(2)
    vocab = cpu.model.config.vocab_size
    prompts = [rand_ids(rng, 40, vocab), rand_ids(rng, 7, vocab)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=3),
    ]
    got = {}
    for name, sched in (("vk", vk), ("cpu", cpu)):
        for p in params:
            p.validate()
        pairs = zip(prompts, params, strict=True)
        reqs = [Request(next(_ids), list(ids), dataclasses.replace(p)) for ids, p in pairs]
        for r in reqs:
            sched.submit(r)
        while sched.has_work():
            sched.step()
        got[name] = reqs[0].prompt_logprobs
        assert reqs[1].prompt_logprobs is None
    model = load_model(path, "cpu", numerics="f32")  # (forward_full makes its own KV pools)
    logits = forward_full(model, list(prompts[0])).astype(np.float64)
    ref = logits - logits.max(axis=1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(axis=1, keepdims=True))
    for name, entries in got.items():
        assert len(entries) == 40 and entries[0] is None, name
        for i, e in enumerate(entries[1:], start=1):
            assert e["token_id"] == prompts[0][i] and _close(e["logprob"], ref[i - 1, prompts[0][i]]), (
                name,
                i,
            )
            assert all(_close(lp, ref[i - 1, t]) for t, lp, _ in e["top"])


# -- prompt logprobs from the top-k tail: candidates, log-sum-exp and the prompt token's gathered logit ------


@pytest.mark.parametrize("vocab", [TINY_V, 262_144])
def test_row_gather_takes_each_rows_target(dev, kernels, gpu, vocab):
    """row_gather.comp alone: each row's logit of its target (the metadata word 1 + id at ``targets_off``;
    0: none) into an output poisoned with a finite value first, exactly; a row without a target, or with
    one outside the vocabulary, gets NaN; a NaN or -inf logit comes back as it is. Rows ``stride`` apart
    with +1e30 in the gap; more logit rows than targets given (the rest: none)."""
    from hmad.backends.vulkan.push import RowGatherPush
    from hmad.backends.vulkan.recorder import CommandRecorder

    rng = np.random.default_rng(vocab + 1)
    s, stride, off = 70, vocab + 3, 11  # 70 rows: more than one workgroup of 64
    rows = (rng.standard_normal((s, vocab)) * 3).astype(np.float32)
    padded = np.full((s, stride), 1e30, np.float32)
    padded[:, :vocab] = rows
    targets = rng.integers(0, vocab, s).astype(np.int64)
    targets[[0, 5]] = vocab - 1, 0  # the row's last and first columns
    rows[1, targets[1]] = padded[1, targets[1]] = np.nan
    rows[2, targets[2]] = padded[2, targets[2]] = -np.inf
    words = np.full(off + s + 4, 0xDEADBEEF, np.uint32)  # the other sections: never read
    words[off : off + s] = targets + 1
    words[off + 3] = 0  # no target
    words[off + 4] = vocab + 1  # id vocab: outside
    words[off + s - 6 : off + s] = 0  # the last rows: none given
    b_meta, b_in = gpu.put(words), gpu.put(padded)
    b_out = gpu.put(np.full(s, 7777.0, np.float32))
    k = kernels("row_gather_f32")
    rec = CommandRecorder(dev).begin()
    rec.dispatch(k, [b_meta, b_in, b_out], RowGatherPush(s, vocab, stride, off), k.groups_for(s))
    rec.end()
    rec.submit()
    rec.close()
    got = gpu.get(b_out)[:s]
    none = [3, 4, *range(s - 6, s)]
    assert np.isnan(got[none]).all()
    want = rows[np.arange(s), targets]
    some = np.setdiff1d(np.arange(s), none)
    assert np.array_equal(got[some], want[some], equal_nan=True)
    assert np.isnan(got[1]) and np.isneginf(got[2])


def test_the_topk_tail_gathers_each_rows_target_after_the_adjustments(scheds):
    """Backend.topk_targets after Backend.topk (the candidates buffer poisoned first): each logit row's
    logit of its ``batch.targets`` token, the step's adjustments added (one row's target is adjusted too),
    equal to the copy tail's row plus them; -1 rows NaN; both parities, and a step without targets."""
    from hmad.core.batch import add_bias

    _, sched, _ = scheds
    be = sched.model.backend
    batch = _batch(sched, 7)
    raw = sched.model.forward(batch)  # (7, V): the copy tail reads the rows as computed
    vocab = raw.shape[1]
    batch.targets = np.array([3, vocab - 1, -1, 0, 17, -1, 250], np.int32)
    batch.bias = np.array([(0, 3, 2.5), (4, 9, -1.0), (6, 250, 0.75)], BIAS_DTYPE)
    want = add_bias(raw, batch.bias)
    be.topk(be.run(sched.model.net, batch))  # the candidates buffer exists from here on
    for _ in range(2):
        be.readback.topk_buf.array(np.uint32)[:] = 0x44F2_2000  # 1937.0 everywhere
        x = be.run(sched.model.net, batch)
        ids, vals, lse = be.topk(x)
        got = be.topk_targets(x)
        assert got.shape == (7,) and got.dtype == np.float32
        has = batch.targets >= 0
        assert np.array_equal(got[has], want[has.nonzero()[0], batch.targets[has]])
        assert np.isnan(got[~has]).all()
        assert np.allclose(lse, _lse64(want), rtol=LSE_TOL, atol=LSE_TOL)
    batch.targets = None  # no targets: every row NaN (the section is zeros)
    x = be.run(sched.model.net, batch)
    be.topk(x)
    assert np.isnan(be.topk_targets(x)).all()


def _run_prompt(sched: Scheduler, prompts, params: list[SamplingParams]):
    """Each request's (token ids, logprobs entries, prompt logprobs entries), driving ``sched``."""
    out, reqs = {}, []
    for ids, p in zip(prompts, params, strict=True):
        p.validate()
        rid = next(_ids)
        sched.submit(Request(rid, list(ids), dataclasses.replace(p)))
        out[rid] = ([], [], None)
        reqs.append(rid)
    while sched.has_work():
        for ev in sched.step():
            if ev.kind == "token":
                out[ev.request_id][0].extend(ev.token_ids)
                out[ev.request_id][1].extend(ev.logprobs or [])
            elif ev.kind == "done":
                out[ev.request_id] = (*out[ev.request_id][:2], ev.prompt_logprobs)
            else:
                raise AssertionError(f"{ev.kind}: {ev.text}")
    return [out[r] for r in reqs]


LONG_CFG = SchedulerConfig(max_seqs=4, step_tokens=160, max_chunk=128, kv_tokens=1024, prefix_cache=False)


@pytest.fixture(scope="module")
def long_scheds(scheds):
    """Schedulers whose chunks reach PROMPT_ROWS_MAX (their own models: a scheduler sizes its KV pools)."""
    path = scheds[2]
    cpu = load_model(path, "cpu", numerics="f32")
    vk = load_model(path, "vulkan")
    yield Scheduler(cpu, LONG_CFG), Scheduler(vk, LONG_CFG)
    vk.backend.close()


@pytest.mark.parametrize("which", ["chunks_of_16", "chunks_of_64"])
def test_vulkan_prompt_logprobs_take_the_topk_path_and_equal_numpys(scheds, long_scheds, which):
    """Prompt logprobs (N 5 and 0, greedy and sampled, a logit_bias, generated logprobs too) of a 100-token
    prompt and a 20-token one, beside two requests without logprobs in the same steps: every step takes
    the top-k tail (no whole row read back), and the prompt entries, tokens and logprobs equal numpy's
    within TOL; chunks of 16 rows (step_tokens 24), or of PROMPT_ROWS_MAX (64 then 36)."""
    from hmad.engine.planning import PROMPT_ROWS_MAX

    cpu, vk = (scheds[0], scheds[1]) if which == "chunks_of_16" else long_scheds
    assert which == "chunks_of_16" or (vk.cfg.max_chunk > PROMPT_ROWS_MAX == 64)
    rng = np.random.default_rng(11)
    vocab = cpu.model.config.vocab_size
    prompts = [rand_ids(rng, n, vocab) for n in (100, 20, 9, 12)]
    bias = {int(t): 100.0 for t in rng.integers(4, vocab, 3)}  # a real distribution (the model is peaked)
    params = [
        SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=5, logprobs=3, logit_bias=bias),
        SamplingParams(temperature=0.8, top_k=8, seed=5, max_tokens=4, prompt_logprobs=0, logit_bias=bias),
        SamplingParams(temperature=0.0, max_tokens=6),  # none asked, in the same steps
        SamplingParams(temperature=0.7, top_k=16, seed=2, max_tokens=6),
    ]
    be, taker, rows = vk.model.backend, vk.tokens.sample_candidates, []

    def counted(reqs, ids, *rest):  # the most rows of the long prompt's in one step
        rows.append(max(r.step_rows for r in reqs))
        return taker(reqs, ids, *rest)

    before = be.topk_steps, be.row_steps
    vk.tokens.sample_candidates = counted
    try:
        got = _run_prompt(vk, prompts, params)
    finally:
        del vk.tokens.sample_candidates
    assert be.topk_steps > before[0] and be.row_steps == before[1], "prompt logprobs read whole rows back"
    assert max(rows) == (16 if which == "chunks_of_16" else PROMPT_ROWS_MAX)
    want = _run_prompt(cpu, prompts, params)
    _assert_equal([g[:2] for g in got], [w[:2] for w in want])
    for (_, _, mine), (_, _, theirs), ids, p in zip(got, want, prompts, params, strict=True):
        if p.prompt_logprobs is None:
            assert mine is None and theirs is None
            continue
        assert len(mine) == len(theirs) == len(ids) and mine[0] is None and theirs[0] is None
        assert [e["token_id"] for e in mine[1:]] == list(ids[1:])
        assert all(len(e["top"]) == p.prompt_logprobs for e in mine[1:])
        _assert_equal([(list(ids), mine[1:])], [(list(ids), theirs[1:])])
