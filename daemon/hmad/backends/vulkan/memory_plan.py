"""The memory plan: which pool each tensor goes to, packed into arenas; pure (heaps and memory types in,
placements out), made real by memory.ResidentMemory.

Pools: ``device`` (device-local memory: an APU's VRAM carve-out, a dGPU's VRAM) and ``host`` (host-visible
memory the GPU reads over the bus: an APU's GTT, a dGPU's system-memory heap). The plan places hot tensors,
the KV cache and scratch first in ``device``, then the cold weights while they fit, and spills the rest to
``host``; it fails with :class:`MemoryPlanError` when the model does not fit both. Budgets come from
VK_EXT_memory_budget when present (budget − usage), else the heap size; caps (config keys
``device_local_bytes``/``host_visible_bytes``) can only lower them. Each pool is packed into arenas of at
most ``arena_bytes`` (memory.py says why).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hmad.backends.vulkan.physical import MemoryHeap, MemoryType
from hmad.core.errors import HmadError

DEVICE_LOCAL, HOST_VISIBLE, HOST_COHERENT, HOST_CACHED = 1, 2, 4, 8
MIB = 1 << 20
DEFAULT_ALIGNMENT = 256
DEFAULT_ARENA_BYTES = 1 << 30


class MemoryPlanError(HmadError):
    """The tensors do not fit the device's memory (the message says how much is needed and available)."""


# -- memory type choice --------------------------------------------------------------------------------------
# kind -> (required flags, preferred flags, avoided flags)
_TYPE_WANTS = {
    "device": (DEVICE_LOCAL, 0, HOST_VISIBLE),  # VRAM proper; on a UMA driver the only type is also mappable
    "host": (
        HOST_VISIBLE | HOST_COHERENT,
        0,
        DEVICE_LOCAL | HOST_CACHED,
    ),  # GTT / system heap, write-combined
    "upload": (HOST_VISIBLE | HOST_COHERENT, 0, DEVICE_LOCAL | HOST_CACHED),  # staging the CPU writes once
    "mapped": (HOST_VISIBLE | HOST_COHERENT, DEVICE_LOCAL, 0),  # small per-step inputs: ReBAR/UMA if any
    "readback": (HOST_VISIBLE | HOST_COHERENT, HOST_CACHED, 0),  # the CPU reads it
}


def choose_memory_type(
    types: list[MemoryType], kind: str, heaps: list[MemoryHeap] | None = None
) -> MemoryType:
    """The best memory type for ``kind`` (``_TYPE_WANTS``); ties: the larger heap, then the lower index."""
    need, prefer, avoid = _TYPE_WANTS[kind]
    ok = [t for t in types if t.flags & need == need]
    if not ok:
        raise MemoryPlanError(f"no memory type for {kind!r} memory (need flags {need:#x})")
    size = {h.index: h.size for h in heaps or []}
    return min(
        ok,
        key=lambda t: (
            bin(t.flags & avoid).count("1"),
            -bin(t.flags & prefer).count("1"),
            -size.get(t.heap, 0),
            t.index,
        ),
    )


def heap_available(heap: MemoryHeap) -> int:
    """Bytes this process may still allocate on ``heap``: budget − usage (VK_EXT_memory_budget), else size."""
    if heap.budget is not None:
        return max(0, heap.budget - (heap.usage or 0))
    return heap.size


# -- the plan (pure python: unit-tested with synthetic heaps) ------------------------------------------------
@dataclass(frozen=True)
class PlanItem:
    """One thing to place. ``kind``: weight | kv | scratch; ``row_bytes`` lets big tensors split on rows."""

    name: str
    nbytes: int
    hot: bool = False
    kind: str = "weight"
    row_bytes: int = 0

    @property
    def prioritised(self) -> bool:
        return self.hot or self.kind in ("kv", "scratch")


@dataclass
class Placement:
    name: str
    pool: str
    arena: int  # index into the pool's arenas
    offset: int  # byte offset inside the arena (aligned)
    nbytes: int
    row_bytes: int = 0


@dataclass
class Pool:
    name: str
    memory_type: int
    heap: int
    capacity: int
    used: int = 0
    arenas: list[int] = field(default_factory=list)  # bytes per arena

    @property
    def free(self) -> int:
        return self.capacity - self.used


@dataclass
class MemoryPlan:
    pools: dict[str, Pool]
    placements: dict[str, Placement]
    alignment: int

    def pool_of(self, name: str) -> str:
        return self.placements[name].pool

    def report(self, tensors: bool = False) -> dict[str, Any]:
        """For ``hmactl status``: bytes per pool/heap, capacity, counts; ``tensors=True``: name -> pool."""
        out: dict[str, Any] = {"pools": {}}
        for p in self.pools.values():
            names = [n for n, pl in self.placements.items() if pl.pool == p.name]
            out["pools"][p.name] = {
                "heap": p.heap,
                "memory_type": p.memory_type,
                "bytes": p.used,
                "capacity": p.capacity,
                "arenas": len(p.arenas),
                "tensors": len(names),
            }
        if tensors:
            out["tensors"] = {n: pl.pool for n, pl in self.placements.items()}
        return out


def align_up(n: int, a: int) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return (n + a - 1) // a * a


def make_pools(
    heaps: list[MemoryHeap],
    types: list[MemoryType],
    device_local_bytes: int | None = None,
    host_visible_bytes: int | None = None,
) -> dict[str, Pool]:
    """The device and host pools with their capacities (budget or size, lowered by the caps).

    On a driver with a single heap (lavapipe) both pools live on it and share its bytes: the host pool gets
    whatever the device pool leaves (see :func:`plan_memory`).
    """
    dev_t = choose_memory_type(types, "device", heaps)
    host_t = choose_memory_type(types, "host", heaps)
    by_index = {h.index: h for h in heaps}
    dev_cap = heap_available(by_index[dev_t.heap])
    host_cap = heap_available(by_index[host_t.heap])
    if device_local_bytes is not None:
        dev_cap = min(dev_cap, device_local_bytes)
    if host_visible_bytes is not None:
        host_cap = min(host_cap, host_visible_bytes)
    return {
        "device": Pool("device", dev_t.index, dev_t.heap, dev_cap),
        "host": Pool("host", host_t.index, host_t.heap, host_cap),
    }


def plan_memory(
    items: Iterable[PlanItem],
    heaps: list[MemoryHeap],
    types: list[MemoryType],
    *,
    alignment: int = DEFAULT_ALIGNMENT,
    arena_bytes: int = DEFAULT_ARENA_BYTES,
    device_local_bytes: int | None = None,
    host_visible_bytes: int | None = None,
) -> MemoryPlan:
    """Place every item in the ``device`` or ``host`` pool and pack each pool into arenas.

    Hot items (``hot=True``, the KV cache, scratch) go first, then the rest in the given order (the forward
    pass's order, so a spill moves whole late layers); each goes to ``device`` while it fits, else ``host``.
    """
    items = list(items)
    pools = make_pools(heaps, types, device_local_bytes, host_visible_bytes)
    dev, host = pools["device"], pools["host"]
    shared_heap = dev.heap == host.heap
    heap_cap = {h.index: heap_available(h) for h in heaps}
    chosen: dict[str, str] = {}
    for it in sorted(
        items, key=lambda i: not i.prioritised
    ):  # stable: keeps the given order within each group
        need = align_up(it.nbytes, alignment)
        if need <= dev.free:
            pool = dev
        elif need <= host.free and (not shared_heap or dev.used + host.used + need <= heap_cap[host.heap]):
            pool = host
        else:
            raise _does_not_fit(items, it, pools, alignment)
        pool.used += need
        chosen[it.name] = pool.name
    placements = {}
    for pool in pools.values():
        placements.update(
            _pack_arenas(pool, [i for i in items if chosen[i.name] == pool.name], alignment, arena_bytes)
        )
    return MemoryPlan(pools, placements, alignment)


def _pack_arenas(pool: Pool, items: list[PlanItem], alignment: int, arena_bytes: int) -> dict[str, Placement]:
    """First-fit in order into arenas of at most ``arena_bytes`` (an item bigger than that gets its own)."""
    out = {}
    for it in items:
        need = align_up(it.nbytes, alignment)
        if not pool.arenas or pool.arenas[-1] + need > arena_bytes:
            pool.arenas.append(0)
        out[it.name] = Placement(
            it.name, pool.name, len(pool.arenas) - 1, pool.arenas[-1], it.nbytes, it.row_bytes
        )
        pool.arenas[-1] += need
    return out


def _does_not_fit(items: list[PlanItem], failed: PlanItem, pools: dict[str, Pool], alignment: int):
    total = sum(align_up(i.nbytes, alignment) for i in items)
    dev, host = pools["device"], pools["host"]
    return MemoryPlanError(
        f"model does not fit: needs {total / MIB:.1f} MiB in all; device-local pool (heap {dev.heap}) holds "
        f"{dev.capacity / MIB:.1f} MiB, host-visible pool (heap {host.heap}) {host.capacity / MIB:.1f} MiB "
        f"(after budgets and caps); {failed.name!r} ({failed.nbytes / MIB:.1f} MiB) found no room"
    )
