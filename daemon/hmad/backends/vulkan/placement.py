"""Where the weights and the KV pools live: the memory plans, the allocations and the weights' upload.

Memory plan (:meth:`Placement.load_weights`): 1-D tensors (norms), the token embedding and the output
projection are *hot* and placed first; the other weights follow in file (= forward) order into the
device-local pool while it has room (``device_local_bytes`` caps it), the rest spill to the host-visible pool
(an APU's GTT, a dGPU's system heap). The KV pools are planned in :meth:`Placement.alloc_kv` into what the
weights left, device-local first. Norm weights are uploaded as float32; a 2-D weight of a type no matmul
shader reads is dequantized to float16 on the host first (the only case where a second copy of a tensor
exists in RAM, briefly).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import vulkan as vk

from hmad.backends.vulkan.device import Device
from hmad.backends.vulkan.kernels_matmul import MATMUL_TYPES
from hmad.backends.vulkan.memory import BufferView, ResidentMemory, Uploader
from hmad.backends.vulkan.memory_plan import MemoryPlan, PlanItem, plan_memory
from hmad.core.kv_layout import KVLayout
from hmad.core.tensors import QType, WeightTensor

MIB = 1 << 20


@dataclass
class VkWeight:
    """A resident weight: its bytes on the GPU as stored in the file (or converted, see the docstring)."""

    name: str
    view: BufferView
    qtype: QType
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.view.nbytes


def across_bus(dev: Device, view: BufferView) -> bool:
    """Whether ``view`` lives in memory the GPU reads across the bus: host memory of a discrete GPU without a
    host-visible VRAM window (ReBAR); an APU's memory is all device-local."""
    return not dev.memory_types[view.arena.memory_type].flags & vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT


class Placement:
    """The weights' and KV pools' plans and memory on ``dev``, within ``caps`` (device-local and
    host-visible byte caps, None: the heap's budget); buffers aligned to ``align``."""

    def __init__(self, dev: Device, caps: tuple[int | None, int | None], align: int):
        self.dev, self.caps, self.align = dev, caps, align
        self._uploading: threading.Thread | None = None  # load_weights(background=True)
        self._upload_error: BaseException | None = None
        self.weights_plan: MemoryPlan | None = None
        self.weights_mem: ResidentMemory | None = None
        self.kv_plan: MemoryPlan | None = None
        self.kv_mem: ResidentMemory | None = None

    def load_weights(
        self,
        tensors: dict[str, WeightTensor],
        progress: Callable[..., None] | None = None,
        background: bool = False,
    ) -> dict[str, VkWeight]:
        """Plan, allocate and upload every weight. ``background``: the upload runs in a thread and this
        returns once the memory is allocated, so the caller can allocate the KV pools and record the steps
        meanwhile (the daemon's load: the upload has its own command pool and is the queue's only user
        until ``wait_resident``, which every submit calls first)."""
        forms = {name: upload_form(t) for name, t in tensors.items()}  # name -> (array, qtype)
        items = [
            PlanItem(name, int(data.nbytes), is_hot(name, data), "weight", row_bytes(data))
            for name, (data, _) in forms.items()
        ]
        dev_cap, host_cap = self.caps
        self.dev.refresh_heaps()
        plan = plan_memory(
            items,
            self.dev.heaps,
            self.dev.memory_types,
            alignment=self.align,
            device_local_bytes=dev_cap,
            host_visible_bytes=host_cap,
        )
        self.weights_plan, self.weights_mem = plan, ResidentMemory(self.dev, plan)
        pairs = [(self.weights_mem[n], data) for n, (data, _) in forms.items()]
        if background:
            self._uploading = threading.Thread(
                target=self._upload, args=(pairs, progress), name="hmad-upload"
            )
            self._uploading.start()
        else:
            self._upload(pairs, progress)
        return {n: VkWeight(n, self.weights_mem[n], forms[n][1], tuple(t.shape)) for n, t in tensors.items()}

    def _upload(self, pairs, progress: Callable[[str], None] | None) -> None:
        last = [0.0]

        def report(done: int, total: int) -> None:
            now = time.monotonic()
            if progress and (now - last[0] >= 1.0 or done == total):
                last[0] = now
                progress(
                    f"uploading weights to {self.dev.name}: {done / MIB:.0f}/{total / MIB:.0f} MiB",
                    done,
                    total,
                )

        up = Uploader(self.dev)
        try:
            up.upload_all(pairs, report)
        except BaseException as e:  # noqa: BLE001 - raised again by wait_resident, in the caller's thread
            self._upload_error = e
        finally:
            up.close()

    def wait_resident(self) -> None:
        """Until a background upload is done (raises its error, if it failed)."""
        if self._uploading is not None:
            self._uploading.join()
            self._uploading = None
        if self._upload_error is not None:
            raise self._upload_error

    def alloc_kv(self, layout: KVLayout, itemsize: int) -> dict[tuple[str, int], tuple[BufferView, ...]]:
        """Plan and allocate the paged pools of ``layout`` (one K and one V range per layer, ``itemsize``
        bytes a value) where the weights left room, the pools before closed; -> (pool, slot) -> (K, V)."""
        if self.kv_mem is not None:
            self.kv_mem.close()
        items = []
        for pool, layers, blocks in (
            ("global", layout.global_layers, layout.n_global_blocks),
            ("local", layout.local_layers, layout.n_local_blocks),
        ):
            n = blocks * layout.block_size * layout.n_kv_heads * layout.head_dim * itemsize
            for slot in range(len(layers) if n else 0):
                items += [PlanItem(f"kv.{pool}.{slot}.{kv}", n, kind="kv") for kv in "kv"]
        wp = self.weights_plan
        left = {p: (wp.pools[p].capacity - wp.pools[p].used) if wp else None for p in ("device", "host")}
        self.kv_plan = plan_memory(
            items,
            self.dev.heaps,
            self.dev.memory_types,
            alignment=self.align,
            device_local_bytes=left["device"],
            host_visible_bytes=left["host"],
        )
        self.kv_mem = ResidentMemory(self.dev, self.kv_plan)
        views = {}
        for it in items[::2]:
            _, pool, slot, _ = it.name.split(".")
            base = f"kv.{pool}.{slot}."
            views[(pool, int(slot))] = (self.kv_mem[base + "k"], self.kv_mem[base + "v"])
        return views

    def memory(self) -> dict[str, int]:
        """Bytes used per heap and pool kind, as ``hmactl status`` shows them."""
        mem: dict[str, int] = {}
        for what, plan in (("weights", self.weights_plan), ("KV cache", self.kv_plan)):
            for pool in plan.pools.values() if plan else []:
                kind = "device-local" if pool.name == "device" else "host-visible"
                if pool.used:
                    mem[f"heap {pool.heap} {kind}: {what}"] = pool.used
        return mem

    def close(self) -> None:
        for m in (self.weights_mem, self.kv_mem):
            if m is not None:
                m.close()
        self.weights_mem = self.kv_mem = None


def upload_form(t: WeightTensor) -> tuple[np.ndarray, QType]:
    """The array uploaded for ``t`` and its type: the file's bytes when a shader reads them, else float."""
    if len(t.shape) == 1:
        data = t.data if t.qtype == QType.F32 else t.dequantize()
        return np.ascontiguousarray(data, dtype=np.float32), QType.F32
    if t.qtype in MATMUL_TYPES.values():
        return t.data, t.qtype
    return t.dequantize().astype(np.float16), QType.F16


def row_bytes(data: np.ndarray) -> int:
    return int(data.nbytes // data.shape[0]) if data.ndim > 1 else 0


def is_hot(name: str, data: np.ndarray) -> bool:
    """Norms, and the token embedding / output projection (read every step)."""
    return data.ndim == 1 or name.split("@")[0] in ("token_embd.weight", "output.weight")
