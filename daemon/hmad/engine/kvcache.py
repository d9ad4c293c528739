"""Paged KV cache bookkeeping with a prefix cache: which blocks of the backend's pools each sequence reads.

Gemma 3 mixes global layers (attend to every earlier position) with sliding-window layers (attend to the
last W positions: a query at p reads keys [p - W + 1, p]). The two kinds get separate pools of blocks of B
positions; the backend owns the memory, this module only hands out block numbers.

Tables a step passes to the backend (engine/batch.py SeqSlice; the shaders' ``kv_slot``):

- global: block j of the sequence holds positions [j*B, (j+1)*B); the table grows as the sequence does;
- local: a ring of R_s entries, position p in block ``ring[(p // B) % R_s]``. A step writes up to
  ``max_chunk`` new positions before attending, so the ring must hold the window plus one chunk:
  R = ceil((W + max_chunk - 1) / B) + 1, and R_s = min(R, blocks of the sequence's whole budget).

Prefix cache (vLLM's design, chain-hashed full blocks):

- When a step has filled block j of a sequence (prompt or generated tokens alike, so requests sharing a
  system prompt hit a sequence still prefilling), the block is registered under its key
  ``key_j = blake2b(key_{j-1} + token ids of block j)``: the key names the whole prefix, not one block.
  Only full blocks are registered; a partial block is never shared.
- Tenants. The chain starts from the tenant's root (``tenant_root``: the empty key for tenant None, a
  hash of the tenant's id otherwise), so equal prompts of two tenants have different keys: a request
  never reuses, and so never learns of (``cached_tokens``), blocks another tenant computed. Tenants share
  the pools and the LRU order, not the contents.
- A block has a reference count (the sequences reading it). At zero, a registered block stays cached in an
  LRU list and keeps its key; it is reclaimed (its key forgotten) only when a pool needs a block and no
  never-used one is left. A sequence gives its blocks back tail first, so a prefix outlives its tails.
- A new request looks up the keys of its prompt's full blocks, leaving out the last prompt token (it must be
  computed for the logits); it reuses the longest run of cached blocks 0..k-1 (pinned: reference + 1) and
  computes from position k*B on, in fresh blocks of its own: a sequence never writes a shared block.
- Sliding-window layers. A local block is written only while its sequence is at it: the ring does not wrap
  over the same physical blocks; instead the sequence takes a fresh block for each new block index j
  (placed at ``ring[j % R_s]``) and gives back the block that has left every later query's window (all its
  positions < pos0 - W + 1). The ring then never holds more than R_s live blocks (a step's queries read
  [pos0 - W + 1, pos0 + n)), the shaders are unchanged, a sequence still holds at most R_s local blocks,
  and a given-back local block keeps its key like a global one. A prefix hit at k*B pins the global blocks
  0..k-1 and the local blocks covering [k*B - W + 1, k*B) only (what the first new query can see), so the
  hit point is the longest k whose global blocks and whose last window of local blocks are all cached.
  The alternatives were worse: copying cached window KV into a per-sequence ring needs a copy op on every
  backend and a copy of every block before its ring slot is overwritten; recomputing the last window for
  local layers is not exact (a local layer's input at p depends on earlier layers' windows, so the
  receptive field is the whole prefix).

Admission keeps the no-preemption promise of the old up-front reservation without taking blocks early:
a sequence has a quota per pool (global: blocks of prompt + max_tokens; local: R_s) and may still take
``quota - held`` blocks. A pool's ``available`` is never-used + evictable-cached blocks minus what running
sequences may still take; a request is admitted when its uncached blocks fit in it (pinning an evictable
cached block uses one up too). Blocks are taken when a step first writes them, evicting cached blocks LRU.
"""

from __future__ import annotations

import collections
import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hmad.core.kv_layout import KVLayout, cdiv

ROOT_KEY = b""  # the chain root of tenant None


@functools.lru_cache(maxsize=1024)
def tenant_root(tenant: int | None) -> bytes:
    """The chain root of a tenant's prefix keys (module docstring, "Tenants"); 16 bytes unlike ROOT_KEY,
    so no tenant's first block can share a hashed input with tenant None's."""
    if tenant is None:
        return ROOT_KEY
    return hashlib.blake2b(b"hmad-tenant:" + str(tenant).encode(), digest_size=16).digest()


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Chain key of a full block: its tokens and (through ``parent``) every token before it."""
    ids = np.asarray(token_ids, dtype="<i4").tobytes()
    return hashlib.blake2b(parent + ids, digest_size=16).digest()


def prompt_keys(
    token_ids: Sequence[int], block_size: int, n_blocks: int, root: bytes = ROOT_KEY
) -> list[bytes]:
    """Chain keys of the first ``n_blocks`` full blocks of ``token_ids``, chained from ``root``."""
    keys, parent = [], root
    for j in range(n_blocks):
        parent = block_key(parent, token_ids[j * block_size : (j + 1) * block_size])
        keys.append(parent)
    return keys


class BlockPool:
    """One pool's blocks: held (reference count > 0), cached (count 0, content kept under a key, LRU order)
    or never-used (free). ``promised``: blocks running sequences may still take."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self._refs = [0] * n_blocks
        self._key: dict[int, bytes] = {}  # block -> key of the prefix it holds
        self._block: dict[bytes, int] = {}  # key -> block
        self.promised = 0
        self.evictions = 0

    @property
    def n_free(self) -> int:
        """Blocks no sequence holds (never-used or evictable cached)."""
        return len(self._free) + len(self._lru)

    @property
    def n_evictable(self) -> int:
        return len(self._lru)

    @property
    def n_cached(self) -> int:
        """Blocks holding a registered prefix block, held or not."""
        return len(self._key)

    @property
    def available(self) -> int:
        """Blocks a newly admitted sequence may be promised."""
        return self.n_free - self.promised

    def refs(self, block: int) -> int:
        return self._refs[block]

    def take(self, n: int) -> list[int]:
        """``n`` blocks with reference 1: never-used ones first, then the least recently used cached ones."""
        if n > self.n_free:
            raise MemoryError(f"KV pool exhausted: need {n} blocks, {self.n_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._lru.popitem(last=False)
                del self._block[self._key.pop(b)]
                self.evictions += 1
            self._refs[b] = 1
            out.append(b)
        return out

    def pin(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._lru[block]
        self._refs[block] += 1

    def unpin(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key:
                self._lru[block] = None  # most recently used end
            else:
                self._free.append(block)

    def register(self, block: int, key: bytes) -> None:
        """Record that held ``block`` holds the prefix block ``key`` (the first holder of a key keeps it)."""
        if key not in self._block and block not in self._key:
            self._block[key], self._key[block] = block, key

    def lookup(self, key: bytes) -> int | None:
        return self._block.get(key)

    def flush(self) -> None:
        """Forget every cached block no sequence holds."""
        for b in self._lru:
            del self._block[self._key.pop(b)]
            self._free.append(b)
        self._lru.clear()


@dataclass
class SeqBlocks:
    global_table: np.ndarray  # (blocks,) int32
    local_table: np.ndarray  # (R_s,) int32: the ring


@dataclass
class _Seq:
    """One sequence's blocks and what it may still take."""

    budget: int  # blocks of its whole budget of positions
    quota_g: int
    quota_l: int
    glob: list[int]  # global block of each block index 0..
    local: dict[int, int]  # block index -> local block, for the blocks still in the window
    ring: np.ndarray  # (quota_l,) int32: local[j] at ring[j % quota_l]
    keys: list[bytes] = field(default_factory=list)  # chain keys of the blocks registered so far
    root: bytes = ROOT_KEY  # its tenant's chain root


@dataclass
class PrefixStats:
    lookups: int = 0  # requests admitted with a prompt looked up
    hits: int = 0  # of which reused at least one block
    prompt_tokens: int = 0
    reused_tokens: int = 0


class KVCacheManager:
    """Hands out block tables per sequence, shares cached prefix blocks, and tracks the pools' use.

    The scheduler's life of a sequence: ``admit`` (None: wait) -> per step ``prepare`` (tables for the
    positions it writes) and, after the step, ``commit`` (register its newly full blocks) -> ``release``.
    ``reserve`` is the fixed alternative for drivers that build StepBatches themselves (all blocks up
    front, the local ring wrapping over its own blocks, nothing cached).
    """

    def __init__(self, layout: KVLayout, prefix_cache: bool = True):
        self.layout = layout
        self.prefix_cache = prefix_cache
        self.global_pool = BlockPool(layout.n_global_blocks)
        self.local_pool = BlockPool(layout.n_local_blocks)
        self._seqs: dict[int, _Seq] = {}
        self.stats = PrefixStats()

    # -- admission -------------------------------------------------------------------------------------
    def blocks_needed(self, n_positions: int) -> tuple[int, int]:
        """(global, local) blocks a sequence of ``n_positions`` positions holds at most at once."""
        lay = self.layout
        g = cdiv(n_positions, lay.block_size) if lay.global_layers else 0
        loc = min(lay.ring_blocks, cdiv(n_positions, lay.block_size)) if lay.local_layers else 0
        return g, loc

    def fits_ever(self, n_positions: int) -> bool:
        """Whether a sequence this long could ever be admitted (the pools' full size)."""
        g, loc = self.blocks_needed(n_positions)
        return g <= self.global_pool.n_blocks and loc <= self.local_pool.n_blocks

    def admit(
        self, seq_id: int, n_positions: int, token_ids: Sequence[int] = (), tenant: int | None = None
    ) -> int | None:
        """Take a sequence of at most ``n_positions`` positions in if its uncached blocks fit.

        Returns the positions its prompt ``token_ids`` reuses from ``tenant``'s cached blocks (a multiple of
        the block size; the sequence computes from there on), or None when the pools are too full now. The
        blocks it fills are registered for ``tenant`` alone.
        """
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id} already holds KV blocks")
        if self.layout.local_layers and not self.layout.window:
            raise ValueError("KVLayout.window is needed to admit sequences (KVLayout.plan sets it)")
        qg, ql = self.blocks_needed(n_positions)
        root = tenant_root(tenant)
        k, keys = self._match(token_ids, root) if self.prefix_cache and token_ids else (0, [])
        pg = [self.global_pool.lookup(keys[j]) for j in range(k)] if self.layout.global_layers else []
        lo = self._first_read_block(k * self.layout.block_size) if self.layout.local_layers else k
        pl = {j: self.local_pool.lookup(keys[j]) for j in range(lo, k)}
        for pool, quota, pinned in ((self.global_pool, qg, pg), (self.local_pool, ql, list(pl.values()))):
            if quota - len(pinned) + sum(pool.refs(b) == 0 for b in pinned) > pool.available:
                return None
        for b in pg:
            self.global_pool.pin(b)
        for b in pl.values():
            self.local_pool.pin(b)
        self.global_pool.promised += qg - len(pg)
        self.local_pool.promised += ql - len(pl)
        ring = np.zeros(ql, np.int32)
        for j, b in pl.items():
            ring[j % ql] = b
        budget = cdiv(n_positions, self.layout.block_size)
        self._seqs[seq_id] = _Seq(budget, qg, ql, list(pg), pl, ring, keys[:k], root)
        if token_ids:
            self._count(len(token_ids), k * self.layout.block_size)
        return k * self.layout.block_size

    def _match(self, token_ids: Sequence[int], root: bytes) -> tuple[int, list[bytes]]:
        """(k, keys): the longest cached prefix of k blocks usable by a new sequence (global blocks 0..k-1
        and the local blocks of the last window before k*B), and the keys of the prompt's full blocks."""
        lay = self.layout
        limit = (len(token_ids) - 1) // lay.block_size  # the last prompt token is always computed
        keys = prompt_keys(token_ids, lay.block_size, limit, root)
        kg = limit
        if lay.global_layers:
            kg = next((j for j, key in enumerate(keys) if self.global_pool.lookup(key) is None), limit)
        if not lay.local_layers:
            return kg, keys
        last_missing = -1  # the last block index < k whose local block is not cached
        best = 0
        for k in range(1, kg + 1):
            if self.local_pool.lookup(keys[k - 1]) is None:
                last_missing = k - 1
            if last_missing < self._first_read_block(k * lay.block_size):
                best = k
        return best, keys

    def _first_read_block(self, pos0: int) -> int:
        """The first block a query at ``pos0`` (or later) reads on a sliding-window layer."""
        return max(0, pos0 - self.layout.window + 1) // self.layout.block_size

    def _count(self, prompt_tokens: int, reused: int) -> None:
        st = self.stats
        st.lookups += 1
        st.hits += reused > 0
        st.prompt_tokens += prompt_tokens
        st.reused_tokens += reused

    # -- a step ----------------------------------------------------------------------------------------
    def prepare(self, seq_id: int, pos0: int, n: int, keep_back: int = 0) -> SeqBlocks:
        """Tables for a step writing positions [pos0, pos0 + n): takes blocks for them, gives back the local
        blocks no query from pos0 on reads. ``n`` is at most the ``max_chunk`` the layout was planned for.
        ``keep_back``: positions before pos0 a later step may write again (a pipelined row whose input
        token the host may still replace: engine/scheduler.py, "Pipelining"); the local blocks their queries
        read stay held where the ring has room (``can_rewrite`` says whether it had)."""
        s, bs = self._seqs[seq_id], self.layout.block_size
        end_block = cdiv(pos0 + n, bs)
        if end_block > s.budget:
            raise ValueError(f"sequence {seq_id} writes past its budget of {s.budget} blocks")
        if self.layout.local_layers and end_block - self._first_read_block(pos0) > s.quota_l:
            raise ValueError(f"a step of {n} positions overruns the local ring of {s.quota_l} blocks")
        if self.layout.global_layers and len(s.glob) < end_block:
            new = self.global_pool.take(end_block - len(s.glob))
            self.global_pool.promised -= len(new)
            s.glob += new
        if self.layout.local_layers:
            lo = self._first_read_block(pos0)
            kept = self._first_read_block(max(0, pos0 - keep_back))
            if end_block - kept <= s.quota_l:
                lo = kept
            for j in [j for j in s.local if j < lo]:
                self.local_pool.unpin(s.local.pop(j))
                self.local_pool.promised += 1
            for j in range(pos0 // bs, end_block):
                if j not in s.local:
                    (s.local[j],) = self.local_pool.take(1)
                    self.local_pool.promised -= 1
                    s.ring[j % s.quota_l] = s.local[j]
        return self.tables(seq_id)

    def can_rewrite(self, seq_id: int, pos: int) -> bool:
        """Whether a step may write position ``pos`` of the sequence again: every local block a query at
        ``pos`` reads is still held (``prepare``'s ``keep_back``)."""
        if not self.layout.local_layers:
            return True
        held = self._seqs[seq_id].local
        return all(j in held for j in range(self._first_read_block(pos), pos // self.layout.block_size + 1))

    def commit(self, seq_id: int, n_written: int, token_ids: Callable[[int, int], Sequence[int]]) -> None:
        """Register the sequence's blocks that are full once positions < ``n_written`` are written;
        ``token_ids(a, b)`` gives the ids at positions [a, b)."""
        if not self.prefix_cache:
            return
        s, bs = self._seqs[seq_id], self.layout.block_size
        for j in range(len(s.keys), n_written // bs):
            key = block_key(s.keys[-1] if s.keys else s.root, token_ids(j * bs, (j + 1) * bs))
            s.keys.append(key)
            if j < len(s.glob):
                self.global_pool.register(s.glob[j], key)
            if j in s.local:
                self.local_pool.register(s.local[j], key)

    def rollback(self, seq_id: int, n_positions: int) -> None:
        """The sequence keeps positions < ``n_positions`` only (a step wrote drafts past them that were not
        kept: engine/speculation/speculator.py): the blocks wholly past them go back to their pools, free
        to take again (none is registered: ``commit`` runs after, up to the kept positions). A later step
        writes the positions from ``n_positions`` on again; the local blocks its queries read are held."""
        s, bs = self._seqs[seq_id], self.layout.block_size
        keep = cdiv(n_positions, bs)
        if len(s.keys) > n_positions // bs:
            raise ValueError(f"sequence {seq_id}: rolling back over a block registered in the prefix cache")
        while len(s.glob) > keep:
            self.global_pool.unpin(s.glob.pop())
            self.global_pool.promised += 1
        for j in sorted((j for j in s.local if j >= keep), reverse=True):
            self.local_pool.unpin(s.local.pop(j))
            self.local_pool.promised += 1

    def release(self, seq_id: int) -> None:
        """Give every block of the sequence back (tail first, so cached prefixes outlive their tails)."""
        s = self._seqs.pop(seq_id, None)
        if s is None:
            return
        self.global_pool.promised -= s.quota_g - len(s.glob)
        self.local_pool.promised -= s.quota_l - len(s.local)
        for b in reversed(s.glob):
            self.global_pool.unpin(b)
        for j in sorted(s.local, reverse=True):
            self.local_pool.unpin(s.local[j])

    def flush(self) -> None:
        """Drop every cached block no sequence holds."""
        self.global_pool.flush()
        self.local_pool.flush()

    # -- fixed tables ----------------------------------------------------------------------------------
    def can_reserve(self, n_positions: int) -> bool:
        g, loc = self.blocks_needed(n_positions)
        return g <= self.global_pool.available and loc <= self.local_pool.available

    def reserve(self, seq_id: int, n_positions: int) -> SeqBlocks:
        """Take every block a sequence of ``n_positions`` will need; raises MemoryError when short.
        Its local ring wraps over the same R_s blocks; it is never cached."""
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id} already holds KV blocks")
        g, loc = self.blocks_needed(n_positions)
        if not self.can_reserve(n_positions):
            raise MemoryError(f"KV cache full: sequence needs {g}+{loc} blocks")
        ring = self.local_pool.take(loc)
        budget = cdiv(n_positions, self.layout.block_size)
        glob = self.global_pool.take(g)
        self._seqs[seq_id] = _Seq(budget, g, loc, glob, dict(enumerate(ring)), np.asarray(ring, np.int32))
        return self.tables(seq_id)

    def tables(self, seq_id: int) -> SeqBlocks:
        s = self._seqs[seq_id]
        return SeqBlocks(np.asarray(s.glob, dtype=np.int32), s.ring)

    # -- status ----------------------------------------------------------------------------------------
    def usage(self) -> dict:
        g, loc, st = self.global_pool, self.local_pool, self.stats
        cached = g if self.layout.global_layers else loc
        return {
            "global_blocks_used": g.n_blocks - g.n_free,
            "global_blocks_cached": g.n_evictable,
            "global_blocks": g.n_blocks,
            "local_blocks_used": loc.n_blocks - loc.n_free,
            "local_blocks_cached": loc.n_evictable,
            "local_blocks": loc.n_blocks,
            "sequences": len(self._seqs),
            "prefix_cache": {
                "enabled": self.prefix_cache,
                "lookups": st.lookups,
                "hits": st.hits,
                "hit_rate": round(st.hits / st.lookups, 4) if st.lookups else 0.0,
                "prompt_tokens": st.prompt_tokens,
                "reused_tokens": st.reused_tokens,
                "token_hit_rate": round(st.reused_tokens / st.prompt_tokens, 4) if st.prompt_tokens else 0.0,
                "cached_blocks": cached.n_cached,
                "cached_tokens": cached.n_cached * self.layout.block_size,
                "evictions": g.evictions + loc.evictions,
            },
        }
