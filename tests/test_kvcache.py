"""The KV block manager (engine/kvcache.py): chain keys, reference counts, LRU eviction, admission with
cached blocks, sliding-window blocks, and no leaks. Pure bookkeeping on small layouts (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from hmad.engine.kvcache import KVCacheManager, KVLayout, block_key, prompt_keys

B, W = 4, 6  # block size, sliding window: windows not block-aligned


def layout(n_global=40, n_local=24, ring=4, max_seqs=4, glob=(1,), loc=(0,)) -> KVLayout:
    # ring = ceil((W + max_chunk - 1) / B) + 1 = 4 for max_chunk 4
    return KVLayout(B, n_global, n_local, ring, glob, loc, 1, 8, window=W, max_seqs=max_seqs)


def run(kv: KVCacheManager, sid: int, ids: list[int], n_positions: int | None = None, chunk: int = 4):
    """Admit ``ids`` and write all of them, ``chunk`` positions a step, as the scheduler does; returns the
    positions reused and every step's tables (pos0, global table, ring)."""
    reused = kv.admit(sid, n_positions or len(ids) + 4, ids)
    assert reused is not None
    steps = []
    for p0 in range(reused, len(ids), chunk):
        n = min(chunk, len(ids) - p0)
        t = kv.prepare(sid, p0, n)
        steps.append((p0, n, t.global_table.copy(), t.local_table.copy()))
        kv.commit(sid, p0 + n, lambda a, b: ids[a:b])
    return reused, steps


def test_chain_keys_name_the_whole_prefix():
    a = list(range(100, 112))
    b = [7] + a[1:]
    ka, kb = prompt_keys(a, B, 3), prompt_keys(b, B, 3)
    assert len(set(ka)) == 3
    assert all(x != y for x, y in zip(ka, kb, strict=True))  # one token changed: every later key too
    assert ka[1] == block_key(ka[0], a[4:8]) and ka[1] != block_key(b"", a[4:8])
    assert prompt_keys(a + [1, 2], B, 3) == ka


def test_second_prompt_reuses_full_blocks_and_writes_fresh_ones():
    kv = KVCacheManager(layout())
    ids = list(range(10, 31))  # 21 tokens: 5 full blocks
    assert run(kv, 0, ids)[0] == 0
    g0 = kv.tables(0).global_table.tolist()
    other = ids[:14] + [99] * 5  # shares 3 full blocks and 2 tokens
    reused, steps = run(kv, 1, other)
    assert reused == 12
    g1 = kv.tables(1).global_table.tolist()
    assert g1[:3] == g0[:3] and not set(g1[3:]) & set(g0)  # shared read-only; new positions in new blocks
    assert [kv.global_pool.refs(b) for b in g0[:4]] == [2, 2, 2, 1]
    assert steps[0][0] == 12  # the first write is at the hit point
    st = kv.usage()["prefix_cache"]
    assert (st["lookups"], st["hits"], st["reused_tokens"], st["prompt_tokens"]) == (2, 1, 12, 40)


def test_last_prompt_token_is_always_computed():
    kv = KVCacheManager(layout())
    ids = list(range(50, 66))  # 16 tokens = 4 full blocks
    run(kv, 0, ids)
    assert kv.admit(1, 20, ids) == 12  # the same prompt: blocks 0..2 reused, block 3 recomputed
    assert kv.admit(2, 20, ids[:13]) == 12
    assert kv.admit(3, 20, ids[:12]) == 8


def test_partial_and_unwritten_blocks_are_never_registered():
    kv = KVCacheManager(layout())
    ids = list(range(30, 41))  # 11 tokens: blocks 0, 1 full, block 2 partial
    run(kv, 0, ids)
    assert kv.global_pool.n_cached == 2
    kv.release(0)
    assert kv.admit(1, 20, ids + [5, 6, 7]) == 8  # not 12: block 2 was not full when written


def test_cache_off_never_shares():
    kv = KVCacheManager(layout(), prefix_cache=False)
    ids = list(range(10, 31))
    run(kv, 0, ids)
    assert run(kv, 1, ids)[0] == 0
    assert kv.usage()["prefix_cache"]["cached_blocks"] == 0


def test_finished_blocks_stay_cached_and_are_evicted_lru_tail_first():
    kv = KVCacheManager(layout(n_global=12, n_local=24))
    a = list(range(100, 117))  # 17 tokens: 5 global blocks (4 full)
    run(kv, 0, a, n_positions=17)
    kv.release(0)
    assert kv.usage()["global_blocks_cached"] == 4 and kv.global_pool.n_free == 12
    b = list(range(200, 237))  # 37 tokens: 10 blocks; 8 never-used left, so 2 cached blocks go
    run(kv, 1, b, n_positions=37)
    assert kv.global_pool.evictions == 2
    kv.release(1)
    assert kv.admit(2, 17, a) == 8  # a's tail blocks 2, 3 went first; its prefix 0, 1 is still there


def test_admission_counts_evictable_blocks_as_free_and_pins_hits():
    kv = KVCacheManager(layout(n_global=10, n_local=24))
    a = list(range(100, 133))  # 33 tokens: 9 blocks, 8 full
    run(kv, 0, a, n_positions=40)  # quota 10 blocks: the whole pool
    assert kv.admit(1, 4, [1, 2, 3]) is None  # 1 block: all promised to sequence 0
    kv.release(0)
    assert kv.global_pool.available == 10 and kv.usage()["global_blocks_cached"] == 8
    assert kv.admit(1, 40, [5] * 33) == 0  # an unrelated prompt fits: cached blocks are free space
    kv.release(1)
    kv.flush()
    run(kv, 2, a, n_positions=33)
    kv.release(2)
    # a hit pins 8 evictable blocks (using them up) and needs 1 new: 9 <= 10; a second sharer needs
    # just its 1 new block
    assert kv.admit(3, 36, a) == 32 and kv.global_pool.available == 1
    assert kv.admit(4, 36, a) == 32 and kv.global_pool.available == 0
    assert kv.admit(5, 4, [7, 7]) is None


def test_local_blocks_leave_the_window_and_the_ring_never_collides():
    kv = KVCacheManager(layout())
    ids = list(range(300, 340))  # 40 tokens, window 6, ring 4
    _, steps = run(kv, 0, ids, n_positions=48, chunk=3)
    seen = {}
    for p0, n, _, ring in steps:
        for j in range((max(0, p0 - W + 1)) // B, -(-(p0 + n) // B)):  # blocks the step reads
            block = ring[j % len(ring)]
            assert seen.setdefault(j, block) == block  # a block index keeps its block while read
        assert len({ring[j % 4] for j in range(max(0, p0 - W + 1) // B, -(-(p0 + n) // B))}) == len(
            range(max(0, p0 - W + 1) // B, -(-(p0 + n) // B))
        )
    assert len(set(seen.values())) == 10  # every block index got a block of its own
    assert kv.usage()["local_blocks_used"] <= 4  # held: the window only
    assert kv.local_pool.n_cached == 10  # the others gave back, still cached


def test_hit_needs_the_last_window_of_local_blocks():
    kv = KVCacheManager(layout(n_local=8, ring=4))
    ids = list(range(400, 441))  # 41 tokens: 10 full blocks
    run(kv, 0, ids)
    kv.release(0)
    # local blocks 0..9 given back in order 0..5 (left the window while running), then 9..6 (release):
    # taking 4 new local blocks evicts blocks 0..3 (never used ones first: 8 - 10 < 0, so LRU)
    other = list(range(900, 916))
    run(kv, 1, other)
    kv.release(1)
    hit = kv.admit(2, 48, ids)
    assert hit == 40  # the window before 40 (positions 35..39: blocks 8, 9) is still cached
    kv.release(2)
    # evict more: block 8's local copy goes -> a hit at 40 is impossible; at 36 it needs blocks 7, 8 too;
    # the longest usable prefix ends where no missing block is in the window
    kv.local_pool._lru.move_to_end(kv.local_pool.lookup(prompt_keys(ids, B, 10)[8]), last=False)
    kv.local_pool.take(1)
    k = kv.admit(3, 48, ids) // B
    assert k == 8  # blocks 0..7 global, the window before 32 (27..31: blocks 6, 7) cached
    keys = prompt_keys(ids, B, 10)
    assert all(kv.local_pool.lookup(keys[j]) is not None for j in (6, 7))


def test_reserve_takes_everything_up_front_and_is_never_cached():
    kv = KVCacheManager(layout())
    t = kv.reserve(0, 30)
    assert len(t.global_table) == 8 and len(t.local_table) == 4
    assert kv.usage()["global_blocks_used"] == 8 and kv.usage()["local_blocks_used"] == 4
    with pytest.raises(KeyError):
        kv.reserve(0, 4)
    kv.release(0)
    assert kv.global_pool.n_free == 40 and kv.local_pool.n_free == 24 and kv.global_pool.n_cached == 0


def test_max_table_entries_covers_sharers():
    lay = layout(n_global=40, ring=4, max_seqs=4)
    assert lay.max_table_entries() >= 4 * (40 + 4) and lay.max_table_entries(9) == lay.max_table_entries()
    assert 40 + 4 <= lay.max_table_entries(1) < 2 * (40 + 4)


def test_random_workload_keeps_the_invariants_and_leaks_nothing():
    rng = np.random.default_rng(5)
    kv = KVCacheManager(layout(n_global=48, n_local=16, ring=4, max_seqs=4))
    prefixes = [rng.integers(0, 50, 30).tolist() for _ in range(3)]
    running: dict[int, tuple[list[int], int]] = {}
    sid = 0
    for _ in range(400):
        if running and (len(running) == 4 or rng.random() < 0.4):
            s = int(rng.choice(list(running)))
            ids, done = running[s]
            if done >= len(ids) or rng.random() < 0.1:  # finished or cancelled
                kv.release(s)
                del running[s]
                continue
            n = min(4, len(ids) - done)
            kv.prepare(s, done, n)
            kv.commit(s, done + n, lambda a, b, ids=ids: ids[a:b])
            running[s] = (ids, done + n)
        else:
            p = prefixes[rng.integers(3)][: rng.integers(1, 31)]
            ids = p + rng.integers(0, 50, rng.integers(1, 12)).tolist()
            reused = kv.admit(sid, len(ids) + 4, ids)
            if reused is not None:
                assert reused % B == 0 and reused < len(ids)
                running[sid] = (ids, reused)
            sid += 1
        for pool in (kv.global_pool, kv.local_pool):
            assert pool.available >= 0 and pool.promised >= 0
            assert pool.n_evictable <= pool.n_cached
        held = sum(kv.global_pool.refs(b) for b in range(48))
        assert held == sum(len(kv._seqs[s].glob) for s in running)
    assert kv.stats.hits > 10
    for s in list(running):
        kv.release(s)
    kv.flush()
    for pool in (kv.global_pool, kv.local_pool):
        assert pool.n_free == pool.n_blocks and pool.promised == 0 and pool.n_cached == 0


@pytest.mark.parametrize(
    "window,block,chunk", [(w, b, c) for w in (1, 3, 4, 6, 9) for b in (2, 4) for c in (2, 3, 5)]
)
def test_a_fed_row_keeps_the_window_of_the_position_before_it(window, block, chunk):
    """A pipelined row at p + 1 prepared with keep_back=1 (its input token, drawn on the device, may still
    be replaced by the host's): position p can be written again, every block its query reads still held at
    its own ring slot, at every position of a sequence, for any window, block size and chunk >= 2 (the
    ring KVLayout.plan sizes for them)."""
    ring = -(-(window + chunk - 1) // block) + 1
    lay = KVLayout(block, 0, 2 * ring, ring, (), (0,), 1, 8, window=window, max_seqs=2)
    kv = KVCacheManager(lay, prefix_cache=False)
    n, pos = 40, 0
    assert kv.admit(0, n) == 0
    while pos < 7:  # the prompt, in chunks
        kv.prepare(0, pos, min(chunk, 7 - pos))
        pos += min(chunk, 7 - pos)
    while pos < n - 1:
        kv.prepare(0, pos, 1)  # the row whose token the device draws
        kv.prepare(0, pos + 1, 1, keep_back=1)  # the next step's row, fed from it
        assert kv.can_rewrite(0, pos), pos
        redo = kv.prepare(0, pos, 1)  # the host drew another token: position pos again
        held = kv._seqs[0].local
        for j in range(max(0, pos - window + 1) // block, pos // block + 1):
            assert redo.local_table[j % len(redo.local_table)] == held[j], (pos, j)
        pos += 1
