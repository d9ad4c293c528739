"""Recording a bucket: ``net.forward`` run once on a shape-only batch, the ops appending to a command buffer.

With no recording for a key ``(T_b, O_b)`` (graph.py), ``net.forward`` runs *once* on a batch of ``T_b``
padding rows while the ops (ops_norm, ops_matmul, ops_attention, through the facade) append dispatches to a
:class:`CommandRecorder` instead of computing; activations are :class:`~.activations.Act` handles. Later steps
of the bucket skip ``net.forward`` entirely: no Python per op on the hot path. The recording is begun with
SIMULTANEOUS_USE, since two steps of one bucket can be pending at once (backend.py, "Pipelining"); its two
argmax tails (one per parity) are made with it.

Every per-step value is read by the shaders from the step metadata at word offsets baked into the recorded
push constants (:class:`StepMetaLayout` ``(T_b, T_b, max_table)``), so a recording is valid for any batch of
its bucket; growing the metadata buffers drops every recording (:meth:`Recordings.ensure_meta`).
"""

from __future__ import annotations

import numpy as np

from hmad.backends.vulkan.context import RecordContext
from hmad.backends.vulkan.graph import Graph, bucket
from hmad.backends.vulkan.recorder import CommandRecorder
from hmad.backends.vulkan.stepmeta import StepMetaLayout
from hmad.backends.vulkan.tails import argmax_chunks, argmax_tail
from hmad.core.batch import StepBatch

# attention_prefill.comp (tiles of a step's prefill rows, K/V chunks shared by a tile) in buckets of at least
# this many rows, for sequences with at least this many rows in the step; the others keep the per-row kernels.
# Not in decode-batch buckets (<= 32): its dispatch costs even when no row is in a tile (docs/tuning.md)
ATTENTION_TILE_MIN_BUCKET = 64
ATTENTION_TILE_MIN_ROWS = 8


class Recordings:
    """A backend's recorded graphs by bucket key, and the metadata buffers they bind (sized for them)."""

    def __init__(self, ctx: RecordContext):
        self.ctx = ctx
        self.graphs: dict[tuple[int, int], Graph] = {}
        self.count = 0  # forward passes recorded (a replay test counts them)
        self.logit_rows_b = 1  # logit rows a step computes at least (prepare: the scheduler's sequences)

    def meta_layout(self, t_b: int) -> StepMetaLayout:
        """The metadata layout of bucket ``t_b``: with prefill-attention tiles from ATTENTION_TILE_MIN_BUCKET
        rows (sequences of at least ATTENTION_TILE_MIN_ROWS rows go in tiles); block-table words for at
        most ``t_b`` sequences."""
        det = self.ctx.options.deterministic
        tiles = ATTENTION_TILE_MIN_ROWS if t_b >= ATTENTION_TILE_MIN_BUCKET and not det else 0
        return StepMetaLayout(t_b, t_b, self.ctx.kv_layout.max_table_entries(t_b), tile_min_rows=tiles)

    def ensure_meta(self, t_b: int) -> None:
        """The metadata buffer holds the layout of bucket ``t_b``; growing it drops every recording."""
        words = self.meta_layout(t_b).words
        if self.ctx.meta_fits(words):
            return
        self.drop()  # (waits for the steps in flight: their ids stay readable, RecordContext.grow_meta)
        self.ctx.grow_meta(words, t_b)

    def for_batch(self, net, batch: StepBatch) -> Graph:
        """The graph of ``batch``'s bucket, recorded now where there is none."""
        t_b = bucket(max(1, batch.n_tokens))
        o_b = min(bucket(max(self.logit_rows_b, len(batch.logit_rows))), t_b)
        graph = self.graphs.get((t_b, o_b))
        if graph is None:  # (a recording's metadata fits: growing the buffer drops every recording)
            self.ensure_meta(t_b)
            graph = self.record(net, t_b, o_b)
        return graph

    def record(self, net, t_b: int, o_b: int) -> Graph:
        """Record bucket ``(t_b, o_b)`` (its metadata fits the buffers: ``ensure_meta``) and its argmax
        tails."""
        ctx = self.ctx
        layout = self.meta_layout(t_b)
        for k in ctx.kernels.values():  # sets of buffers closed since (KV pools re-planned, metadata grown)
            k.forget_closed()
        rec = CommandRecorder(ctx.dev, timestamps=ctx.options.timestamps, max_commands=8192).begin(
            simultaneous=True
        )
        if ctx.options.fused("qout"):  # the counters are zero already, unless a step was cut off mid-dispatch
            rec.fill(ctx.counters.whole(), 0, label="arrival counters")
        shape_batch = StepBatch(
            tokens=np.zeros(t_b, np.int32),
            positions=np.zeros(t_b, np.int32),
            seqs=[],
            logit_rows=np.zeros(o_b, np.int32),
            block_size=ctx.kv_layout.block_size,
        )
        with ctx.recording(rec, layout, t_b):
            try:
                logits = net.forward(shape_batch)
                rec.end()
            except BaseException:
                rec.close()
                raise
        chunks = argmax_chunks(ctx, logits)
        tails = (argmax_tail(ctx, logits, 0, chunks), argmax_tail(ctx, logits, 1, chunks))
        graph = Graph((t_b, o_b), layout, rec, logits, tails, argmax_chunks=chunks)
        self.graphs[graph.key] = graph
        self.count += 1
        return graph

    def drop(self) -> None:
        """Close every recording (after the device is idle)."""
        if self.graphs:
            self.ctx.dev.wait_idle()
        for g in self.graphs.values():
            g.close()
        self.graphs = {}
