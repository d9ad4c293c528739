"""KVLayout: the shape of a backend's paged KV pools, which the engine sizes and the backends allocate.

Gemma 3's global layers and sliding-window layers get separate pools of blocks of B positions (the
tables that index them: ``hmad.engine.kvcache``'s docstring).
"""

from __future__ import annotations

from dataclasses import dataclass

from hmad.core.model_config import ModelConfig


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVLayout:
    """Shape of the backend's KV pools: per pool (layers, blocks, block_size, kv_heads, head_dim)."""

    block_size: int
    n_global_blocks: int
    n_local_blocks: int
    ring_blocks: int  # R: local-table entries of a sequence (the window plus one chunk, in blocks)
    global_layers: tuple[int, ...]  # model layer index of each global-pool layer slot
    local_layers: tuple[int, ...]
    n_kv_heads: int
    head_dim: int
    window: int = 0  # W of the sliding-window layers (0: unknown; needed by KVCacheManager.admit)
    max_seqs: int = 0  # sequences of one step (0: unknown; bounds max_table_entries)

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
        return KVLayout(
            block_size=block_size,
            n_global_blocks=n_global,
            n_local_blocks=n_local,
            ring_blocks=ring,
            global_layers=glob,
            local_layers=loc,
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            window=cfg.sliding_window,
            max_seqs=max_seqs,
        )

    def pool_of(self, layer: int) -> tuple[str, int]:
        """('global' | 'local', slot) of a model layer."""
        if layer in self.global_layers:
            return "global", self.global_layers.index(layer)
        return "local", self.local_layers.index(layer)

    def bytes_per_block(self, itemsize: int) -> int:
        return 2 * self.block_size * self.n_kv_heads * self.head_dim * itemsize

    def max_table_entries(self, n_seqs: int | None = None) -> int:
        """Block-table entries a step of at most ``n_seqs`` sequences (default and at most ``max_seqs``) can
        carry: sequences sharing cached blocks each list them, so each may list a whole pool's worth."""
        if not self.max_seqs:
            return self.n_global_blocks + self.n_local_blocks + 1
        per_seq = (self.n_global_blocks if self.global_layers else 0) + (
            self.ring_blocks if self.local_layers else 0
        )
        return min(n_seqs or self.max_seqs, self.max_seqs) * per_seq + 1
