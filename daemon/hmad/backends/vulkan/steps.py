"""Submitting recorded steps: a step's metadata packed, its head, forward pass and tail in one vkQueueSubmit,
one fence wait.

Pipelining (engine/scheduler.py, "Pipelining"): the scheduler may submit step n + 1 before it has read step
n's token ids. So the host side of a step comes in two parities: two mapped metadata buffers, two id buffers,
two halves of the input embeddings buffer (RecordContext), two fences, and per recording two heads and two
argmax tails (tails.py). At most two steps are in flight; ``wait`` takes them in any order, each once.
"""

from __future__ import annotations

import numpy as np
import vulkan as vk

from hmad.backends.vulkan import bias
from hmad.backends.vulkan.context import RecordContext
from hmad.backends.vulkan.graph import Graph, Launched, StepOutput
from hmad.backends.vulkan.placement import Placement
from hmad.backends.vulkan.recorder import CommandRecorder
from hmad.backends.vulkan.stepmeta import EMBEDS_ROW0
from hmad.backends.vulkan.tails import head
from hmad.backends.vulkan.vkerrors import check
from hmad.backends.vulkan.vkffi import ffi, lib, new
from hmad.core.batch import StepBatch


class Submitter:
    """The fences, parity and steps in flight of a backend; packs, submits and waits for its steps."""

    def __init__(self, ctx: RecordContext, placement: Placement):
        self.ctx, self.placement = ctx, placement
        self.fences = [ctx.dev.create_fence() for _ in range(2)]
        self._fences = [ffi.new("VkFence[]", [f]) for f in self.fences]
        self.in_flight: list[Launched | None] = [None, None]
        self.parity = 0  # of the next launch
        # a step's metadata packed here, then copied into its parity's mapped buffer at launch
        self._meta_host = np.zeros(0, np.uint32)
        self._bias_host = np.zeros(bias.BUFFER_WORDS, np.uint32)  # likewise its logit adjustments
        self.steps = 0  # steps submitted and waited for
        self.last_gpu_ns: float | None = None

    def pack(self, graph: Graph, batch: StepBatch) -> StepOutput:
        """``batch``'s metadata in ``graph``'s layout, packed for the next launch."""
        lay = graph.layout
        if self._meta_host.size < lay.words:
            self._meta_host = np.zeros(lay.words, np.uint32)
        lay.pack(batch, out=self._meta_host[: lay.words])
        feed = batch.feed is not None and bool((batch.feed >= 0).any())
        x = StepOutput(graph, len(batch.logit_rows), graph.logits.shape[1], lay.used_words(batch), feed)
        x.bias_words, x.bias_ok = bias.pack(batch, self._bias_host)
        x.embeds = self._embeds(batch)
        return x

    def _embeds(self, batch: StepBatch) -> np.ndarray | None:
        """``batch``'s input embeddings (R, D) float32, checked against a half of the embeds buffer."""
        if batch.embeds is None:
            return None
        ctx, (r, d) = self.ctx, batch.embeds.shape
        if ctx.embeds is None or d != ctx.embeds_dim:
            raise ValueError(f"input embeddings of width {d}: the recorded model's embedding takes none such")
        if r > ctx.embeds_rows:
            raise ValueError(f"a step's {r} input embeddings exceed the {ctx.embeds_rows} its buffer holds")
        return batch.embeds

    def _write_embeds(self, x: StepOutput, p: int) -> None:
        """Step ``x``'s input embeddings into parity ``p``'s half of the embeds buffer, and that half's first
        row into its metadata's header (stepmeta.EMBEDS_ROW0), before the metadata goes to its buffer."""
        if x.embeds is None:
            self._meta_host[EMBEDS_ROW0] = 0
            return
        r, d = x.embeds.shape
        row0 = p * self.ctx.embeds_rows
        self.ctx.embeds.array(np.float32)[row0 * d : (row0 + r) * d] = x.embeds.reshape(-1)
        self._meta_host[EMBEDS_ROW0] = row0

    def launch(self, x: StepOutput, tail: CommandRecorder, sampled: bool = False) -> Launched:
        """Submit step ``x`` (head, forward pass, ``tail``) on the next parity; no wait."""
        self.placement.wait_resident()
        p, dev = self.parity, self.ctx.dev
        if self.in_flight[p] is not None:
            raise RuntimeError("two steps in flight already: collect the older one first")
        self._write_embeds(x, p)
        # into the mapped buffer in one sequential write, not a store per section (it may be uncached,
        # write-combined memory across the bus)
        self.ctx.metas[p].array(np.uint32)[: x.used] = self._meta_host[: x.used]
        self.ctx.biases[p].array(np.uint32)[: x.bias_words] = self._bias_host[: x.bias_words]
        graph = x.graph
        cmds = ffi.new("VkCommandBuffer[]", [head(self.ctx, graph, p, x.feed).cmd, graph.rec.cmd, tail.cmd])
        si = new(
            "VkSubmitInfo", sType=vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, commandBufferCount=3, pCommandBuffers=cmds
        )
        check(lib.vkResetFences(dev.handle, 1, self._fences[p]), "vkResetFences")
        check(lib.vkQueueSubmit(dev.queue, 1, si, self.fences[p]), "vkQueueSubmit(step)")
        self.in_flight[p] = done = Launched(p, x.n_out, graph, sampled)
        self.parity = 1 - p
        return done

    def wait(self, done: Launched) -> None:
        """Until ``done``'s fence (raises Timeout past ``step_timeout_s``: a GPU hang)."""
        if self.in_flight[done.parity] is not done:
            raise RuntimeError("collect(): that step is not in flight (collected already?)")
        self.in_flight[done.parity] = None
        fence, timeout_s = self._fences[done.parity], self.ctx.options.step_timeout_s
        r = lib.vkWaitForFences(self.ctx.dev.handle, 1, fence, 1, int(timeout_s * 1e9))
        check(r, f"vkWaitForFences(step of bucket {done.graph.key}, {timeout_s:g} s)")
        self.steps += 1
        if done.graph.rec.query_pool is not None:
            done.graph.rec.submits += 1
            self.last_gpu_ns = done.graph.rec.gpu_times()["total_ns"]

    def run_alone(self, x: StepOutput, tail: CommandRecorder) -> None:
        """Submit step ``x`` with ``tail`` (which writes a buffer of one parity only) and wait for it."""
        if any(self.in_flight):
            raise RuntimeError("a pipelined step is in flight: collect it before a step that reads logits")
        if x.feed:
            raise ValueError("only launch_greedy takes a batch with fed rows")
        self.wait(self.launch(x, tail))

    def close(self) -> None:
        for f in self.fences:
            lib.vkDestroyFence(self.ctx.dev.handle, f, ffi.NULL)
        self.fences, self.in_flight = [], [None, None]
