"""Step metadata: the per-step values of a :class:`~hmad.core.batch.StepBatch` as one uint32 array.

The recorded forward pass keeps one host-visible buffer of this layout per batch-size bucket; each step the
host writes :meth:`StepMetaLayout.pack` into it and replays. The layout is fixed by the bucket's capacities
(``max_tokens`` rows, ``max_seqs`` sequences, ``max_table`` block-table entries, ``tile_min_rows``), so
every section's word offset is a constant recorded into the push constants of the kernels that read it; the
shaders bind the whole buffer and index ``meta[section_off + i]``. Layout, in uint32 words (T = max_tokens,
S = max_seqs)::

    header      [0, 8)            n_tokens, n_seqs, block_size B, n_logit_rows, embeds_row0 (the input
                                  embeddings buffer's row of the step's vector 0: set at launch, for the
                                  launch's parity), 3 words reserved (0)
    tokens      [8, 8+T)          token id of row t                               embed.comp (ids_off)
    positions   +T                position of row t in its sequence               rope.comp, attention_split
    seq         +T                sequence index s of row t (0..n_seqs-1)         attention_split (seq_off)
    slot_global +T                global-pool KV slot of row t's position         kv_write.comp (slot_off)
    slot_local  +T                local-pool (ring) KV slot of row t's position   kv_write.comp (slot_off)
    info_global +2S               per sequence: (table start, table entries)      attention_split (info_off)
    info_local  +2S               per sequence: (ring start, ring entries R)      attention_split (info_off)
    logit_rows  +S                rows whose logits the step returns (argmax/gather)
    targets     +S                per logit row: 1 + the token whose logit the top-k tail gathers (a
                                  prompt token, batch.StepBatch.targets; 0: none)  row_gather.comp
    visible     +T                1 + the last key position row t's query sees (StepBatch.visible: an
                                  image's soft tokens see their whole image); 0: its own   attention
    embed_src   +T                1 + the index of row t's vector in the step's input embeddings
                                  (StepBatch.embeds, read from the embeds buffer at embeds_row0 + index);
                                  0: the token's embedding                        embed*_in (src_off)
    tiled       +T                1 where row t is in a tile (its attention is attention_prefill's)
    tiles       +3 max_tiles      per tile: (sequence, first row, rows <= TILE_ROWS)   attention_prefill
    feed        +T                1 + the row of the previous step's ids whose token row t takes (0: the
                                  token above)                                    feed_tokens.comp
    sample      +5S               per logit row: temperature, top_k, top_p, min_p, the draw's uniform
                                  (batch.SAMPLE_DTYPE; zeros when the step has none) sample_topk.comp
    tables      +max_table        the block tables, flattened: each sequence's global table, then its ring

- A table start is an absolute word index into the buffer (``tables`` offset included), so a shader reads
  block ``meta[start + (p // B) % entries]``; position p of a sequence is in slot ``block * B + p % B``.
  Global tables cover every position (the modulo never wraps); a local ring of R blocks wraps.
- A layer's pool picks the section: a global layer's kernels get ``slot_global``/``info_global`` offsets, a
  sliding-window layer's ``slot_local``/``info_local``. Slots are computed on the host (one per row).
- Rows ``n_tokens..T-1`` are padding: token 0, position 0, sequence and both slots ``NONE`` (0xFFFFFFFF):
  kv_write skips them, attention writes zeros. Unused sequences are 0.
- Tiles (prefill attention): a sequence with at least ``tile_min_rows`` rows in the step is cut into tiles of
  up to :data:`TILE_ROWS` consecutive rows; attention_prefill.comp takes those rows (one workgroup shares
  each K/V chunk among a tile's rows) and the per-row kernels skip them (``tiled`` = 1). Unused tile entries
  are zeros (0 rows). ``tile_min_rows`` 0: no tiles, ``max_tiles`` 0.
- Visible rows (Gemma 3's bidirectional image attention): a row sees keys ``[lo, last]``, ``last`` its
  ``visible`` entry (else its position), ``lo`` from its own position (the sliding window never moves). The
  engine ends no chunk inside an image, so every key a row sees is written by the step's cache write.
- Input embeddings: the step's vectors are in the backend's mapped embeds buffer (two halves, one per
  parity: RecordContext.input_embeds), written at launch with header word ``embeds_row0``; a row with
  ``embed_src`` 0 never reads it.
- Every section before ``tables`` is rewritten each step (zeros where unused); the tables section only as far
  as the step's sequences use it (no kernel reads past a sequence's entries).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from hmad.core.batch import SAMPLE_DTYPE, StepBatch

NONE = 0xFFFFFFFF
HEADER_WORDS = 8
#: the header word holding the embeds buffer's row of the step's input embedding 0 (written at launch)
EMBEDS_ROW0 = 4
SAMPLE_WORDS = SAMPLE_DTYPE.itemsize // 4
#: rows of one prefill-attention tile (attention_prefill.comp: TILE_ROWS)
TILE_ROWS = 32


@dataclass(frozen=True)
class StepMetaLayout:
    """Word offsets of the sections for a bucket of capacities (see the module docstring); each computed once
    (a step's pack reads them dozens of times)."""

    max_tokens: int
    max_seqs: int
    max_table: int
    tile_min_rows: int = 0  # a sequence of at least this many rows in the step goes in tiles (0: none)

    @cached_property
    def max_tiles(self) -> int:
        """Tiles a step can need: sum of ceil(n_i / TILE_ROWS) <= T // TILE_ROWS + T // tile_min_rows."""
        if not self.tile_min_rows:
            return 0
        return self.max_tokens // TILE_ROWS + self.max_tokens // self.tile_min_rows

    @cached_property
    def tokens(self) -> int:
        return HEADER_WORDS

    @cached_property
    def positions(self) -> int:
        return self.tokens + self.max_tokens

    @cached_property
    def seq(self) -> int:
        return self.positions + self.max_tokens

    @cached_property
    def slot_global(self) -> int:
        return self.seq + self.max_tokens

    @cached_property
    def slot_local(self) -> int:
        return self.slot_global + self.max_tokens

    @cached_property
    def info_global(self) -> int:
        return self.slot_local + self.max_tokens

    @cached_property
    def info_local(self) -> int:
        return self.info_global + 2 * self.max_seqs

    @cached_property
    def logit_rows(self) -> int:
        return self.info_local + 2 * self.max_seqs

    @cached_property
    def targets(self) -> int:
        return self.logit_rows + self.max_seqs

    @cached_property
    def visible(self) -> int:
        return self.targets + self.max_seqs

    @cached_property
    def embed_src(self) -> int:
        return self.visible + self.max_tokens

    @cached_property
    def tiled(self) -> int:
        return self.embed_src + self.max_tokens

    @cached_property
    def tiles(self) -> int:
        return self.tiled + self.max_tokens

    @cached_property
    def feed(self) -> int:
        return self.tiles + 3 * self.max_tiles

    @cached_property
    def sample(self) -> int:
        return self.feed + self.max_tokens

    @cached_property
    def tables(self) -> int:
        return self.sample + SAMPLE_WORDS * self.max_seqs

    @cached_property
    def words(self) -> int:
        return self.tables + self.max_table

    @cached_property
    def nbytes(self) -> int:
        return 4 * self.words

    def used_words(self, batch: StepBatch) -> int:
        """The words :meth:`pack` writes for ``batch``: every section, and the tables its sequences use."""
        return self.tables + sum(len(q.global_table) + len(q.local_table) for q in batch.seqs)

    def pack(self, batch: StepBatch, out: np.ndarray | None = None) -> np.ndarray:
        """The batch as this layout's uint32 words, written into ``out`` (e.g. the mapped buffer) if given."""
        t, s = batch.n_tokens, len(batch.seqs)
        n_table = self.used_words(batch) - self.tables
        if t > self.max_tokens or s > self.max_seqs or n_table > self.max_table:
            raise ValueError(
                f"step of {t} tokens, {s} sequences, {n_table} table entries exceeds the bucket {self}"
            )
        m = np.zeros(self.words, np.uint32) if out is None else out
        m[: self.tables] = 0  # the tables' unused entries are never read: a step writes what it uses
        m[:HEADER_WORDS] = [t, s, batch.block_size, len(batch.logit_rows), 0, 0, 0, 0]
        m[self.tokens : self.tokens + t] = batch.tokens
        m[self.positions : self.positions + t] = batch.positions
        for sec in (self.seq, self.slot_global, self.slot_local):
            m[sec + t : sec + self.max_tokens] = NONE
        at = self.tables
        for i, q in enumerate(batch.seqs):
            m[self.seq + q.start : self.seq + q.start + q.n] = i
            for table, info, slots in (
                (q.global_table, self.info_global, self.slot_global),
                (q.local_table, self.info_local, self.slot_local),
            ):
                at = self._pack_table(m, batch.block_size, q, table, info + 2 * i, slots, at)
        m[self.logit_rows : self.logit_rows + len(batch.logit_rows)] = batch.logit_rows
        if batch.targets is not None:
            assert len(batch.targets) == len(batch.logit_rows), "one target (or -1) a logit row"
            m[self.targets : self.targets + len(batch.targets)] = batch.targets + 1
        self._pack_images(batch, m)
        self._pack_tiles(batch, m)
        if batch.feed is not None:
            rows = np.flatnonzero(batch.feed >= 0)
            m[self.feed + rows] = batch.feed[rows] + 1
        if batch.sampling is not None:
            assert len(batch.sampling) == len(batch.logit_rows), "one sampling entry a logit row"
            words = np.ascontiguousarray(batch.sampling, SAMPLE_DTYPE).view(np.uint32)
            m[self.sample : self.sample + words.size] = words
        return m

    @staticmethod
    def _pack_table(
        m: np.ndarray, block_size: int, q, table: np.ndarray, info: int, slots: int, at: int
    ) -> int:
        """Sequence ``q``'s block ``table`` at word ``at`` (its (start, entries) at ``info``) and the KV slots
        of its rows (section ``slots``); returns the next free table word. A decode row's one slot is
        computed in plain integers (numpy's per-call cost is most of a small step's metadata)."""
        n, r0 = len(table), slots + q.start
        m[info] = at
        m[info + 1] = n
        m[at : at + n] = table
        if not n:
            m[r0 : r0 + q.n] = NONE
        elif q.n == 1:
            p = q.pos0
            m[r0] = int(table[(p // block_size) % n]) * block_size + p % block_size
        else:
            m[r0 : r0 + q.n] = kv_slots(table, np.arange(q.pos0, q.end_pos), block_size)
        return at + n

    def _pack_images(self, batch: StepBatch, m: np.ndarray) -> None:
        """The ``visible`` and ``embed_src`` words of an image's soft tokens' rows (zeros elsewhere)."""
        if batch.visible is not None:
            m[self.visible : self.visible + batch.n_tokens] = np.asarray(batch.visible, np.int64) + 1
        if batch.embeds is not None:
            rows = np.asarray(batch.embed_rows)
            assert len(rows) == len(batch.embeds) and (rows < batch.n_tokens).all(), "one vector a row"
            m[self.embed_src + rows] = np.arange(1, len(rows) + 1)

    def _pack_tiles(self, batch: StepBatch, m: np.ndarray) -> None:
        """The ``tiled`` flags and the ``tiles`` entries of the sequences long enough for tiles."""
        if not self.tile_min_rows:
            return
        tiles = [
            (i, r0, min(TILE_ROWS, q.start + q.n - r0))
            for i, q in enumerate(batch.seqs)
            if q.n >= self.tile_min_rows
            for r0 in range(q.start, q.start + q.n, TILE_ROWS)
        ]
        assert len(tiles) <= self.max_tiles
        for _, r0, n in tiles:
            m[self.tiled + r0 : self.tiled + r0 + n] = 1
        if tiles:
            m[self.tiles : self.tiles + 3 * len(tiles)] = np.asarray(tiles, np.uint32).ravel()


def kv_slots(table: np.ndarray, pos: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot of each position: block table[(p // B) % len(table)], offset p % B."""
    return table[(pos // block_size) % len(table)] * block_size + pos % block_size
