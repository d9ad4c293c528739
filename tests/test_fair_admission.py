"""Fair admission (engine/admission.py): owners are served in turn, each owner's requests in order.

The queue alone, then a real Scheduler over a tiny random GGUF on the numpy backend (deterministic mode,
so a request's tokens do not depend on its batch): one owner queues many requests, a second owner's
request arriving later is admitted within the bound the module states, and every request's greedy tokens
equal those of its run alone. Last, a real daemon, where the owner is the connection.
"""

from __future__ import annotations

import numpy as np
import pytest
import zmq
from daemon_harness import Daemon
from test_model_cpu import rand_ids
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client
from hmaclient import protocol as P
from hmad.composition import load_model
from hmad.engine.admission import FairQueue
from hmad.engine.request import Request
from hmad.engine.sampling import SamplingParams
from hmad.engine.scheduler import Scheduler, SchedulerConfig
from hmad.engine.worker import EngineThread

N_NEW = 4
CFG = dict(max_seqs=2, step_tokens=64, max_chunk=16, block_size=4, kv_tokens=512, max_queue=64)


def req(i: int, owner: bytes | None, ids=(2, 7, 9), n: int = N_NEW) -> Request:
    return Request(i, list(ids), SamplingParams(temperature=0.0, max_tokens=n), owner=owner)


def drain(q: FairQueue) -> list[int]:
    out = []
    while q:
        assert q.peek() is (r := q.pop())
        out.append(r.id)
    return out


def test_owners_take_turns_and_each_owner_keeps_its_order():
    q = FairQueue()
    for i in range(5):
        q.append(req(i, b"a"))
    q.append(req(10, b"b"))
    q.append(req(11, b"b"))
    q.append(req(20, None))
    assert len(q) == 8 and q.owners() == 3
    assert drain(q) == [0, 10, 20, 1, 11, 2, 3, 4]
    assert len(q) == 0 and q.owners() == 0
    with pytest.raises(IndexError):
        q.peek()


def test_one_owner_or_no_owner_is_fifo():
    for owner in (None, b"x"):
        q = FairQueue()
        for i in range(6):
            q.append(req(i, owner))
        assert drain(q) == list(range(6))


def test_a_served_owner_goes_to_the_back_and_a_returning_one_joins_there():
    q = FairQueue()
    for i, o in enumerate([b"a", b"a", b"b"]):
        q.append(req(i, o))
    assert q.pop().id == 0  # a served: the ring is now b, a
    q.append(req(3, b"c"))  # a new owner: behind a
    assert drain(q) == [2, 1, 3]
    q.append(req(4, b"b"))  # b left the ring when it emptied: it comes back alone
    assert drain(q) == [4]


def test_remove_if_keeps_the_ring_and_the_count():
    q = FairQueue()
    for i, o in enumerate([b"a", b"b", b"a", b"c", b"b"]):
        q.append(req(i, o))
    q.remove_if(lambda r: r.id in (1, 4, 2))  # b empties and leaves; a keeps its place
    assert len(q) == 2 and q.owners() == 2
    assert sorted(r.id for r in q) == [0, 3]
    assert drain(q) == [0, 3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_gguf(tmp_path_factory.mktemp("fair") / "tiny.gguf", seed=7, types=MIXED)
    return load_model(path, backend="cpu", deterministic=True)


def prompts(model, n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rand_ids(rng, int(rng.integers(3, 12)), model.config.vocab_size) for _ in range(n)]


def solo(model, ids: list[int]) -> list[int]:
    """Greedy tokens of ``ids`` run alone."""
    s = Scheduler(model, SchedulerConfig(**CFG))
    s.submit(req(0, None, ids))
    out = []
    while s.has_work():
        out += [t for ev in s.step() for t in ev.token_ids]
    return out


def watch_admissions(s: Scheduler, order: list[int], at: dict[int, int], step: list[int]) -> None:
    """Record each request the scheduler takes off its queue, in order, and the step it was taken in."""
    take = s.waiting.pop

    def pop():
        r = take()
        order.append(r.id)
        at[r.id] = step[0]
        return r

    s.waiting.pop = pop


def run(model, jobs: list[tuple[int, bytes | None, list[int]]]):
    """Drive a Scheduler over (submit step, owner, prompt) jobs; returns each request's tokens, the step
    that admitted it, the step of its first token, and the order of admission."""
    s = Scheduler(model, SchedulerConfig(**CFG))
    toks: dict[int, list[int]] = {i: [] for i in range(len(jobs))}
    admitted, first, order, step = {}, {}, [], [0]
    watch_admissions(s, order, admitted, step)
    while len(order) < len(jobs) or s.has_work():
        for i, (at, owner, ids) in enumerate(jobs):
            if at == step[0]:
                s.submit(req(i, owner, ids))
        for ev in s.step():
            if ev.token_ids and ev.request_id not in first:
                first[ev.request_id] = step[0]
            toks[ev.request_id] += ev.token_ids
        step[0] += 1
    return toks, admitted, first, order


def test_a_second_owner_is_admitted_within_the_bound_behind_a_long_queue(tiny):
    """Owner a queues 16 requests at step 0; owner b's one request comes at step 3, when a still has 14
    waiting. b has one other owner ahead (n = 1): it is among the next n + 1 = 2 admissions, so its first
    token comes within 2 requests' lifetimes, not after a's 14. FIFO (every request of owner None, the same
    jobs) admits it last. Every request's tokens are those of its run alone."""
    ps = prompts(tiny, 17)
    jobs = [(0, b"a", p) for p in ps[:16]] + [(3, b"b", ps[16])]
    toks, admitted, first, order = run(tiny, jobs)
    late = order.index(16)
    before = [i for i in order[:late] if admitted[i] >= 3]  # admitted after b arrived, ahead of it
    assert len(before) <= 1, (order, admitted)
    assert first[16] - 3 <= 2 * (max(map(len, ps)) + N_NEW), first  # two lifetimes: prefill + max_tokens
    assert [i for i in order if i < 16] == list(range(16))  # a's own order kept

    fifo_jobs = [(at, None, p) for at, _, p in jobs]
    fifo_toks, _, fifo_first, fifo_order = run(tiny, fifo_jobs)
    assert fifo_order[-1] == 16 and fifo_first[16] > first[16]
    for i, (_, _, p) in enumerate(jobs):
        assert toks[i] == fifo_toks[i] == solo(tiny, p), f"request {i}"


def test_many_owners_each_get_one_turn_per_round(tiny):
    """Three owners queue 4 requests each at once: admissions go a, b, c, a, b, c, ... (one per owner per
    round), each owner's in its order."""
    ps = prompts(tiny, 12, seed=1)
    owners = [b"a", b"b", b"c"]
    jobs = [(0, owners[k], ps[4 * k + j]) for k in range(3) for j in range(4)]
    _, _, _, order = run(tiny, jobs)
    assert [jobs[i][1] for i in order] == owners * 4
    for k in range(3):
        assert [i for i in order if jobs[i][1] == owners[k]] == [4 * k + j for j in range(4)]


def test_cancelling_a_waiting_request_keeps_the_turns(tiny):
    """A waiting request cancelled is dropped with a cancelled event; the others keep their turns."""
    ps = prompts(tiny, 5, seed=2)
    s = Scheduler(tiny, SchedulerConfig(**{**CFG, "max_seqs": 1}))
    reqs = [req(i, o, p) for i, (o, p) in enumerate(zip([b"a", b"a", b"a", b"b", b"b"], ps, strict=True))]
    for r in reqs:
        s.submit(r)
    s.cancel(3)
    order, kinds = [], {}
    watch_admissions(s, order, {}, [0])
    while s.has_work():
        for ev in s.step():
            if ev.terminal:
                kinds[ev.request_id] = ev.kind
    assert kinds == {0: "done", 1: "done", 2: "done", 3: "cancelled", 4: "done"}
    assert order == [0, 4, 1, 2]
    assert len(s.waiting) == 0


def test_a_full_queue_makes_room_for_an_owner_with_fewer_waiting():
    q = FairQueue()
    for i in range(4):
        q.append(req(i, b"a"))
    q.append(req(10, b"b"))
    assert not q.can_make_room_for(b"a")  # the owner with the most waiting gains nothing
    assert q.can_make_room_for(b"b") and q.can_make_room_for(b"c") and q.can_make_room_for(None)
    assert q.make_room_for(b"c").id == 3  # a's newest gives its place
    assert q.make_room_for(b"b").id == 2  # a: 2 waiting, b: 1
    assert not q.can_make_room_for(b"b")  # a: 2, b: 1: no place goes back and forth
    assert len(q) == 3 and drain(q) == [0, 10, 1]


def test_scheduler_and_engine_thread_answer_busy_for_a_displaced_request(tiny):
    """max_queue 4, all taken by owner a: a's fifth is refused busy; owner b's first two take the places of
    a's newest two (they end busy through the engine thread's events); b's third is refused. The others
    all run to their solo tokens."""
    ps = prompts(tiny, 8, seed=3)
    s = Scheduler(tiny, SchedulerConfig(**{**CFG, "max_queue": 4}))
    engine = EngineThread(s, wake=lambda: None)
    jobs = [(b"a", p) for p in ps[:5]] + [(b"b", p) for p in ps[5:]]
    for i, (owner, p) in enumerate(jobs):
        engine.submit(req(i, owner, p))
    toks, ends = {}, {}
    while True:
        engine.turn()
        while not engine.events.empty():
            for ev in engine.events.get():
                toks.setdefault(ev.request_id, []).extend(ev.token_ids)
                if ev.terminal:
                    ends[ev.request_id] = ev.kind if ev.kind != "error" else ev.error_code
        if not s.has_work():
            break
    assert ends == {0: "done", 1: "done", 2: "busy", 3: "busy", 4: "busy", 5: "done", 6: "done", 7: "busy"}
    for i in (0, 1, 5, 6):
        assert toks[i] == solo(tiny, jobs[i][1]), f"request {i}"


# -- through a real daemon -------------------------------------------------------------------------------


def test_daemon_serves_a_second_connection_in_turn(tmp_path):
    """One connection queues 10 generations of 32 tokens (one sequence at a time); a second connection's
    request, sent once the first's first request runs, is served after 2 of the first's requests (the
    running one and the one whose turn came first), not after all 10. The check allows 4: the second
    connection's request may reach the engine a request or two late on a busy machine."""
    path = make_tiny_gguf(tmp_path / "tiny.gguf", seed=5, types=MIXED)
    d = Daemon(path, tmp_path, "engine.max_seqs=1", "engine.max_queue=64").wait_ready()
    n = 10
    try:
        with zmq.Context() as ctx:
            a = ctx.socket(zmq.DEALER)
            a.setsockopt(zmq.LINGER, 0)
            a.connect(P.endpoint(d.socket))
            for i in range(n):
                a.send(P.pack(P.generate_request(i, "the cat", raw=True, max_tokens=32, temperature=0)))
            ended, started = set(), False
            while not started:  # until a's first request produces a token
                assert a.poll(30000), d.log_text()
                m = P.unpack(a.recv(), max_size=P.MAX_REPLY_BYTES)
                started = m["type"] == "token"
                assert m["type"] in ("accepted", "token"), m
            with Client(d.socket, timeout=60) as b:
                r = b.generate("the dog", raw=True, max_tokens=2, temperature=0)
                assert r.generated_tokens >= 1
                while a.poll(0):  # a's replies so far: which of its requests ended before b's did
                    m = P.unpack(a.recv(), max_size=P.MAX_REPLY_BYTES)
                    if m["type"] in ("done", "error", "cancelled"):
                        ended.add(m["id"])
            assert len(ended) <= 4, f"{len(ended)} of the first connection's requests ended first"
            while len(ended) < n:  # the rest are all served
                assert a.poll(30000), d.log_text()
                m = P.unpack(a.recv(), max_size=P.MAX_REPLY_BYTES)
                if m["type"] in ("done", "error", "cancelled"):
                    assert m["type"] == "done", m
                    ended.add(m["id"])
    finally:
        assert d.stop() == 0, d.log_text()
