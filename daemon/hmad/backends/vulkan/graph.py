"""Step buckets and their recordings: a step of T tokens and S_out logit rows runs the recording of
``(bucket(T), bucket(S_out))`` (:class:`Graph`), replayed for every batch of its bucket.

Buckets: T tokens -> ``T_b`` (1, 2, 4 ... 512, then multiples of 512), S_out logit rows -> ``O_b`` (the same
ladder, at least 1). :class:`StepOutput` is what ``run`` returns (the graph and the real batch's row count),
:class:`Launched` a submitted step that ``collect`` waits for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hmad.backends.vulkan.activations import Act
from hmad.backends.vulkan.memory import BufferView
from hmad.backends.vulkan.recorder import CommandRecorder
from hmad.backends.vulkan.stepmeta import StepMetaLayout

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def bucket(n: int) -> int:
    """The padded size of ``n`` rows: the next of :data:`BUCKETS`, then multiples of the largest."""
    for b in BUCKETS:
        if n <= b:
            return b
    return -(-n // BUCKETS[-1]) * BUCKETS[-1]


def buckets_upto(top: int) -> list[int]:
    """Every bucket a step of at most ``top`` tokens can fall in, ascending."""
    return sorted({b for b in BUCKETS if b <= top} | set(range(BUCKETS[-1], top + 1, BUCKETS[-1])) | {top})


@dataclass
class Graph:
    """One bucket's recording: the forward pass, its logits handle, and the two readback tails."""

    key: tuple[int, int]
    layout: StepMetaLayout
    rec: CommandRecorder
    logits: Act
    argmax_tails: tuple[CommandRecorder, CommandRecorder]  # into ids[0], ids[1]
    heads: dict[tuple[int, bool], CommandRecorder] = field(default_factory=dict)  # (parity, feed): _head
    copy_tail: CommandRecorder | None = None
    copy_into: BufferView | None = None  # the readback buffer copy_tail writes (re-record when it changed)
    # per parity: the top-k tail and the candidates buffer it writes (re-record when it changed)
    topk_tails: dict[int, tuple[CommandRecorder, BufferView]] = field(default_factory=dict)
    # per parity: the sample tail (launch_sampled) and the candidates buffer it writes
    sample_tails: dict[int, tuple[CommandRecorder, BufferView]] = field(default_factory=dict)
    # the top-k's first-stage candidates (device-local), shared by its tails: they run one after another
    topk_chunks: BufferView | None = None
    argmax_chunks: BufferView | None = None  # likewise for the argmax tails (argmax.comp's two stages)
    lse_chunks: BufferView | None = None  # and the top-k tails' log-sum-exps (row_lse.comp's two stages)

    def close(self) -> None:
        tails = [t for t, _ in (*self.sample_tails.values(), *self.topk_tails.values())]
        for r in (self.rec, *self.argmax_tails, *self.heads.values(), self.copy_tail, *tails):
            if r is not None:
                r.close()
        for buf in (self.topk_chunks, self.argmax_chunks, self.lse_chunks):
            if buf is not None:
                buf.arena.close()
        self.topk_chunks = self.argmax_chunks = self.lse_chunks = None


class StepOutput:
    """What ``run`` returns: the step's logits handle, the real row count and the graph to submit; ``used``
    metadata words packed, ``feed``: whether rows take their token from the step before (launch_greedy);
    ``bias_words`` of logit adjustments packed (bias.py), ``bias_ok``: whether they all fit the buffer (else a
    tail that adds them must not run); ``embeds``: the step's input embeddings (R, D) float32 or None, written
    into the embeds buffer at launch (steps.py)."""

    __slots__ = ("graph", "n_out", "shape", "used", "feed", "bias_words", "bias_ok", "embeds")

    def __init__(self, graph: Graph, n_out: int, vocab: int, used: int = 0, feed: bool = False):
        self.graph, self.n_out, self.shape = graph, n_out, (n_out, vocab)
        self.used, self.feed = used, feed
        self.bias_words, self.bias_ok = 4, True
        self.embeds = None


@dataclass(frozen=True)
class Launched:
    """A submitted step (``launch_greedy``, ``launch_sampled``): its parity, the id rows ``collect`` reads
    back, and whether it sampled (its candidates are readable: ``candidates``)."""

    parity: int
    n_out: int
    graph: Graph
    sampled: bool = False
