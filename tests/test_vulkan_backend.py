"""VulkanBackend (backends/vulkan/backend.py): the whole recorded forward pass against the numpy reference.

Every comparison is with ``CpuBackend(numerics="f32")``: the shaders compute in float32 without ggml's
activation quantization, so plain float32 is the reference they should match. Needs a Vulkan device
(lavapipe in CI); skipped with the reason when there is none.

Tolerance for logits: max |vulkan − cpu| ≤ 1e-4 × max |cpu| over the compared rows with ``matvec="float"``
and with the default ``matvec="exact"`` (x as three int8 planes: at most max|x| · 2.4e-7 per value of a block
of 32, float32-class). Seen on lavapipe: ~5e-7 (float32 sums in another order in the matmuls, norms and the
online softmax; a random tiny model has no near-ties at this scale). With the one-plane int8 mat-vec
(``matvec="int8"``, opt-in), steps of up to 32 tokens quantize activations per 32 values (d = max/127):
≤ 1e-2 × max |cpu| (seen: ~2e-3); the same bound covers the cooperative-matrix mat-mat (float16 x and W, on
devices that have it; not lavapipe), which "mixed-int8", "mixed-exact" and "f32" use where the device has it
and "mixed-float" turns off. Greedy token ids must be identical either way.
The 270M test uses numerics "f32" for the same reason (the GPU does not round activations like ggml): the
two backends then differ only by float32 summation order, far below the fixture prompts' top-2 margins.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_model_cpu import rand_ids, run_chunks
from tiny_gguf import MIXED, make_tiny_gguf

from hmad.composition import load_model, make_backend
from hmad.core.errors import ModelFormatError
from hmad.engine import tokens as scheduler_module  # draw_rows, as the scheduler calls it
from hmad.engine.draw_rows import draw_rows
from hmad.engine.generate import forward_full, generate
from hmad.engine.sampling import SamplingParams
from hmad.engine.scheduler import Scheduler, SchedulerConfig

pytestmark = pytest.mark.gpu
RTOL, RTOL_INT8 = 1e-4, 1e-2


@pytest.fixture(scope="module", autouse=True)
def vulkan_device():
    try:
        from hmad.backends.vulkan import device as vkdev

        with vkdev.Device():
            pass
    except Exception as e:  # no loader, no driver, unsuitable device
        pytest.skip(f"no usable Vulkan device ({e}); apt-get install mesa-vulkan-drivers provides lavapipe")


@pytest.fixture(scope="module", params=["mixed-int8", "mixed-float", "mixed-exact", "f32"])
def pair(request, tmp_path_factory):
    """(cpu model, vulkan model) of one tiny random GGUF."""
    types = MIXED if request.param.startswith("mixed") else None
    path = make_tiny_gguf(tmp_path_factory.mktemp("vk") / f"{request.param}.gguf", seed=3, types=types)
    cpu = load_model(path, "cpu", numerics="f32")
    if request.param == "mixed-float":  # the float32 path throughout (no float16 cooperative matrices)
        vk = load_model(path, "vulkan", matvec="float", coopmat="off")
    elif request.param == "mixed-int8":
        vk = load_model(path, "vulkan", matvec="int8")
    else:  # the defaults: the exact mat-vec, coopmat where the device has it
        vk = load_model(path, "vulkan")
    yield cpu, vk
    vk.backend.close()


def close(got: np.ndarray, want: np.ndarray, rtol: float = RTOL) -> None:
    assert got.shape == want.shape
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= rtol, f"max error {err:.2e} of the logit scale"


def rtol_for(vk) -> float:
    """RTOL_INT8 when the backend runs decode-sized steps on the one-plane int8 mat-vec or has float16
    cooperative matrices, else RTOL."""
    return RTOL_INT8 if vk.backend.matvec == "int8" or vk.backend.coopmat else RTOL


def test_one_prefill_matches_cpu(pair):
    cpu, vk = pair
    ids = rand_ids(np.random.default_rng(0), 21, cpu.config.vocab_size)
    close(forward_full(vk, ids), forward_full(cpu, ids), rtol_for(vk))


def test_batched_chunked_prefill_then_decode_matches_cpu(pair):
    """Three sequences of different lengths, 5-token chunks (so later chunks read the cache; the sliding
    window of 8 wraps the local ring), every row's logits compared."""
    cpu, vk = pair
    rng = np.random.default_rng(1)
    seqs = [rand_ids(rng, n, cpu.config.vocab_size) for n in (17, 4, 11)]
    for got, want in zip(run_chunks(vk, seqs, 5), run_chunks(cpu, seqs, 5), strict=True):
        close(got, want, rtol_for(vk))


def test_prefill_tiles_in_batched_chunks_match_cpu(pair):
    """Chunks of 40 tokens: steps of 83, 50 and 10 rows (buckets 128, 64, 16). In the first two
    attention_prefill takes the chunks of 40 (tiles of 32 + 8 rows) and 10 rows, the per-row kernel the
    3-token prompt; the last step is all per-row. Later chunks read the cache through the wrapped local
    ring; every row's logits compared."""
    cpu, vk = pair
    rng = np.random.default_rng(3)
    seqs = [rand_ids(rng, n, cpu.config.vocab_size) for n in (90, 3, 50)]
    for got, want in zip(run_chunks(vk, seqs, 40), run_chunks(cpu, seqs, 40), strict=True):
        close(got, want, rtol_for(vk))
    assert any(t >= 64 for t, _ in vk.backend.graphs)


def test_greedy_generation_equals_cpu(pair):
    cpu, vk = pair
    rng = np.random.default_rng(2)
    prompts = [rand_ids(rng, n, cpu.config.vocab_size) for n in (3, 9, 14)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    want = [r.token_ids for r in generate(cpu, prompts, greedy)]
    assert [r.token_ids for r in generate(vk, prompts, greedy)] == want  # argmax on the GPU
    # a repetition penalty: greedy over the penalized on-device top-k candidates
    pen = SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3)
    assert [r.token_ids for r in generate(vk, prompts, pen)] == [
        r.token_ids for r in generate(cpu, prompts, pen)
    ]


def test_sampling_from_device_candidates_equals_whole_rows(pair):
    """Sampled requests (seeded; top-k, top-p, min-p, penalty) take their tokens from topk.comp's
    candidates (drawn on the host, or on the GPU and checked by the host in pipelined steps): the same
    tokens as the same model sampling from whole logits rows read back."""
    _, vk = pair
    rng = np.random.default_rng(4)
    prompts = [rand_ids(rng, n, vk.config.vocab_size) for n in (5, 12, 2)]
    kinds = [
        dict(temperature=0.9, top_k=40, top_p=0.95, seed=11),
        dict(temperature=1.5, top_k=64, min_p=0.05, repetition_penalty=1.2, seed=12),
        dict(temperature=0.7, top_k=3, seed=13),
    ]
    be = vk.backend
    for kw in kinds:
        params = SamplingParams(max_tokens=12, **kw)
        before = be.topk_steps + be.sampled_steps
        got = [r.token_ids for r in generate(vk, prompts, params)]
        assert be.topk_steps + be.sampled_steps > before, "the on-device top-k path was not taken"
        be.topk_max = 0  # the whole-row path
        try:
            want = [r.token_ids for r in generate(vk, prompts, params)]
        finally:
            del be.topk_max
        assert got == want, kw


def test_fused_decode_kernels_at_one_token(pair):
    """Decode at batch 1 runs the fused kernels (``fuse``, the default): norm_rope_kv (q/k norms, RoPE and
    the cache write in one dispatch) and, on the int8 path where gate and up share a type (one mat-vec for
    both), the down projection's int8 input from the GeGLU's last workgroups. One sequence fed a token a
    step: every step's logits equal the CPU's, and those of the separate kernels (fuse=False) bit for bit
    (the same arithmetic), and the fused recording has fewer barriers."""
    cpu, vk = pair
    be = vk.backend
    seq = [rand_ids(np.random.default_rng(9), 12, cpu.config.vocab_size)]
    fused = run_chunks(vk, seq, 1)[0]
    rec = be.graphs[(1, 1)].rec
    labels, barriers = list(rec.labels), rec.barriers
    be.set_options(replace(be.options, fuse=False))
    try:
        plain = run_chunks(vk, seq, 1)[0]
        plain_barriers = be.graphs[(1, 1)].rec.barriers
    finally:
        be.set_options(replace(be.options, fuse=True))
    close(fused, run_chunks(cpu, seq, 1)[0], rtol_for(vk))
    np.testing.assert_array_equal(fused, plain)
    int8 = [lab for lab in labels if lab.startswith(("mul_mat_vec_x3_", "mul_mat_vec_q8x_"))]
    want = ["norm_rope_kv_f32"] + (["_t1_qo"] if any("_geglu" in lab for lab in int8) else [])
    assert all(any(w in lab for lab in labels) for w in want), (want, sorted(set(labels)))
    gone = ("kv_write", "norm_rope_f32") + (("quantize",) if "_t1_qo" in want else ())
    assert not any(lab.startswith(gone) for lab in labels), sorted(set(labels))
    assert barriers < plain_barriers


def test_ffn_geglu_into_the_down_gemm_operand(tmp_path):
    """Prefill chunks over 32 tokens on the cooperative-matrix GEMM (GPU only: lavapipe has none), gate and
    up of one type (Q4_K, as in Gemma 3's files): the FFN's GeGLU goes straight into the down GEMM's float16
    operand (geglu_row_scale, ``geglu_xh``), with the same logits bit for bit as split_reduce_geglu then
    row_scale (geglu_xh=0), a row_scale fewer a layer, and the CPU's logits within the float16 tolerance."""
    from gguf import GGMLQuantizationType as Q

    path = make_tiny_gguf(
        tmp_path / "q4k-ffn.gguf", seed=5, types={**MIXED, "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K}
    )
    vk = load_model(path, "vulkan")
    be = vk.backend
    try:
        if not be.coopmat:
            pytest.skip(f"{be.dev.info.name}: no cooperative-matrix GEMM")
        seq = [rand_ids(np.random.default_rng(11), 80, vk.config.vocab_size)]
        runs = {}
        for on in (True, False):
            be.set_options(replace(be.options, geglu_xh=1 if on else 0))  # any step, or none
            logits = run_chunks(vk, seq, 40)[0]
            runs[on] = (logits, [lab for g in be.graphs.values() for lab in g.rec.labels])
    finally:
        be.close()
    (fused, on), (plain, off) = runs[True], runs[False]
    assert "geglu_row_scale" in on and "geglu_row_scale" not in off
    assert on.count("row_scale") < off.count("row_scale")
    np.testing.assert_array_equal(fused, plain)
    close(fused, run_chunks(load_model(path, "cpu", numerics="f32"), seq, 40)[0], RTOL_INT8)


def test_split_sums_added_by_their_readers(tmp_path):
    """The projections' K-split partial sums go unsummed into the op that reads them (``split_sums`` in
    ``fuse``): q, k and v into norm_rope_kv, o and down into residual_norm; on the cooperative-matrix GEMM
    (40-token prefill chunks) and the int8 one (6-token decode steps; GPU only: lavapipe has neither). The
    same logits bit for bit as split_reduce then those ops, with fewer split_reduce dispatches; the CPU's
    prefill logits within the float16 tolerance."""
    from gguf import GGMLQuantizationType as Q

    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    path = make_tiny_gguf(tmp_path / "q4k-proj.gguf", seed=6, types={**MIXED, **dict.fromkeys(kinds, Q.Q4_K)})
    vk = load_model(path, "vulkan")
    be = vk.backend
    try:
        if not (be.coopmat and be.mmq_k):
            pytest.skip(f"{be.dev.info.name}: no cooperative-matrix GEMMs")
        be.set_options(replace(be.options, mmq_min_weights=0))  # the tiny weights on the int8 GEMM too
        seq = [rand_ids(np.random.default_rng(12), 80, vk.config.vocab_size)]
        runs = {}
        for fuse in (True, "norm_rope_kv+qout"):
            be.set_options(replace(be.options, fuse=fuse))
            logits, labels = [], []
            for ids, chunk in ((seq, 40), ([seq[0][:24]], 6)):  # (a new KV layout per chunk: graphs dropped)
                logits.append(run_chunks(vk, ids, chunk)[0])
                labels += [lab for g in be.graphs.values() for lab in g.rec.labels]
            runs[fuse is True] = logits, labels
    finally:
        be.close()
    (fused, on), (plain, off) = runs[True], runs[False]
    assert any(lab.startswith("mul_mmq") for lab in on) and any(
        lab.startswith("mul_mm_coopmat") for lab in on
    )
    assert off.count("split_reduce") > 0 and on.count("split_reduce") < off.count("split_reduce")
    for one, other in zip(fused, plain, strict=True):
        np.testing.assert_array_equal(one, other)
    close(fused[0], run_chunks(load_model(path, "cpu", numerics="f32"), seq, 40)[0], RTOL_INT8)


def test_weight_prefetch_adds_no_barrier(pair):
    """``prefetch_bytes`` (auto: on discrete GPUs; forced here on lavapipe): at decode sizes each matmul's
    weights are read ahead beside the op before it (prefetch_vec4), in the same barrier interval, so a step
    has exactly the barriers it had without them, and the same logits bit for bit; none in prefill
    buckets."""
    cpu, vk = pair
    be = vk.backend
    seq = [rand_ids(np.random.default_rng(10), 9, cpu.config.vocab_size)]
    keep = be.prefetch_bytes
    runs = {}
    try:
        for nbytes in (0, 64 << 10):
            be.set_options(replace(be.options, prefetch_bytes=nbytes))
            decode = run_chunks(vk, seq, 1)[0]  # (a new KV layout per chunk size: its recordings dropped)
            one = be.graphs[(1, 1)].rec
            runs[nbytes] = (decode, list(one.labels), one.barriers, run_chunks(vk, seq, 9)[0])
            runs[nbytes] += (list(be.graphs[(16, 16)].rec.labels),)
    finally:
        be.set_options(replace(be.options, prefetch_bytes=keep))
    (d0, labels0, barriers0, p0, _), (d1, labels1, barriers1, p1, nine) = runs[0], runs[64 << 10]
    np.testing.assert_array_equal(d0, d1)
    np.testing.assert_array_equal(p0, p1)
    assert labels1.count("prefetch_vec4") >= 3 * vk.config.n_layers - 1 and barriers1 == barriers0
    assert "prefetch_vec4" not in labels0 + nine


def test_one_recording_per_bucket_replayed(pair):
    """A 6-token prompt then 11 decode steps: buckets (8, 1) and (1, 1), each recorded once, replayed."""
    _, vk = pair
    be = vk.backend
    prompt = rand_ids(np.random.default_rng(4), 6, vk.config.vocab_size)
    first = None
    # a new Scheduler of the same configuration keeps the KV pools and the recordings; another one
    # (max_tokens 40: a bigger KV layout) re-plans the pools, so the buckets are recorded again
    for max_tokens, new_recordings in ((12, 2), (12, 0), (40, 2)):
        rec0, steps0 = be.recordings, be.steps
        res = generate(vk, [prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
        assert len(res.token_ids) == max_tokens and be.steps - steps0 == max_tokens
        assert be.recordings - rec0 == new_recordings
        assert sorted(be.graphs) == [(1, 1), (8, 1)]
        first = first or res.token_ids
        assert res.token_ids[:12] == first  # stale cache contents from the run before change nothing


def test_prepared_buckets_serve_every_step_without_recording(pair):
    """Scheduler.prepare() (the daemon, before READY) records one graph per token bucket the configuration
    reaches, with the scheduler's sequences' logit rows; the steps after it record nothing and give the
    tokens a backend that records on first use gives."""
    cpu, vk = pair
    be = vk.backend
    rng = np.random.default_rng(8)
    prompts = [rand_ids(rng, n, cpu.config.vocab_size) for n in (3, 21, 7, 40)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    cfg = SchedulerConfig(max_seqs=4, step_tokens=64, max_chunk=32, kv_tokens=256)
    want = [r.token_ids for r in generate(cpu, prompts, greedy, cfg)]
    sched = Scheduler(vk, cfg)
    sched.prepare()
    try:
        assert sorted(be.graphs) == [(1, 1), (2, 2), (4, 4), (8, 4), (16, 4), (32, 4), (64, 4)]
        rec0 = be.recordings
        assert [r.token_ids for r in generate(vk, prompts, greedy, cfg)] == want
        assert be.recordings == rec0, "a step recorded after prepare()"
    finally:
        be.recorded.logit_rows_b = 1  # the other tests' buckets as before
        be.recorded.drop()


def test_kv_pools_made_again_and_again_still_equal_cpu(pair):
    """Scheduler configurations in turn: each change closes the KV pools and makes new ones, and drivers
    give new buffers the closed ones' VkBuffer handles. The recordings must bind the new pools; descriptor
    sets once cached under the handle bound the freed memory (257 times in 17 rounds of
    bench/stress_vulkan_engine.py on an H200, the likely cause of a step whose fence was never signalled)."""
    cpu, vk = pair
    rng = np.random.default_rng(6)
    prompts = [rand_ids(rng, n, cpu.config.vocab_size) for n in (5, 13)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    want = [r.token_ids for r in generate(cpu, prompts, greedy)]
    be = vk.backend
    for kv_tokens in (64, 96, 64, 96, 128, 64):
        cfg = SchedulerConfig(max_seqs=2, kv_tokens=kv_tokens)
        assert [r.token_ids for r in generate(vk, prompts, greedy, cfg)] == want, kv_tokens
    cached = [a for k in be.ctx.kernels.values() for _, arenas in k._sets.values() for a in arenas]
    assert cached and not any(a.closed for a in cached)


def _run_pipelined(vk, prompts, params, cfg, cancel_at=None):
    """Drive a Scheduler (``cfg``: a config, or the scheduler itself) by hand, as the engine thread does;
    ``cancel_at``: (step, request id) to cancel then. Returns ({id: (token ids, text, terminal kinds, finish
    reason)}, steps launched fed)."""
    from hmad.engine.request import Request

    sched, out = (cfg if isinstance(cfg, Scheduler) else Scheduler(vk, cfg)), {}
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        sched.submit(Request(i, list(ids), p))
        out[i] = ([], "", [], "")
    n = 0
    while sched.has_work():
        n += 1
        if cancel_at and n == cancel_at[0]:
            assert sched.flight is not None and cancel_at[1] in {r.id for r in sched.flight.wanting}
            sched.cancel(cancel_at[1])
        for ev in sched.step():
            toks, text, ends, why = out[ev.request_id]
            if ev.kind == "token":
                out[ev.request_id] = (toks + ev.token_ids, text + ev.text, ends, why)
            else:
                out[ev.request_id] = (toks, text, [*ends, ev.kind], ev.finish_reason or why)
    return out, sched.pipelined_steps


def test_pipelined_steps_give_the_tokens_of_steps_run_one_by_one(pair):
    """engine.pipeline: each step is launched before the ids of the one before are read, its decode rows'
    tokens fed on the GPU from that step's argmax (the host writes 0 there). Prompts of several chunks,
    max_tokens from 1, a stop string that ends one request early (its extra row is dropped): the same
    tokens, text and finish reasons as the same steps run one by one, one terminal event each."""
    _, vk = pair
    be = vk.backend
    rng = np.random.default_rng(21)
    prompts = [rand_ids(rng, n, vk.config.vocab_size) for n in (5, 40, 2, 17)]
    cfg = dict(max_seqs=3, step_tokens=24, max_chunk=16, kv_tokens=512)
    plain = [SamplingParams(temperature=0.0, max_tokens=m) for m in (14, 9, 1, 20)]
    want, fed = _run_pipelined(vk, prompts, plain, SchedulerConfig(pipeline=False, **cfg))
    assert fed == 0
    steps0 = be.steps
    got, fed = _run_pipelined(vk, prompts, plain, SchedulerConfig(**cfg))
    assert got == want and fed > 10 and be.steps > steps0
    assert all(ends == ["done"] for _, _, ends, _ in got.values())
    assert any(t != 0 for toks, *_ in got.values() for t in toks[1:])  # a fed token the placeholder is not
    # a stop string from the middle of request 0's text: it ends there, with one row too many computed
    text0 = want[0][1]
    assert len(text0) > 4
    stop = [SamplingParams(temperature=0.0, max_tokens=14, stop=[text0[len(text0) // 2 :][:3]]), *plain[1:]]
    want, _ = _run_pipelined(vk, prompts, stop, SchedulerConfig(pipeline=False, **cfg))
    got, fed = _run_pipelined(vk, prompts, stop, SchedulerConfig(**cfg))
    assert got == want and fed > 10 and want[0][3] == "stop" and len(want[0][0]) < 14


def _sampled_params(max_tokens):
    """Greedy and sampling requests together, seeded; hot, as the tiny model's top logit is ~90 above the
    rest (at Gemma's temperature 1 every draw would be its argmax)."""
    kinds = [
        dict(temperature=50.0, top_k=64, top_p=0.95),
        dict(temperature=0.0),
        dict(temperature=30.0, top_k=5, min_p=0.1),
        dict(temperature=80.0, top_k=128, top_p=0.5),
    ]
    return [SamplingParams(max_tokens=m, seed=100 + i, **kinds[i % 4]) for i, m in enumerate(max_tokens)]


def test_pipelined_sampling_gives_the_tokens_of_steps_run_one_by_one(pair, monkeypatch):
    """Sampling requests pipeline too (launch_sampled: each token drawn on the GPU from its top-k candidates
    with the uniform its sampler will use, fed into the next step): the same tokens, text and finish reasons
    as the steps run one by one (sampled on the host), alone or beside others. Steps of three rows or more
    draw them on the host together (engine/draw_rows.py); alone, one by one."""
    _, vk = pair
    together = []

    def counted(samplers, ids, vals):
        got = draw_rows(samplers, ids, vals)
        together.append(sum(t is not None for t in got))
        return got

    monkeypatch.setattr(scheduler_module, "draw_rows", counted)
    rng = np.random.default_rng(31)
    prompts = [rand_ids(rng, n, vk.config.vocab_size) for n in (5, 30, 3, 12, 8)]
    cfg = dict(max_seqs=4, step_tokens=24, max_chunk=16, kv_tokens=512)
    params = _sampled_params([14, 9, 20, 1, 16])
    want, fed = _run_pipelined(vk, prompts, params, SchedulerConfig(pipeline=False, **cfg))
    assert fed == 0
    got, fed = _run_pipelined(vk, prompts, params, SchedulerConfig(**cfg))
    assert got == want and fed > 10
    assert all(ends == ["done"] for _, _, ends, _ in got.values())
    assert len({t for i in (0, 2, 4) for t in got[i][0]}) > 10  # the draws drew more than the argmax
    assert sum(together) > 20
    together.clear()
    alone, _ = _run_pipelined(vk, prompts[2:3], params[2:3], SchedulerConfig(**cfg))
    assert not together
    assert alone[0] == want[2]


def test_pipelined_sampling_at_the_edges_of_its_settings(pair):
    """Fresh random settings at the edges of their ranges (temperature 1e-6 to 100, top_k 1 / 128 / 129 /
    0 (off), top_p near 0, min_p 1, repetition penalty on some: those take host logits and stop the
    pipeline while they run): every request ends once, with the tokens it gets with the pipeline off."""
    _, vk = pair
    rng = np.random.default_rng()
    prompts = [rand_ids(rng, int(rng.integers(1, 20)), vk.config.vocab_size) for _ in range(6)]
    params = [
        SamplingParams(
            max_tokens=int(rng.integers(1, 10)),
            seed=int(rng.integers(2**63)),
            temperature=float(rng.choice([0.0, 1e-6, 1.0, 60.0, 100.0])),
            top_k=int(rng.choice([1, 2, 64, 128, 129, 0])),
            top_p=float(rng.choice([1.0, 1e-9, 0.5, 0.999])),
            min_p=float(rng.choice([0.0, 1.0, 0.5])),
            repetition_penalty=float(rng.choice([1.0, 1.0, 1.0, 1.3])),
        )
        for _ in prompts
    ]
    cfg = dict(max_seqs=4, kv_tokens=512, step_tokens=16, max_chunk=8)
    want, _ = _run_pipelined(vk, prompts, params, SchedulerConfig(pipeline=False, **cfg))
    got, _ = _run_pipelined(vk, prompts, params, SchedulerConfig(**cfg))
    assert got == want, params
    assert all(len(ends) == 1 and ends[0] == "done" for _, _, ends, _ in got.values())


def test_a_device_draw_the_host_rejects_is_computed_again(pair, monkeypatch):
    """Where the GPU's draw differs from the host's (here forced: half the rows get another uniform), the
    host's token is the request's, the row the GPU's token fed is dropped and its position computed again:
    the same tokens as without pipelining, every correction counted."""
    _, vk = pair
    rng = np.random.default_rng(32)
    prompts = [rand_ids(rng, n, vk.config.vocab_size) for n in (6, 9, 4)]
    # hot enough that the tiny model (top logit ~90 above the rest) draws other tokens: other uniforms matter
    params = [SamplingParams(temperature=60.0, top_k=64, max_tokens=12, seed=7 + i) for i in range(3)]
    cfg = dict(max_seqs=3, kv_tokens=512)
    want, _ = _run_pipelined(vk, prompts, params, SchedulerConfig(pipeline=False, **cfg))
    real = Scheduler._device_sampling

    def skewed(wanting, fed):
        out = real(wanting, fed)
        out["u"][::2] = (out["u"][::2] + 0.5) % 1.0
        return out

    monkeypatch.setattr(Scheduler, "_device_sampling", staticmethod(skewed))
    sched = Scheduler(vk, SchedulerConfig(**cfg))
    got, fed = _run_pipelined(vk, prompts, params, sched)
    assert got == want and fed > 5 and sched.draws_corrected > 3


def test_cancel_while_a_pipelined_step_is_in_flight(pair):
    """A request cancelled while a launched step holds its row: one ``cancelled`` event, its row's token
    dropped, its blocks freed; the others' tokens as without the cancel."""
    _, vk = pair
    rng = np.random.default_rng(22)
    prompts = [rand_ids(rng, n, vk.config.vocab_size) for n in (6, 11, 3)]
    params = [SamplingParams(temperature=0.0, max_tokens=12) for _ in prompts]
    cfg = SchedulerConfig(max_seqs=3, kv_tokens=256, prefix_cache=False)
    want, _ = _run_pipelined(vk, prompts, params, cfg)
    got, fed = _run_pipelined(vk, prompts, params, cfg, cancel_at=(5, 1))
    assert fed > 5 and got[1][2] == ["cancelled"] and 0 < len(got[1][0]) < 12
    assert got[1][0] == want[1][0][: len(got[1][0])]
    assert got[0] == want[0] and got[2] == want[2]


@pytest.mark.parametrize("where", ["launch", "collect"])
def test_a_failed_pipelined_step_fails_its_requests_only(pair, where, monkeypatch):
    """A step that raises while another is in flight (building or submitting it: ``backend.run``; reading
    it back: ``backend.collect``): the requests in it end with one ``error`` each (a row of theirs in the
    other step is dropped), the one waiting for a slot runs after them to its end, with the tokens it gets
    alone; the next steps pipeline again."""
    _, vk = pair
    be = vk.backend
    rng = np.random.default_rng(24)
    prompts = [rand_ids(rng, n, vk.config.vocab_size) for n in (4, 7, 5)]
    params = [SamplingParams(temperature=0.0, max_tokens=10) for _ in prompts]
    cfg = SchedulerConfig(max_seqs=2, kv_tokens=256)
    alone, _ = _run_pipelined(vk, prompts[2:], params[2:], cfg)
    name = "run" if where == "launch" else "collect"
    real, calls = getattr(be, name), []

    def failing(*a):  # the 5th call: a step's building fails, or its read-back after it ran
        calls.append(1)
        out = real(*a) if where == "collect" else None
        if len(calls) == 5:
            raise RuntimeError(f"injected: {name} failed")
        return real(*a) if where == "launch" else out

    monkeypatch.setattr(be, name, failing)
    got, fed = _run_pipelined(vk, prompts, params, cfg)
    monkeypatch.undo()
    assert got[0][2] == ["error"] and got[1][2] == ["error"] and 0 < len(got[0][0]) < 10
    assert got[2][2] == ["done"] and got[2][0] == alone[0][0] and fed > 8


def test_every_step_copies_its_metadata_into_device_memory(pair):
    """The kernels read the metadata from one device-local buffer; each step's head copies its parity's
    mapped buffer there (and runs feed_tokens when the batch has fed rows)."""
    _, vk = pair
    be = vk.backend
    generate(vk, [[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))
    ctx = be.ctx
    assert ctx.meta_gpu is not None and all(ctx.meta_gpu is not m for m in ctx.metas) and len(ctx.metas) == 2
    heads = [h for g in be.graphs.values() for h in g.heads.values()]
    assert heads and all(h.labels[0] == "step metadata to VRAM" for h in heads)
    assert any(h.labels[-1] == "feed_tokens" for h in heads)


def test_weights_forced_into_the_host_heap(tmp_path):
    path = make_tiny_gguf(tmp_path / "m.gguf", seed=5, types=MIXED)
    cpu = load_model(path, "cpu", numerics="f32")
    vk = load_model(path, "vulkan", device_local_bytes=0)
    try:
        pools = vk.backend.weights_plan.report()["pools"]
        assert pools["device"]["bytes"] == 0 and pools["host"]["tensors"] == len(cpu.net.layers) * 13 + 2
        mem = vk.backend.describe()["memory"]
        assert any("host-visible: weights" in k for k in mem) and not any(
            "device-local: weights" in k for k in mem
        )
        ids = rand_ids(np.random.default_rng(6), 9, cpu.config.vocab_size)
        close(forward_full(vk, ids), forward_full(cpu, ids), rtol_for(vk))
    finally:
        vk.backend.close()


@pytest.mark.parametrize(
    "heads", [dict(head_dim=512), dict(head_dim=66), dict(n_heads=18, n_kv_heads=2)], ids=["512", "66", "g9"]
)
def test_heads_the_attention_cannot_take_refuse_the_model_at_load(tmp_path, heads):
    """Heads the attention kernels cannot take (over 256 values, not whole vec4s, over 8 query heads per KV
    head) are a ModelFormatError naming the file and the limit, before any weight is uploaded; not a failure
    inside every request's step."""
    path = make_tiny_gguf(tmp_path / "big-heads.gguf", seed=7, n_layers=2, **heads)
    with pytest.raises(ModelFormatError) as e:
        load_model(path, "vulkan")
    assert str(path) in str(e.value) and "at most 256 values" in str(e.value)
    backend = make_backend("vulkan")  # the caller's own backend: refused the same way, nothing planned on it
    try:
        with pytest.raises(ModelFormatError):
            load_model(path, backend)
        assert backend.weights_plan is None and backend.kv_layout is None
    finally:
        backend.close()
    cpu = load_model(path, "cpu", numerics="f32")  # the same file serves on the cpu backend
    assert forward_full(cpu, [2, 5, 9]).shape == (3, cpu.config.vocab_size)


def test_heads_at_the_attention_limits_match_cpu(tmp_path):
    """Heads of 256 values, 8 query heads per KV head: the largest the attention kernels take."""
    path = make_tiny_gguf(tmp_path / "edge.gguf", seed=8, n_layers=2, n_heads=8, n_kv_heads=1, head_dim=256)
    cpu = load_model(path, "cpu", numerics="f32")
    vk = load_model(path, "vulkan")
    try:
        ids = rand_ids(np.random.default_rng(8), 40, cpu.config.vocab_size)
        close(forward_full(vk, ids), forward_full(cpu, ids), rtol_for(vk))
    finally:
        vk.backend.close()


def test_status_shows_device_and_placement(pair):
    _, vk = pair
    d = vk.backend.describe()
    assert d["backend"] == "vulkan" and d["device"]
    assert any(k.startswith("heap ") and "weights" in k for k in d["memory"])
    assert any("KV cache" in k for k in d["memory"])


@pytest.fixture(scope="module")
def embedded_pair(embedded_model_path):
    cpu = load_model(embedded_model_path, "cpu", numerics="f32")
    vk = load_model(embedded_model_path, "vulkan")
    yield cpu, vk
    vk.backend.close()


NEAR_TIE = 0.05  # logits: a divergence is accepted only where the CPU's top two are closer than this
GREEDY_CASES = json.loads((Path(__file__).parent / "fixtures" / "llamacpp_greedy.json").read_text())["cases"]
# prompts batched together: 6 rows fill decode bucket 8, whose steps on lavapipe cost about what bucket 4's do
# (the int8 mat-vec decodes each weight once for up to 8 rows), so two groups cost two thirds of three; 12
# would pad to 16 rows, past the mat-vec, onto the mat-mat
GREEDY_GROUP = 6


def _tally(folder: Path, key: str, items: list) -> list[tuple]:
    """Write ``items`` under ``key`` in ``folder`` (whole, by a rename), then read back every key's items
    written so far: of tests that all write before they read, the last to read sees them all."""
    folder.mkdir(exist_ok=True)
    part = folder / f"{key}.json.{os.getpid()}"
    part.write_text(json.dumps(items))
    part.replace(folder / f"{key}.json")
    return [tuple(x) for f in sorted(folder.glob("*.json")) for x in json.loads(f.read_text())]


@pytest.mark.slow
@pytest.mark.timeout(2400)  # lavapipe on CI's 2 cores: minutes
# the batch holding the 968-token prompt (the last) first: it takes the longest
@pytest.mark.parametrize("first", reversed(range(0, len(GREEDY_CASES), GREEDY_GROUP)))
def test_embedded_model_greedy_equals_cpu(embedded_pair, run_shared_dir, first):
    """The fidelity prompts (tests/fixtures/llamacpp_greedy.json, all 12, one of 968 tokens) in batches of
    GREEDY_GROUP (the groups run on parallel workers), 32 greedy tokens each on both backends: in CI on
    lavapipe (float32 tiled prefill), on a GPU through the device tool with HMAD_TEST_MODEL
    (cooperative-matrix prefill, subgroup attention). Identical ids, except that at most one prompt of the
    12 may diverge, and only where the CPU's top two logits were within NEAR_TIE at the diverging step (the
    margin is computed and printed). Each group writes its divergences to a folder the run shares and checks
    the count over every group written so far, so the group that finishes last checks all 12."""
    cpu, vk = embedded_pair
    idx = list(range(first, min(first + GREEDY_GROUP, len(GREEDY_CASES))))
    prompts = [GREEDY_CASES[i]["prompt_ids"] for i in idx]
    n_new = 32
    greedy = SamplingParams(temperature=0.0, max_tokens=n_new, stop=[])
    want = [r.token_ids for r in generate(cpu, prompts, greedy)]
    got = [r.token_ids for r in generate(vk, prompts, greedy)]
    diverged = []
    for i, p, g, w in zip(idx, prompts, got, want, strict=True):
        if g == w:
            continue
        n = next((j for j, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w)))
        row = forward_full(cpu, p + w[:n])[-1]
        top2 = np.sort(row)[-2:]
        margin = float(top2[1] - top2[0])
        print(
            f"prompt {i} diverges at token {n}: cpu {w[n : n + 1]} vulkan {g[n : n + 1]}, margin {margin:.4f}"
        )
        diverged.append((i, n, margin))
    print(f"{len(idx) - len(diverged)} of prompts {idx} identical over {n_new} greedy tokens")
    seen = _tally(run_shared_dir / "greedy-divergences", str(first), diverged)
    assert len(seen) <= 1, seen
    assert all(m < NEAR_TIE for _, _, m in seen), seen


@pytest.mark.parametrize("pair", ["mixed-exact"], indirect=True)  # the defaults: one is enough here
def test_json_schema_rows_beside_device_sampled_ones(pair):
    """A step holding json_schema requests reads whole logits rows back: their answers equal the CPU's
    (greedy) and validate; the unconstrained requests sharing those steps get the tokens they get alone
    through the on-device argmax / top-k."""
    cpu, vk = pair
    schema = {
        "type": "object",
        "properties": {"pet": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["pet", "n"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},
    }
    rng = np.random.default_rng(5)
    prompts = [rand_ids(rng, n, cpu.config.vocab_size) for n in (4, 7, 5, 9)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40),
        SamplingParams(temperature=0.9, seed=3, max_tokens=40),
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=0.9, top_k=40, seed=4, max_tokens=12),
    ]
    schemas = [schema, schema, None, None]
    mixed = generate(vk, prompts, params, json_schemas=schemas)
    for r in mixed[:2]:
        assert (r.finish_reason, r.stats["schema_complete"]) == ("stop", True)
        obj = json.loads(r.text)
        assert obj["pet"] in ("cat", "dog") and 0 <= obj["n"] <= 9 and set(obj) == {"pet", "n"}
    assert mixed[0].token_ids == generate(cpu, prompts[:1], params[0], json_schemas=schema)[0].token_ids
    alone = generate(vk, prompts[2:], params[2:])
    assert [r.token_ids for r in mixed[2:]] == [r.token_ids for r in alone]
