"""How many workgroups of a compute pipeline the device holds at once: its residency, measured.

A dispatch runs in waves: every SM (CU) holds as many workgroups of the kernel as its registers, shared memory
and warp slots allow, and the next ones start as those finish. Where a dispatch's workgroups all take about as
long (the cooperative-matrix GEMM's do), a wave a quarter full costs nearly a whole one, so the K split of the
GEMM is chosen for whole waves (splitk.split_k_waves). Vulkan tells neither the SM count on every
device nor a pipeline's registers, nor which share of an SM's memory the driver gives shared memory (a
workgroup can fit fewer to an SM than its registers allow: docs/tuning.md), so the residency is counted on the
device: the kernel's probe mode (mul_mm_coopmat.comp, push K == 0) has each workgroup count itself in, note
how many are in and not yet out, stay a while, and count itself out. The count is a lower bound that the first
wave, all in long before any leaves, reaches; on another GPU than the one measured the split follows its own
count.
"""

from __future__ import annotations

import numpy as np

from hmad.backends.vulkan.memory import create_buffer
from hmad.backends.vulkan.pipelines import Kernel
from hmad.backends.vulkan.push import CoopMatPush
from hmad.backends.vulkan.recorder import CommandRecorder

PROBE_GROUPS = 8192  # workgroups a probe dispatches: past any GPU's residency (a few hundred on big GPUs)
PROBE_READS = 512  # coherent reads each stays for (a fraction of a ms): the first wave fills long before


def probe_residency(kernel: Kernel) -> int:
    """The most workgroups of the cooperative-matrix ``kernel`` (mul_mm_coopmat.comp) the device held at
    once in one probe dispatch (>= 1; a few ms)."""
    dev = kernel.device
    counters = create_buffer(dev, 16, "readback", "residency probe")
    try:
        rec = CommandRecorder(dev).begin()
        try:
            rec.fill(counters, 0)
            push = CoopMatPush(0, PROBE_READS, 0, 0, 0, 0, 0, 0)  # K == 0: the probe
            rec.dispatch(kernel, [counters] * 4, push, (PROBE_GROUPS, 1, 1), label="residency probe")
            rec.end()
            rec.submit()
        finally:
            rec.close()
        entered, left, most, _ = (int(v) for v in np.frombuffer(counters.host, np.uint32, 4))
    finally:
        counters.arena.close()
    if entered != PROBE_GROUPS or left < PROBE_GROUPS or not 1 <= most <= PROBE_GROUPS:
        raise RuntimeError(
            f"{kernel.name}: residency probe counted {entered} in, {left} out, {most} at once "
            f"of {PROBE_GROUPS} workgroups"
        )
    return most
