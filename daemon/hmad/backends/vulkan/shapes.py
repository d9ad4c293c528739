"""Shapes of the non-matmul kernels that the Python side must agree with: how the top-k and argmax tails
chunk a row, how attention_prefill tiles its dispatch, how residual_norm sizes its workgroup.

(The head dims, groups and layouts each kernel is *built* for are variant lists: variants.py.)
"""

from __future__ import annotations

from hmad.backends.vulkan.stepmeta import TILE_ROWS

TOPK_MAX = 256  # KMAX of topk.comp
# topk.comp's first stage: about TOPK_GROUPS workgroups in all, TOPK_CHUNKS_RANGE a row, chunks of at least
# TOPK_MIN_CHUNK columns; argmax.comp's: ARGMAX_CHUNKS a row: a row in chunks runs ~10x faster than one
# workgroup reading it all (bench_vulkan_topk.py; docs/tuning.md)
TOPK_GROUPS = 128
TOPK_CHUNKS_RANGE = (4, 32)
TOPK_MIN_CHUNK = 256
ARGMAX_CHUNKS = 64


def topk_chunks(rows: int, groups: int = TOPK_GROUPS) -> int:
    """topk.comp's first-stage chunks a row for ``rows`` rows."""
    lo, hi = TOPK_CHUNKS_RANGE
    return min(hi, max(lo, groups // max(1, rows)))


def topk_chunk(vocab: int, chunks: int) -> int:
    """Columns a first-stage workgroup of topk.comp or argmax.comp takes for about ``chunks`` a row;
    ``vocab`` or more: one stage."""
    return max(TOPK_MIN_CHUNK, -(-vocab // max(1, chunks)))


#: attention_prefill.comp: query vectors (tile rows x query heads of a KV head) per workgroup ...
ATTENTION_PREFILL_QV = 32
ATTENTION_PREFILL_TILE = TILE_ROWS  # ... and rows of a tile
#: attention_split_l1.comp (CPU implementations): (token, KV head, slice, split) items a workgroup
ATTENTION_ONE_LANE_BLOCK = 64


def attention_prefill_groups(max_tiles: int, g: int, n_kv_heads: int, n_splits: int) -> int:
    """Workgroups of an attention_prefill dispatch: (tile, sub-tile of QV / G rows, KV head, split); with
    QV = ATTENTION_PREFILL_TILE a tile has G sub-tiles."""
    assert ATTENTION_PREFILL_QV == ATTENTION_PREFILL_TILE and ATTENTION_PREFILL_QV % g == 0
    return max_tiles * g * n_kv_heads * n_splits


#: residual_norm.comp: one row per workgroup, up to 4 * WORDS (2) values per invocation held in registers
RESIDUAL_BLOCK = 1024
RESIDUAL_WORDS = 2  # vec4s of a row an invocation holds (WORDS in residual_norm.comp)
RESIDUAL_MAX_COLS = 4 * RESIDUAL_WORDS * RESIDUAL_BLOCK


def residual_block(d: int) -> int:
    """residual_norm's workgroup size for rows of ``d`` values: enough invocations for RESIDUAL_WORDS vec4s
    each, in whole 64s (a 640-wide row on 128, not 1024 of which 864 idle through the row sums)."""
    return min(RESIDUAL_BLOCK, -(-d // (4 * RESIDUAL_WORDS * 64)) * 64)
