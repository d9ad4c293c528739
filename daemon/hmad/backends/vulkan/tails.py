"""The small command buffers around a recorded forward pass in a step's submit: the *head* before it, the
readback *tails* after it.

A step's head copies its parity's mapped metadata into the device-local copy every kernel reads, then (when
the batch has ``feed`` rows) runs feed_tokens.comp, which writes into the tokens section the ids the step
before it (the other parity) computed. A tail reads the logits back in one of four forms: the argmax into
the parity's id buffer (argmax.comp; one per parity, made with the recording), the logit rows copied into a
host-visible buffer, the top-k candidates (topk.comp) with each row's log-sum-exp (row_lse.comp: a
token's logprob is its candidate value minus it) and its logit of one given token (row_gather.comp: the
metadata's ``targets``, a prompt token whose logprob is asked for), or each row's token drawn on the device
from its top-k (sample_topk.comp, with the row's sampling and uniform from the metadata's ``sample``
section) into the parity's ids, its candidates readable too. Rows longer than a chunk take two stages, the
first stage's candidates in a device-local buffer of the graph that its tails share (steps run one after
another).
The argmax, top-k and sample tails first add the step's logit adjustments (bias.py) to the rows, so each is
recorded per parity (the parity's adjustments buffer); the copy tail reads the rows as computed.
:class:`Readback` holds the host-visible buffers the last three write, and re-records a graph's tail when
its buffer had to grow.
"""

from __future__ import annotations

import numpy as np

from hmad.backends.vulkan import bias
from hmad.backends.vulkan.activations import Act, rows
from hmad.backends.vulkan.context import RecordContext
from hmad.backends.vulkan.graph import Graph
from hmad.backends.vulkan.memory import BufferView, create_buffer
from hmad.backends.vulkan.memory_plan import align_up
from hmad.backends.vulkan.push import (
    ArgmaxPush,
    FeedPush,
    LogitBiasPush,
    RowGatherPush,
    RowLsePush,
    SampleTopkPush,
    TopkPush,
)
from hmad.backends.vulkan.recorder import CommandRecorder
from hmad.backends.vulkan.shapes import ARGMAX_CHUNKS, topk_chunk, topk_chunks

# candidates per row of the on-device top-k (topk.comp): Gemma's top_k 64 plus up to 64 penalized tokens
TOPK_CANDIDATES = 128


def aligned(ctx: RecordContext, nbytes: int) -> int:
    """``nbytes`` rounded up to the device's storage-buffer offset alignment."""
    return align_up(nbytes, ctx.align)


def pair(ctx: RecordContext, nbytes: int, name: str) -> BufferView:
    """A device-local buffer of two parts of ``nbytes`` (:func:`parts`): a two-stage tail's first-stage
    indices and values."""
    return create_buffer(ctx.dev, aligned(ctx, nbytes) + nbytes, "device", name)


def parts(ctx: RecordContext, buf: BufferView, nbytes: int) -> tuple[BufferView, BufferView]:
    """The two parts of a :func:`pair` buffer (the second at the next aligned offset)."""
    at = aligned(ctx, nbytes)
    assert buf.nbytes >= at + nbytes, f"{buf.name}: {buf.nbytes} bytes, {at + nbytes} needed"
    return tuple(BufferView(buf.arena, buf.offset + o, nbytes, name=buf.name) for o in (0, at))


def argmax_chunks(ctx: RecordContext, logits: Act, name: str = "argmax per chunk") -> BufferView | None:
    """The first stage's (rows, chunks) two partials (argmax.comp: indices then values; row_lse.comp:
    maxima then sums: :func:`reduce_rows`), where a row takes two stages; None where it takes one."""
    n_rows, vocab = logits.shape
    chunks = -(-vocab // topk_chunk(vocab, ARGMAX_CHUNKS))
    return None if chunks == 1 else pair(ctx, 4 * n_rows * chunks, name)


def add_bias(ctx: RecordContext, tail: CommandRecorder, logits: Act, parity: int) -> None:
    """Append logit_bias.comp over ``logits`` (rows, V) with ``parity``'s entries (bias.py), then a barrier
    (the tail's readers come next); after the tail's first barrier."""
    n_rows, vocab = logits.shape
    k = ctx.kernel("logit_bias")
    push = LogitBiasPush(n_rows, vocab, vocab, bias.BIAS_ENTRIES)
    tail.dispatch(k, [logits.view, ctx.biases[parity]], push, k.groups_for(bias.BIAS_GROUPS))
    tail.barrier()


def argmax_tail(ctx: RecordContext, logits: Act, parity: int, scratch: BufferView | None) -> CommandRecorder:
    """argmax.comp over ``logits`` plus ``parity``'s adjustments into ``ids[parity]``: one stage, or each
    chunk's best into ``scratch`` (shared by both parities' tails: steps run one after another), then
    theirs."""
    tail = CommandRecorder(ctx.dev).begin()
    tail.barrier()  # after the forward pass's command buffer in the same submit
    add_bias(ctx, tail, logits, parity)
    reduce_rows(ctx, tail, "argmax", ArgmaxPush, logits, ctx.ids[parity], scratch, merge_reads="second")
    return tail.end()


def reduce_rows(
    ctx: RecordContext,
    tail: CommandRecorder,
    family: str,
    push_type,
    logits: Act,
    out: BufferView,
    scratch: BufferView | None,
    merge_reads: str,
) -> None:
    """Append a row reduction of ``logits`` (rows, V) into ``out`` (rows,) at argmax's chunks: kernel
    ``<family>_f32`` in one stage (``scratch`` None), or ``<family>_chunks_f32`` writing each (row, chunk)'s
    two partials into ``scratch``'s :func:`parts`, then ``<family>_merge_f32``, which binds the part named
    by ``merge_reads`` ("first" or "second") before ``out`` and the other after it (argmax.comp: values,
    out, ids; row_lse.comp: maxima, out, sums)."""
    n_rows, vocab = logits.shape
    if scratch is None:
        k = ctx.kernel(f"{family}_f32")
        tail.dispatch(k, [logits.view, out], push_type(n_rows, vocab, vocab, vocab), k.groups_for(n_rows))
        return
    chunk = topk_chunk(vocab, ARGMAX_CHUNKS)
    n = -(-vocab // chunk)
    a, b = parts(ctx, scratch, 4 * n_rows * n)
    first, merge = ctx.kernel(f"{family}_chunks_f32"), ctx.kernel(f"{family}_merge_f32")
    tail.dispatch(
        first, [logits.view, a, b], push_type(n_rows, vocab, vocab, chunk), first.groups_for(n_rows * n)
    )
    read, other = (a, b) if merge_reads == "first" else (b, a)
    tail.dispatch(merge, [read, out, other], push_type(n_rows, n, n, n), merge.groups_for(n_rows))


def head(ctx: RecordContext, graph: Graph, parity: int, feed: bool) -> CommandRecorder:
    """The command buffer before ``graph``'s in a submit of ``parity``: after the steps before it, copy
    that parity's metadata into the device-local copy; with ``feed``, fill the fed rows' tokens from the
    other parity's ids (feed_tokens.comp)."""
    cmd = graph.heads.get((parity, feed))
    if cmd is None:
        lay = graph.layout
        cmd = CommandRecorder(ctx.dev).begin()
        cmd.barrier()  # the steps submitted before this one have read meta_gpu and written their ids
        cmd.copy(ctx.metas[parity], ctx.meta_gpu, lay.nbytes, label="step metadata to VRAM")
        if feed:
            k = ctx.kernel("feed_tokens")
            push = FeedPush(lay.tokens, lay.feed, lay.max_tokens, graph.logits.shape[1])
            cmd.dispatch(k, [ctx.meta_gpu, ctx.ids[1 - parity]], push, k.groups_for(1))
        cmd.barrier()  # before the forward pass reads it
        graph.heads[(parity, feed)] = cmd = cmd.end()
    return cmd


class Readback:
    """The host-visible buffers the copy, top-k and sample tails write, and those tails, per graph."""

    def __init__(self, ctx: RecordContext):
        self.ctx = ctx
        self.readback: BufferView | None = None
        # mapped: ids (rows, k) uint32, values (rows, k) float32, each row's lse (rows,), its target's logit
        # (rows,) (_layout)
        self.topk_buf: BufferView | None = None
        self.cands: list[BufferView | None] = [None, None]  # ids, values, per parity, for the sample tails

    def copy_tail(self, graph: Graph) -> CommandRecorder:
        """The logits -> host-visible readback copy of ``graph`` (re-made when the readback buffer grew)."""
        need = graph.logits.view.nbytes
        self.readback = self._buffer(self.readback, need, "logits readback")
        if graph.copy_into is not self.readback:
            if graph.copy_tail is not None:
                graph.copy_tail.close()
            tail = CommandRecorder(self.ctx.dev).begin()
            tail.barrier()
            tail.copy(graph.logits.view, self.readback, need)
            graph.copy_tail, graph.copy_into = tail.end(), self.readback
        return graph.copy_tail

    def logits(self, n_out: int, vocab: int) -> np.ndarray:
        """The copy tail's first ``n_out`` rows (n_out, vocab) float32, copied."""
        return self.readback.array(np.float32)[: n_out * vocab].reshape(n_out, vocab).copy()

    def _buffer(self, current: BufferView | None, need: int, label: str) -> BufferView:
        """``current`` if it holds ``need`` bytes, else a new host-visible readback buffer (``current``
        closed; the tails recorded against it are re-recorded by their owners)."""
        if current is not None and current.nbytes >= need:
            return current
        if current is not None:
            current.arena.close()
        return create_buffer(self.ctx.dev, need, "readback", label)

    def _layout(self, n_rows: int, vocab: int) -> tuple[int, int, int, int]:
        """(k, byte offsets of the values, of the log-sum-exps, of the targets' logits) in a candidates
        buffer: ids (rows, k) first, then values (rows, k), then (the top-k tail's) lse (rows,) and target
        logits (rows,), each aligned."""
        k = min(TOPK_CANDIDATES, vocab)
        half = aligned(self.ctx, 4 * n_rows * k)
        at = half + aligned(self.ctx, 4 * n_rows * k)
        return k, half, at, at + aligned(self.ctx, 4 * n_rows)

    def topk_tail(self, graph: Graph, parity: int) -> CommandRecorder:
        """The top-k tail of ``graph`` on ``parity``, each row's log-sum-exp and target's logit too (re-made
        when the candidates buffer grew)."""
        n_rows, vocab = graph.logits.shape
        *_, end = self._layout(n_rows, vocab)
        self.topk_buf = self._buffer(self.topk_buf, end + 4 * n_rows, "top-k candidates")
        tail, into = graph.topk_tails.get(parity, (None, None))
        if into is not self.topk_buf:
            if tail is not None:
                tail.close()
            tail = CommandRecorder(self.ctx.dev).begin()
            self._record_topk(tail, graph, self.topk_buf, parity, lse=True)
            tail = tail.end()
            graph.topk_tails[parity] = (tail, self.topk_buf)
        return tail

    def _record_topk(
        self, tail: CommandRecorder, graph: Graph, into: BufferView, parity: int, lse: bool = False
    ) -> tuple[BufferView, BufferView]:
        """Append, after a barrier, ``parity``'s logit adjustments (bias.py) then topk.comp over ``graph``'s
        logits writing the candidates buffer ``into`` (``_layout``), with ``lse`` row_lse.comp and
        row_gather.comp too (the rows' log-sum-exps and targets' logits after the adjustments); returns the
        (ids, values) views. A row longer than ``topk_chunk()`` takes two stages (the shader's header): its
        chunks' best into the graph's ``topk_chunks``, then their best."""
        ctx = self.ctx
        n_rows, vocab = graph.logits.shape
        k, half, at, gat = self._layout(n_rows, vocab)
        ids = rows(into, 0, 1, 4 * n_rows * k)
        vals = BufferView(into.arena, into.offset + half, 4 * n_rows * k, name="top-k values")
        first, merge = ctx.kernel("topk_f32"), ctx.kernel("topk_merge_f32")
        chunk = topk_chunk(vocab, topk_chunks(n_rows, ctx.options.topk_groups))
        chunks = -(-vocab // chunk)
        tail.barrier()
        add_bias(ctx, tail, graph.logits, parity)
        if lse:
            self._record_lse(
                tail, graph, BufferView(into.arena, into.offset + at, 4 * n_rows, name="top-k lse")
            )
            self._record_gather(
                tail, graph, BufferView(into.arena, into.offset + gat, 4 * n_rows, name="top-k targets")
            )
        if chunks == 1:
            push = TopkPush(n_rows, vocab, vocab, k, vocab)
            tail.dispatch(first, [graph.logits.view, ids, vals], push, first.groups_for(n_rows))
            return ids, vals
        if graph.topk_chunks is None:  # (rows, chunks, k) ids, then values: the first stage's candidates
            graph.topk_chunks = pair(ctx, 4 * n_rows * chunks * k, "top-k per chunk")
        c_ids, c_vals = parts(ctx, graph.topk_chunks, 4 * n_rows * chunks * k)
        push = TopkPush(n_rows, vocab, vocab, k, chunk)
        tail.dispatch(first, [graph.logits.view, c_ids, c_vals], push, first.groups_for(n_rows * chunks))
        tail.barrier()
        n = chunks * k
        push = TopkPush(n_rows, n, n, k, n)
        tail.dispatch(merge, [c_vals, ids, vals, c_ids], push, merge.groups_for(n_rows))
        return ids, vals

    def _record_lse(self, tail: CommandRecorder, graph: Graph, out: BufferView) -> None:
        """Append row_lse.comp over ``graph``'s logits (adjusted already) into ``out`` (rows,): one stage, or
        each chunk's (max, sum) into the graph's ``lse_chunks`` (argmax.comp's chunks: the same reduction's
        shape), then each row's merged."""
        if graph.lse_chunks is None:
            graph.lse_chunks = argmax_chunks(self.ctx, graph.logits, "lse per chunk")
        reduce_rows(self.ctx, tail, "row_lse", RowLsePush, graph.logits, out, graph.lse_chunks, "first")

    def _record_gather(self, tail: CommandRecorder, graph: Graph, out: BufferView) -> None:
        """Append row_gather.comp: each of ``graph``'s logit rows' (adjusted already) logit of its target
        token (the metadata's ``targets`` section) into ``out`` (rows,), NaN where it has none."""
        n_rows, vocab = graph.logits.shape
        assert n_rows <= graph.layout.max_seqs, "the targets section holds a word a logit row"
        k = self.ctx.kernel("row_gather_f32")
        push = RowGatherPush(n_rows, vocab, vocab, graph.layout.targets)
        tail.dispatch(k, [self.ctx.meta_gpu, graph.logits.view, out], push, k.groups_for(n_rows))

    def sample_tail(self, graph: Graph, parity: int) -> CommandRecorder:
        """``graph``'s sample tail on ``parity`` (re-made when that parity's candidates buffer grew)."""
        ctx = self.ctx
        n_rows, vocab = graph.logits.shape
        k, half, *_ = self._layout(n_rows, vocab)
        buf = self.cands[parity] = self._buffer(
            self.cands[parity], half + 4 * n_rows * k, f"sampled candidates {parity}"
        )
        tail, into = graph.sample_tails.get(parity, (None, None))
        if into is not buf:
            if tail is not None:
                tail.close()
            sample = ctx.kernel("sample_topk")
            assert k <= sample.block_size, "sample_topk takes a row's candidates one an invocation"
            tail = CommandRecorder(ctx.dev).begin()
            ids, vals = self._record_topk(tail, graph, buf, parity)
            tail.barrier()
            push = SampleTopkPush(n_rows, k, graph.layout.sample)
            binds = [ctx.meta_gpu, ids, vals, ctx.ids[parity]]
            tail.dispatch(sample, binds, push, sample.groups_for(n_rows))
            tail = tail.end()
            graph.sample_tails[parity] = (tail, buf)
        return tail

    def candidates(self, into: BufferView, graph: Graph, n_out: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``n_out`` rows of a candidates buffer: (ids int64, values float32), each (n_out, k)."""
        n_rows, vocab = graph.logits.shape
        k, half, *_ = self._layout(n_rows, vocab)
        buf = into.array(np.uint8)
        ids = buf[: 4 * n_rows * k].view(np.uint32).reshape(n_rows, k)[:n_out].astype(np.int64)
        vals = buf[half : half + 4 * n_rows * k].view(np.float32).reshape(n_rows, k)[:n_out].copy()
        return ids, vals

    def lse(self, graph: Graph, n_out: int) -> np.ndarray:
        """The top-k tail's first ``n_out`` log-sum-exps (n_out,) float32 (a row with no finite maximum:
        -inf; one with a +inf: +inf or NaN)."""
        return self._floats(graph, n_out, 2)

    def targets(self, graph: Graph, n_out: int) -> np.ndarray:
        """The top-k tail's first ``n_out`` targets' logits (n_out,) float32 (NaN on a row with none)."""
        return self._floats(graph, n_out, 3)

    def _floats(self, graph: Graph, n_out: int, part: int) -> np.ndarray:
        """The first ``n_out`` of the (rows,) float32 part at ``_layout()[part]`` of the top-k buffer."""
        n_rows, vocab = graph.logits.shape
        at = self._layout(n_rows, vocab)[part]
        return self.topk_buf.array(np.uint8)[at : at + 4 * n_rows].view(np.float32)[:n_out].copy()

    def close(self) -> None:
        for b in (self.readback, self.topk_buf, *self.cands):
            if b is not None:
                b.arena.close()
        self.readback = self.topk_buf = None
        self.cands = [None, None]
