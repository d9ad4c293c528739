"""Paged KV cache bookkeeping: which blocks of the backend's KV pools belong to which sequence.

Gemma 3 mixes global layers (attend to every earlier position) with sliding-window layers (attend to the
last W positions). The two kinds get separate pools:

- global pool: a sequence's block table grows with it; block j holds positions [j*B, (j+1)*B);
- local pool: a sequence holds a fixed ring of R blocks; position p lives in block ring[(p // B) % R].
  A step writes up to ``max_chunk`` new positions before attending, so the ring must hold the window plus
  one chunk: R = ceil((W + max_chunk - 1) / B) + 1. Local layers thus keep only their window.

Blocks for a request's whole budget (prompt + max new tokens) are reserved when it is admitted, so a running
sequence never runs out of cache mid-generation; admission control waits instead.
The backend owns the memory; this module only hands out block numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hmad.model.config import ModelConfig


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVLayout:
    """Shape of the backend's KV pools: per pool (layers, blocks, block_size, kv_heads, head_dim)."""

    block_size: int
    n_global_blocks: int
    n_local_blocks: int
    ring_blocks: int  # R: blocks a sequence holds in the local pool
    global_layers: tuple[int, ...]  # model layer index of each global-pool layer slot
    local_layers: tuple[int, ...]
    n_kv_heads: int
    head_dim: int

    @staticmethod
    def plan(
        cfg: ModelConfig, max_tokens: int, max_seqs: int, max_chunk: int, block_size: int = 16
    ) -> KVLayout:
        """Size the pools for ``max_tokens`` cached positions in total over at most ``max_seqs`` sequences."""
        glob = tuple(i for i, g in enumerate(cfg.layer_is_global) if g)
        loc = tuple(i for i, g in enumerate(cfg.layer_is_global) if not g)
        ring = cdiv(cfg.sliding_window + max_chunk - 1, block_size) + 1
        n_global = cdiv(max_tokens, block_size) + max_seqs if glob else 0
        n_local = min(ring, cdiv(max_tokens, block_size) + 1) * max_seqs if loc else 0
        return KVLayout(block_size, n_global, n_local, ring, glob, loc, cfg.n_kv_heads, cfg.head_dim)

    def pool_of(self, layer: int) -> tuple[str, int]:
        """('global' | 'local', slot) of a model layer."""
        if layer in self.global_layers:
            return "global", self.global_layers.index(layer)
        return "local", self.local_layers.index(layer)

    def bytes_per_block(self, itemsize: int) -> int:
        return 2 * self.block_size * self.n_kv_heads * self.head_dim * itemsize


class BlockPool:
    """A free list of block numbers."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))

    @property
    def n_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV pool exhausted: need {n} blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def give(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


@dataclass
class SeqBlocks:
    global_table: np.ndarray
    local_table: np.ndarray


class KVCacheManager:
    """Hands out block tables per sequence and tracks how much of the cache is in use."""

    def __init__(self, layout: KVLayout):
        self.layout = layout
        self.global_pool = BlockPool(layout.n_global_blocks)
        self.local_pool = BlockPool(layout.n_local_blocks)
        self._seqs: dict[int, SeqBlocks] = {}

    def blocks_needed(self, n_positions: int) -> tuple[int, int]:
        """(global, local) blocks a sequence of ``n_positions`` positions holds."""
        lay = self.layout
        g = cdiv(n_positions, lay.block_size) if lay.global_layers else 0
        loc = min(lay.ring_blocks, cdiv(n_positions, lay.block_size)) if lay.local_layers else 0
        return g, loc

    def can_reserve(self, n_positions: int) -> bool:
        g, loc = self.blocks_needed(n_positions)
        return g <= self.global_pool.n_free and loc <= self.local_pool.n_free

    def fits_ever(self, n_positions: int) -> bool:
        """Whether a sequence this long could ever be admitted (the pools' full size)."""
        g, loc = self.blocks_needed(n_positions)
        return g <= self.global_pool.n_blocks and loc <= self.local_pool.n_blocks

    def reserve(self, seq_id: int, n_positions: int) -> SeqBlocks:
        """Take every block a sequence of ``n_positions`` will need; raises MemoryError when short."""
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id} already holds KV blocks")
        g, loc = self.blocks_needed(n_positions)
        if not self.can_reserve(n_positions):
            raise MemoryError(f"KV cache full: sequence needs {g}+{loc} blocks")
        blocks = SeqBlocks(
            np.asarray(self.global_pool.take(g), dtype=np.int32),
            np.asarray(self.local_pool.take(loc), dtype=np.int32),
        )
        self._seqs[seq_id] = blocks
        return blocks

    def release(self, seq_id: int) -> None:
        blocks = self._seqs.pop(seq_id, None)
        if blocks is not None:
            self.global_pool.give(blocks.global_table.tolist())
            self.local_pool.give(blocks.local_table.tolist())

    def tables(self, seq_id: int) -> SeqBlocks:
        return self._seqs[seq_id]

    def usage(self) -> dict[str, int]:
        return {
            "global_blocks_used": self.global_pool.n_blocks - self.global_pool.n_free,
            "global_blocks": self.global_pool.n_blocks,
            "local_blocks_used": self.local_pool.n_blocks - self.local_pool.n_free,
            "local_blocks": self.local_pool.n_blocks,
            "sequences": len(self._seqs),
        }
