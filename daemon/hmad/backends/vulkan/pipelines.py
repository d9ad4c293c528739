"""Compute pipelines (:class:`Kernel`) and recorded, replayable command buffers (:class:`CommandRecorder`).

A kernel is one SPIR-V variant from ``shaders/spv`` built once: shader module, a descriptor-set layout of N
storage buffers, a pipeline layout with one push-constant range, and the pipeline with its workgroup size as
specialization constant 0. Its push constants are the ctypes struct registered in :data:`KERNELS`, which
mirrors the shader's ``Push`` block field by field; the struct's offsets are checked against the SPIR-V when
the kernel is built, and the binding count and struct type are asserted at every ``record``.

Descriptor sets are made once per distinct tuple of buffer ranges and cached, so a recorded graph binds the
same sets on every replay. The forward pass will be recorded once per batch-size bucket into a
:class:`CommandRecorder` and replayed every step (one queue submit + one fence wait), with the per-step values
(token ids, positions, sequence lengths, block tables) written into a small host-visible buffer the shaders
read; quantized matmul kernels will read the GGUF blocks from their weight ranges directly.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import vulkan as vk

from hmad.backends.vulkan.device import (
    VK_ERROR_FRAGMENTED_POOL,
    VK_ERROR_OUT_OF_POOL_MEMORY,
    Device,
    OutOfPoolMemory,
    check,
    ffi,
    lib,
    new,
)
from hmad.backends.vulkan.kernels_matmul import (  # noqa: F401 (re-export)
    MatMulPush,
    RowScalePush,
    SplitReducePush,
    kernel_specs,
)
from hmad.backends.vulkan.kernels_mmq import mmq_kernel_specs
from hmad.backends.vulkan.memory import BufferView
from hmad.backends.vulkan.program import load_spirv, reflect
from hmad.backends.vulkan.stepmeta import TILE_ROWS

u32, f32 = ctypes.c_uint32, ctypes.c_float


# -- push-constant structs: one per shader Push block, same fields in the same order ----------------------
class CopyPush(ctypes.Structure):
    """shaders/copy.comp"""

    _fields_ = [("n", u32)]  # vec4 elements


class AddPush(ctypes.Structure):
    """shaders/add.comp"""

    _fields_ = [("n", u32)]


class RmsNormPush(ctypes.Structure):
    """shaders/rms_norm.comp"""

    _fields_ = [("ncols", u32), ("nrows", u32), ("x_stride", u32), ("y_stride", u32), ("eps", f32)]


# The *_off fields below are word offsets of sections of the step metadata (hmad/backends/vulkan/stepmeta.py).
class EmbedPush(ctypes.Structure):
    """shaders/embed.comp"""

    _fields_ = [
        *[(n, u32) for n in ("n_tokens", "dim", "ids_off", "row_begin", "n_rows", "y_stride")],
        ("scale", f32),
    ]


class EmbedDqPush(ctypes.Structure):
    """shaders/embed_dq.comp"""

    _fields_ = [
        *[(n, u32) for n in ("n_tokens", "dim", "ids_off", "row_begin", "n_rows", "y_stride", "row_bytes")],
        ("scale", f32),
    ]


class RopePush(ctypes.Structure):
    """shaders/rope.comp"""

    _fields_ = [
        *[(n, u32) for n in ("n_tokens", "n_heads", "head_dim", "x_stride", "y_stride", "pos_off")],
        ("base", f32),
        ("scale", f32),
    ]


class GegluPush(ctypes.Structure):
    """shaders/geglu.comp"""

    _fields_ = [(n, u32) for n in ("n_cols", "n_rows", "gate_stride", "up_stride", "y_stride")]


class KvWritePush(ctypes.Structure):
    """shaders/kv_write.comp"""

    _fields_ = [(n, u32) for n in ("n_tokens", "row", "k_stride", "v_stride", "slot_off")]


class AttentionSplitPush(ctypes.Structure):
    """shaders/attention_split.comp"""

    _fields_ = [
        *[(n, u32) for n in ("n_tokens", "n_heads", "n_kv_heads", "head_dim", "q_stride", "n_splits")],
        *[(n, u32) for n in ("block_size", "window", "pos_off", "seq_off", "info_off")],
        ("scale", f32),
        ("skip_off", u32),
        ("min_keys", u32),
    ]


class AttentionPrefillPush(ctypes.Structure):
    """shaders/attention_prefill.comp and attention_prefill_cm.comp"""

    _fields_ = [
        *[(n, u32) for n in ("max_tiles", "n_heads", "n_kv_heads", "head_dim", "q_stride", "n_splits")],
        *[(n, u32) for n in ("block_size", "window", "pos_off", "info_off", "tiles_off")],
        ("scale", f32),
    ]


class AttentionReducePush(ctypes.Structure):
    """shaders/attention_reduce.comp"""

    _fields_ = [(n, u32) for n in ("n_tokens", "n_heads", "head_dim", "n_splits", "o_stride")]


class QuantizeQ8Push(ctypes.Structure):
    """shaders/quantize_q8.comp"""

    _fields_ = [(n, u32) for n in ("K", "T", "x_stride")]


class ResidualNormPush(ctypes.Structure):
    """shaders/residual_norm.comp; ``splits``: how many K-split partial sums ``a`` comes as (1: its values)"""

    _fields_ = [("ncols", u32), ("nrows", u32), ("eps", f32), ("splits", u32)]

    def __init__(self, ncols: int, nrows: int, eps: float, splits: int = 1):
        super().__init__(ncols, nrows, eps, splits)


class NormRopePush(ctypes.Structure):
    """shaders/norm_rope.comp"""

    _fields_ = [
        *[(n, u32) for n in ("n_tokens", "n_heads", "head_dim", "x_stride", "y_stride", "pos_off")],
        *[(n, f32) for n in ("base", "scale", "eps")],
    ]


class NormRopeKvPush(ctypes.Structure):
    """shaders/norm_rope_kv.comp; ``splits``: how many K-split partial sums q, k and v come as (1: values).
    Heads of at most MAX_HEAD_DIM values (the shader's shared copy of a head)."""

    MAX_HEAD_DIM = 512

    _fields_ = [
        *[(n, u32) for n in ("n_tokens", "n_heads", "n_kv_heads", "head_dim", "pos_off", "slot_off")],
        *[(n, f32) for n in ("base", "scale", "eps")],
        *[(n, u32) for n in ("q_splits", "k_splits", "v_splits")],
    ]

    def __init__(self, *args, splits: tuple[int, int, int] = (1, 1, 1)):
        if len(args) > 3 and args[3] > self.MAX_HEAD_DIM:
            raise ValueError(f"norm_rope_kv: heads of {args[3]} values, at most {self.MAX_HEAD_DIM}")
        super().__init__(*args, *splits)


class ArgmaxPush(ctypes.Structure):
    """shaders/argmax.comp"""

    _fields_ = [(n, u32) for n in ("n_rows", "n_cols", "row_stride", "chunk")]


class FeedPush(ctypes.Structure):
    """shaders/feed_tokens.comp"""

    _fields_ = [(n, u32) for n in ("tokens_off", "feed_off", "max_tokens", "vocab")]


class SampleTopkPush(ctypes.Structure):
    """shaders/sample_topk.comp"""

    _fields_ = [(n, u32) for n in ("n_rows", "k", "sample_off")]


class TopkPush(ctypes.Structure):
    """shaders/topk.comp"""

    _fields_ = [(n, u32) for n in ("n_rows", "n_cols", "row_stride", "k", "chunk")]


class CoopMatPeakPush(ctypes.Structure):
    """shaders/coopmat_peak.comp (bench_vulkan_coopmat_peak.py): built for the (NA, NB) fragment counts of
    VARIANTS (kernels ``coopmat_peak_a<NA>x<NB>``: NA NB accumulators a subgroup), ROUNDS x NA x NB products
    a loop iteration (shaders/build.py builds the same)."""

    _fields_ = [("iters", u32), ("store_groups", u32), ("never", u32)]
    VARIANTS = ((2, 2), (2, 4), (4, 4))
    #: a4x4 with its fragments from shared memory (``_lds``), and the tile stored each step too (``_step``)
    STAGED = ("_lds", "_step")
    ROUNDS = 4
    NAN = 0x7FC00000  # ``never``: no sum equals a NaN


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


ATTENTION_DECODE_DPL = (4, 8, 32)  # attention_decode.comp: head dims per lane (Dh <= DPL * subgroup size)
ATTENTION_DECODE_GROUPS = (4, 8)  # ... and query heads per KV head it holds registers for
ATTENTION_DECODE_KL_GROUPS = (2, 4)  # attention_decode_kl.comp (8 lanes per key, Dh <= 128): query heads
ATTENTION_PREFILL_DPL = (8, 16, 32)  # attention_prefill.comp: head dims per lane (Dh <= 8 DPL)
ATTENTION_PREFILL_CM_DH = (64, 128, 256)  # attention_prefill_cm.comp: the head dims it is built for
ATTENTION_PREFILL_QV = 32  # ... query vectors (tile rows x query heads of a KV head) per workgroup
ATTENTION_PREFILL_TILE = TILE_ROWS  # ... rows of a tile


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


@dataclass(frozen=True)
class KernelSpec:
    source: str  # the .comp it is built from (documentation; the build list is in shaders/build.py)
    n_buffers: int
    push: type[ctypes.Structure]
    block_size: int  # default workgroup size (specialization constant 0)


#: SPIR-V variant name -> interface. Variants share a .comp and its push struct.
KERNELS: dict[str, KernelSpec] = {
    "copy_vec4": KernelSpec("copy.comp", 2, CopyPush, 256),
    "copy_vec4_x4": KernelSpec("copy.comp", 2, CopyPush, 256),
    "copy_vec4_x8": KernelSpec("copy.comp", 2, CopyPush, 256),
    "read_vec4": KernelSpec("read.comp", 2, CopyPush, 256),
    "read_vec4_x4": KernelSpec("read.comp", 2, CopyPush, 256),
    "read_vec4_x8": KernelSpec("read.comp", 2, CopyPush, 256),
    "prefetch_vec4": KernelSpec("read.comp", 2, CopyPush, 256),
    "add_f32": KernelSpec("add.comp", 3, AddPush, 256),
    "rms_norm_f32": KernelSpec("rms_norm.comp", 3, RmsNormPush, 128),
    "rms_norm_f32_subgroup": KernelSpec("rms_norm.comp", 3, RmsNormPush, 128),
    "embed_f32": KernelSpec("embed.comp", 3, EmbedPush, 128),
    "embed_f16": KernelSpec("embed.comp", 3, EmbedPush, 128),
    "embed_q8_0": KernelSpec("embed.comp", 3, EmbedPush, 128),
    **{
        f"embed_{t}": KernelSpec("embed_dq.comp", 3, EmbedDqPush, 128)
        for t in ("bf16", "q4_0", "q5_0", "q4_k", "q6_k")
    },
    "rope_f32": KernelSpec("rope.comp", 3, RopePush, 256),
    "geglu_f32": KernelSpec("geglu.comp", 3, GegluPush, 256),
    "kv_write_f32": KernelSpec("kv_write.comp", 5, KvWritePush, 256),
    "kv_write_f16": KernelSpec("kv_write.comp", 5, KvWritePush, 256),
    **{
        f"attention_decode_{pool}_dpl{dpl}_g{mg}": KernelSpec(
            "attention_decode.comp", 5, AttentionSplitPush, 256
        )
        for pool in ("f32", "f16")
        for dpl in ATTENTION_DECODE_DPL
        for mg in ATTENTION_DECODE_GROUPS
    },
    **{
        f"attention_decode_kl_{pool}_g{mg}": KernelSpec(
            "attention_decode_kl.comp", 5, AttentionSplitPush, 256
        )
        for pool in ("f32", "f16")
        for mg in ATTENTION_DECODE_KL_GROUPS
    },
    "attention_decode_kl_f32_g2_l4": KernelSpec("attention_decode_kl.comp", 5, AttentionSplitPush, 256),
    **{
        f"attention_prefill_{pool}_dpl{dpl}": KernelSpec(
            "attention_prefill.comp", 5, AttentionPrefillPush, 256
        )
        for pool in ("f32", "f16")
        for dpl in ATTENTION_PREFILL_DPL
    },
    **{
        f"attention_prefill_cm_{pool}_d{dh}": KernelSpec(
            "attention_prefill_cm.comp", 5, AttentionPrefillPush, 128
        )
        for pool in ("f32", "f16")
        for dh in ATTENTION_PREFILL_CM_DH
    },
    "attention_split_f32": KernelSpec("attention_split.comp", 5, AttentionSplitPush, 256),
    "attention_split_f16": KernelSpec("attention_split.comp", 5, AttentionSplitPush, 256),
    "attention_reduce_f32": KernelSpec("attention_reduce.comp", 2, AttentionReducePush, 256),
    "attention_reduce_f32_q8": KernelSpec("attention_reduce.comp", 4, AttentionReducePush, 256),
    "attention_reduce_f32_x3": KernelSpec("attention_reduce.comp", 4, AttentionReducePush, 256),
    "argmax_f32": KernelSpec("argmax.comp", 2, ArgmaxPush, 256),
    "argmax_chunks_f32": KernelSpec("argmax.comp", 3, ArgmaxPush, 256),  # logits, ids, values
    "argmax_merge_f32": KernelSpec("argmax.comp", 3, ArgmaxPush, 256),  # values, ids, the chunks' ids
    "topk_f32": KernelSpec("topk.comp", 3, TopkPush, 256),
    "topk_merge_f32": KernelSpec("topk.comp", 4, TopkPush, 256),  # values, ids, vals, the candidates' ids
    "feed_tokens": KernelSpec("feed_tokens.comp", 2, FeedPush, 64),
    "sample_topk": KernelSpec("sample_topk.comp", 4, SampleTopkPush, 128),  # block >= topk's candidates
    "split_reduce": KernelSpec("split_reduce.comp", 2, SplitReducePush, 256),
    "split_reduce_geglu": KernelSpec("split_reduce.comp", 3, SplitReducePush, 256),  # gate, y, up
    "row_scale": KernelSpec("row_scale.comp", 3, RowScalePush, 256),
    "geglu_row_scale": KernelSpec("geglu_row_scale.comp", 4, SplitReducePush, 256),  # gate, s, up, xh
    **{
        f"coopmat_peak_a{a}x{b}": KernelSpec("coopmat_peak.comp", 3, CoopMatPeakPush, 128)
        for a, b in CoopMatPeakPush.VARIANTS
    },
    **{
        f"coopmat_peak_a4x4{s}": KernelSpec("coopmat_peak.comp", 3, CoopMatPeakPush, 128)
        for s in CoopMatPeakPush.STAGED
    },
    "norm_rope_f32": KernelSpec("norm_rope.comp", 4, NormRopePush, 128),
    "norm_rope_kv_f32": KernelSpec("norm_rope_kv.comp", 9, NormRopeKvPush, 128),
    "norm_rope_kv_f16": KernelSpec("norm_rope_kv.comp", 9, NormRopeKvPush, 128),
    "quantize_q8": KernelSpec("quantize_q8.comp", 3, QuantizeQ8Push, 128),
    "quantize_x3": KernelSpec("quantize_q8.comp", 3, QuantizeQ8Push, 128),
    "residual_norm": KernelSpec("residual_norm.comp", 4, ResidualNormPush, RESIDUAL_BLOCK),
    "residual_norm_next": KernelSpec("residual_norm.comp", 6, ResidualNormPush, RESIDUAL_BLOCK),
    "residual_norm_next_q8": KernelSpec("residual_norm.comp", 8, ResidualNormPush, RESIDUAL_BLOCK),
    "residual_norm_next_x3": KernelSpec("residual_norm.comp", 8, ResidualNormPush, RESIDUAL_BLOCK),
    "residual_norm_next_xh": KernelSpec("residual_norm.comp", 8, ResidualNormPush, RESIDUAL_BLOCK),
    "residual_norm_next_q8_xh": KernelSpec("residual_norm.comp", 10, ResidualNormPush, RESIDUAL_BLOCK),
    "residual_norm_next_x3_xh": KernelSpec("residual_norm.comp", 10, ResidualNormPush, RESIDUAL_BLOCK),
    **kernel_specs(KernelSpec),  # mul_mat_vec_<type>[_subgroup], mul_mat_<type>: kernels_matmul.py
    **mmq_kernel_specs(KernelSpec),  # mul_mmq_coopmat_q4_k_*: kernels_mmq.py
}
# A binding: a whole view, or (view, offset inside the view, nbytes) for one range of a big tensor.
Binding = BufferView | tuple[BufferView, int, int]


def _range_of(b: Binding) -> tuple[Any, int, int]:
    """(VkBuffer, offset, nbytes) of a binding: what a descriptor is written with."""
    if isinstance(b, BufferView):
        return b.buffer, b.offset, b.nbytes
    view, off, n = b
    return view.buffer, view.offset + off, n


def _key_of(b: Binding) -> tuple[int, int, int]:
    """(arena serial, offset, nbytes) of a binding: what caches key on. Not the VkBuffer handle: a driver
    gives a destroyed buffer's handle to the next one, and a descriptor set cached under it would bind the
    freed memory (the likely cause of a step whose fence was never signalled)."""
    view, off, n = (b, 0, b.nbytes) if isinstance(b, BufferView) else b
    return view.arena.serial, view.offset + off, n


def _arenas_of(buffers: Sequence[Binding]) -> tuple:
    return tuple(b.arena if isinstance(b, BufferView) else b[0].arena for b in buffers)


def _handle_key(h) -> int:
    return int(ffi.cast("uintptr_t", h))


class DescriptorAllocator:
    """Descriptor pools of storage-buffer sets, a new pool whenever the current one is full."""

    def __init__(self, device: Device, sets_per_pool: int = 256, max_bindings: int = 8):
        self.device, self.sets_per_pool, self.max_bindings = device, sets_per_pool, max_bindings
        self.pools: list[Any] = []
        self._new_pool()

    def _new_pool(self) -> None:
        size = new(
            "VkDescriptorPoolSize",
            type=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
            descriptorCount=self.sets_per_pool * self.max_bindings,
        )
        ci = new(
            "VkDescriptorPoolCreateInfo",
            sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO,
            maxSets=self.sets_per_pool,
            poolSizeCount=1,
            pPoolSizes=size,
        )
        out = ffi.new("VkDescriptorPool*")
        check(lib.vkCreateDescriptorPool(self.device.handle, ci, ffi.NULL, out), "vkCreateDescriptorPool")
        self.pools.append(out[0])
        self.in_pool = 0  # sets allocated from the newest pool

    def allocate(self, layout) -> Any:
        """One set of ``layout``. A pool holds ``sets_per_pool`` sets: counted here, so a new pool is made
        before the driver has to refuse (lavapipe never refuses; NVIDIA does, with
        VK_ERROR_OUT_OF_POOL_MEMORY, which the ``vulkan`` package spells with the wrong sign)."""
        if self.in_pool >= self.sets_per_pool:
            self._new_pool()
        layouts = ffi.new("VkDescriptorSetLayout[]", [layout])
        for attempt in range(2):
            ai = new(
                "VkDescriptorSetAllocateInfo",
                sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO,
                descriptorPool=self.pools[-1],
                descriptorSetCount=1,
                pSetLayouts=layouts,
            )
            out = ffi.new("VkDescriptorSet*")
            r = lib.vkAllocateDescriptorSets(self.device.handle, ai, out)
            if r in (VK_ERROR_OUT_OF_POOL_MEMORY, VK_ERROR_FRAGMENTED_POOL) and attempt == 0:
                self._new_pool()
                continue
            check(r, "vkAllocateDescriptorSets")
            self.in_pool += 1
            return out[0]
        raise OutOfPoolMemory("vkAllocateDescriptorSets", VK_ERROR_OUT_OF_POOL_MEMORY)

    def close(self) -> None:
        for p in self.pools:
            lib.vkDestroyDescriptorPool(self.device.handle, p, ffi.NULL)
        self.pools = []


class Kernel:
    """One compute pipeline; ``record()`` binds its cached descriptor set, pushes constants, dispatches."""

    def __init__(self, device: Device, name: str, block_size: int | None = None, descriptors=None):
        spec = KERNELS[name]
        self.device, self.name, self.spec = device, name, spec
        self.block_size = block_size or spec.block_size
        self.n_buffers, self.push_type = spec.n_buffers, spec.push
        self.push_size = ctypes.sizeof(spec.push)
        self.descriptors = descriptors or DescriptorAllocator(device)
        self._own_descriptors = descriptors is None
        self._sets: dict[tuple, Any] = {}
        code = load_spirv(name)
        iface = reflect(code)
        self._check_interface(iface)
        self.written = iface.written  # bindings the shader may write: what the recorder's barriers track
        self.module = self._create_module(code)
        self.set_layout = self._create_set_layout()
        self.layout = self._create_pipeline_layout()
        self.pipeline = self._create_pipeline()

    def _check_interface(self, iface) -> None:
        want = tuple(range(self.n_buffers))
        if iface.bindings != want:
            raise ValueError(
                f"{self.name}: shader bindings {iface.bindings}, KERNELS says {self.n_buffers} buffers"
            )
        mine = tuple(getattr(self.push_type, f).offset for f, _ in self.push_type._fields_)
        if mine != iface.push_offsets or iface.push_size != self.push_size:
            raise ValueError(
                f"{self.name}: push block offsets {iface.push_offsets} size {iface.push_size} in the shader, "
                f"{mine} size {self.push_size} in {self.push_type.__name__}"
            )
        if self.push_size > self.device.limits["maxPushConstantsSize"]:
            raise ValueError(f"{self.name}: push constants exceed maxPushConstantsSize")

    def _create_module(self, code: bytes):
        words = ffi.new("uint32_t[]", len(code) // 4)
        ffi.memmove(words, code, len(code))
        ci = new(
            "VkShaderModuleCreateInfo",
            sType=vk.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO,
            codeSize=len(code),
            pCode=words,
        )
        out = ffi.new("VkShaderModule*")
        check(
            lib.vkCreateShaderModule(self.device.handle, ci, ffi.NULL, out),
            f"vkCreateShaderModule({self.name})",
        )
        return out[0]

    def _create_set_layout(self):
        binds = ffi.new("VkDescriptorSetLayoutBinding[]", self.n_buffers)
        for i in range(self.n_buffers):
            binds[i].binding = i
            binds[i].descriptorType = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
            binds[i].descriptorCount = 1
            binds[i].stageFlags = vk.VK_SHADER_STAGE_COMPUTE_BIT
        ci = new(
            "VkDescriptorSetLayoutCreateInfo",
            sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO,
            bindingCount=self.n_buffers,
            pBindings=binds,
        )
        out = ffi.new("VkDescriptorSetLayout*")
        check(
            lib.vkCreateDescriptorSetLayout(self.device.handle, ci, ffi.NULL, out),
            "vkCreateDescriptorSetLayout",
        )
        return out[0]

    def _create_pipeline_layout(self):
        pcr = new(
            "VkPushConstantRange", stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT, offset=0, size=self.push_size
        )
        layouts = ffi.new("VkDescriptorSetLayout[]", [self.set_layout])
        ci = new(
            "VkPipelineLayoutCreateInfo",
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO,
            setLayoutCount=1,
            pSetLayouts=layouts,
            pushConstantRangeCount=1 if self.push_size else 0,
            pPushConstantRanges=pcr if self.push_size else ffi.NULL,
        )
        out = ffi.new("VkPipelineLayout*")
        check(lib.vkCreatePipelineLayout(self.device.handle, ci, ffi.NULL, out), "vkCreatePipelineLayout")
        return out[0]

    def _create_pipeline(self):
        # Every nested struct and string lives in a local until vkCreateComputePipelines returns (GPU.md).
        entry = ffi.new("char[]", b"main")
        spec_data = ffi.new("uint32_t[]", [self.block_size])
        spec_entry = new("VkSpecializationMapEntry", constantID=0, offset=0, size=4)
        spec = new(
            "VkSpecializationInfo", mapEntryCount=1, pMapEntries=spec_entry, dataSize=4, pData=spec_data
        )
        ci = new(
            "VkComputePipelineCreateInfo",
            sType=vk.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO,
            flags=vk.VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR if self.device.pipeline_stats else 0,
            layout=self.layout,
            basePipelineIndex=-1,
        )
        ci.stage.sType = vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO
        ci.stage.stage = vk.VK_SHADER_STAGE_COMPUTE_BIT
        ci.stage.module = self.module
        ci.stage.pName = entry
        ci.stage.pSpecializationInfo = spec
        out = ffi.new("VkPipeline*")
        r = lib.vkCreateComputePipelines(self.device.handle, ffi.NULL, 1, ci, ffi.NULL, out)
        check(r, f"vkCreateComputePipelines({self.name})")
        return out[0]

    def statistics(self) -> dict[str, Any]:
        """The driver's statistics of the compiled kernel (register count, ...: names and meanings are the
        driver's), or {} unless the device was opened with ``pipeline_stats=True`` and the driver has them."""
        if not self.device.pipeline_stats:
            return {}
        d = self.device.handle
        fn = ffi.cast(
            "PFN_vkGetPipelineExecutableStatisticsKHR",
            lib.vkGetDeviceProcAddr(d, b"vkGetPipelineExecutableStatisticsKHR"),
        )
        info = new(
            "VkPipelineExecutableInfoKHR",
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_INFO_KHR,
            pipeline=self.pipeline,
            executableIndex=0,
        )
        count = ffi.new("uint32_t*")
        check(fn(d, info, count, ffi.NULL), "vkGetPipelineExecutableStatisticsKHR")
        out = ffi.new("VkPipelineExecutableStatisticKHR[]", count[0])
        for st in out:
            st.sType = vk.VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_STATISTIC_KHR
        check(fn(d, info, count, out), "vkGetPipelineExecutableStatisticsKHR")
        kinds = ("b32", "i64", "u64", "f64")  # VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_*: 0..3
        return {ffi.string(st.name).decode(): getattr(st.value, kinds[st.format]) for st in out[0 : count[0]]}

    # -- binding and recording ----------------------------------------------------------------------------
    def descriptor_set(self, buffers: Sequence[Binding]):
        """The (cached) descriptor set binding ``buffers`` as bindings 0..N-1."""
        key = tuple(_key_of(b) for b in buffers)
        hit = self._sets.get(key)
        if hit is None:
            hit = self._sets[key] = (self._write_set([_range_of(b) for b in buffers]), _arenas_of(buffers))
        return hit[0]

    def forget_closed(self) -> int:
        """Drop the cached sets that bind a closed buffer (they can never be hit again); returns how many.
        The sets themselves go back when their pool is destroyed."""
        dead = [k for k, (_, arenas) in self._sets.items() if any(a.closed for a in arenas)]
        for k in dead:
            del self._sets[k]
        return len(dead)

    def _write_set(self, ranges):
        limits = self.device.limits
        align, max_range = limits["minStorageBufferOffsetAlignment"], limits["maxStorageBufferRange"]
        for i, (_, off, n) in enumerate(ranges):
            if off % align or n > max_range:
                raise ValueError(
                    f"{self.name} binding {i}: range (offset {off}, {n} bytes) breaks alignment {align} "
                    f"or maxStorageBufferRange {max_range}: bind big tensors in ranges (BufferView.ranges)"
                )
        ds = self.descriptors.allocate(self.set_layout)
        infos = ffi.new("VkDescriptorBufferInfo[]", len(ranges))
        writes = ffi.new("VkWriteDescriptorSet[]", len(ranges))
        for i, (h, off, n) in enumerate(ranges):
            infos[i].buffer, infos[i].offset, infos[i].range = h, off, n
            w = writes[i]
            w.sType = vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET
            w.dstSet, w.dstBinding, w.descriptorCount = ds, i, 1
            w.descriptorType = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
            w.pBufferInfo = infos + i
        lib.vkUpdateDescriptorSets(self.device.handle, len(ranges), writes, 0, ffi.NULL)
        return ds

    def record(self, cmd, buffers: Sequence[Binding], push: ctypes.Structure, groups) -> None:
        """Bind, push and dispatch into ``cmd``. ``groups``: an int or (x, y, z) workgroup counts."""
        self.check_args(buffers, push)
        gx, gy, gz = (groups, 1, 1) if isinstance(groups, int) else tuple(groups) + (1,) * (3 - len(groups))
        sets = ffi.new("VkDescriptorSet[]", [self.descriptor_set(buffers)])
        lib.vkCmdBindPipeline(cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, self.pipeline)
        lib.vkCmdBindDescriptorSets(
            cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, self.layout, 0, 1, sets, 0, ffi.NULL
        )
        if self.push_size:
            data = ffi.new("char[]", bytes(push))
            lib.vkCmdPushConstants(cmd, self.layout, vk.VK_SHADER_STAGE_COMPUTE_BIT, 0, self.push_size, data)
        lib.vkCmdDispatch(cmd, gx, gy, gz)

    def check_args(self, buffers: Sequence[Binding], push: ctypes.Structure) -> None:
        """The binding count and push-constant type this kernel was built for."""
        assert len(buffers) == self.n_buffers, (
            f"{self.name}: {len(buffers)} buffers given, needs {self.n_buffers}"
        )
        assert type(push) is self.push_type, f"{self.name}: push constants must be {self.push_type.__name__}"
        assert ctypes.sizeof(push) == self.push_size

    def groups_for(self, n_groups: int) -> tuple[int, int, int]:
        """Split a group count over (x, y) past maxComputeWorkGroupCount[0] (shaders use group_index())."""
        max_x = self.device.limits["maxComputeWorkGroupCount"][0]
        if n_groups <= max_x:
            return (max(n_groups, 1), 1, 1)
        return (max_x, -(-n_groups // max_x), 1)

    def close(self) -> None:
        d = self.device.handle
        lib.vkDestroyPipeline(d, self.pipeline, ffi.NULL)
        lib.vkDestroyPipelineLayout(d, self.layout, ffi.NULL)
        lib.vkDestroyDescriptorSetLayout(d, self.set_layout, ffi.NULL)
        lib.vkDestroyShaderModule(d, self.module, ffi.NULL)
        if self._own_descriptors:
            self.descriptors.close()
        self._sets = {}


# -- recorded command buffers --------------------------------------------------------------------------------
class Hazards:
    """Buffer ranges ``(arena serial, offset, nbytes)`` read and written since the last barrier."""

    def __init__(self):
        self.reads: list[tuple[int, int, int]] = []
        self.writes: list[tuple[int, int, int]] = []

    @staticmethod
    def _key(r) -> tuple[int, int, int]:
        serial, off, n = r
        return serial, off, off + n

    @staticmethod
    def _overlap(a: list, b: list) -> bool:
        return any(x[0] == y[0] and x[1] < y[2] and y[1] < x[2] for x in a for y in b)

    def conflicts(self, reads: list[tuple], writes: list[tuple]) -> bool:
        """Read-after-write, write-after-write or write-after-read against the pending ranges."""
        r, w = [self._key(x) for x in reads], [self._key(x) for x in writes]
        return self._overlap(self.writes, r + w) or self._overlap(self.reads, w)

    def add(self, reads: list[tuple], writes: list[tuple]) -> None:
        self.reads += [self._key(x) for x in reads]
        self.writes += [self._key(x) for x in writes]

    def clear(self) -> None:
        self.reads, self.writes = [], []


_ALL_ACCESS = (
    vk.VK_ACCESS_SHADER_READ_BIT
    | vk.VK_ACCESS_SHADER_WRITE_BIT
    | vk.VK_ACCESS_TRANSFER_READ_BIT
    | vk.VK_ACCESS_TRANSFER_WRITE_BIT
)
_WORK_STAGES = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT


class CommandRecorder:
    """Dispatches and copies recorded into one command buffer, separated by barriers; submitted many times.

    ``begin()``, then ``dispatch()``/``copy()`` any number of times, ``end()``; then ``submit()`` as often as
    wanted (one vkQueueSubmit + one fence wait each; the host writes inputs into mapped buffers in between).
    With ``timestamps=True`` a timestamp is written before the first and after every command;
    :meth:`gpu_times` returns the GPU nanoseconds of each (label, ns) and of the whole submit.

    Barriers are placed from buffer ranges (:class:`Hazards`): a command waits for the earlier ones only
    when it reads or writes a range written since the last barrier, or writes a range read since then; so
    independent dispatches (q, k and v projections of one input) run back to back and may overlap on the
    GPU. A kernel's writes are the bindings its SPIR-V does not declare ``readonly``.
    """

    def __init__(self, device: Device, timestamps: bool = False, max_commands: int = 4096):
        self.device = device
        self.timestamps = timestamps and device.caps["timestamps"]
        self.max_queries = max_commands + 1
        self.labels: list[str] = []
        cba = new(
            "VkCommandBufferAllocateInfo",
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
            commandPool=device.command_pool,
            level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY,
            commandBufferCount=1,
        )
        self._cmds = ffi.new("VkCommandBuffer[]", 1)
        check(lib.vkAllocateCommandBuffers(device.handle, cba, self._cmds), "vkAllocateCommandBuffers")
        self.cmd = self._cmds[0]
        self.fence = device.create_fence()
        self._fences = ffi.new("VkFence[]", [self.fence])
        self._submit_info = new(
            "VkSubmitInfo",
            sType=vk.VK_STRUCTURE_TYPE_SUBMIT_INFO,
            commandBufferCount=1,
            pCommandBuffers=self._cmds,
        )
        self.query_pool = self._create_query_pool() if self.timestamps else None
        self._recording = False
        self.submits = 0
        self.hazards = Hazards()
        self.barriers = 0  # placed by the last recording (a test and the benchmarks read it)

    def _create_query_pool(self):
        ci = new(
            "VkQueryPoolCreateInfo",
            sType=vk.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO,
            queryType=vk.VK_QUERY_TYPE_TIMESTAMP,
            queryCount=self.max_queries,
        )
        out = ffi.new("VkQueryPool*")
        check(lib.vkCreateQueryPool(self.device.handle, ci, ffi.NULL, out), "vkCreateQueryPool")
        return out[0]

    def begin(self, simultaneous: bool = False) -> CommandRecorder:
        """Start recording. ``simultaneous``: the buffer may be submitted again while an earlier submit of it
        is still pending (a pipelined step of the same bucket as the one before it)."""
        check(lib.vkResetCommandBuffer(self.cmd, 0), "vkResetCommandBuffer")
        flags = vk.VK_COMMAND_BUFFER_USAGE_SIMULTANEOUS_USE_BIT if simultaneous else 0
        bi = new(
            "VkCommandBufferBeginInfo", sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO, flags=flags
        )
        check(lib.vkBeginCommandBuffer(self.cmd, bi), "vkBeginCommandBuffer")
        self.labels, self._recording = [], True
        self.hazards, self.barriers = Hazards(), 0
        if self.query_pool is not None:
            lib.vkCmdResetQueryPool(self.cmd, self.query_pool, 0, self.max_queries)
            lib.vkCmdWriteTimestamp(self.cmd, vk.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, self.query_pool, 0)
        return self

    def barrier(self, dst_stage: int = _WORK_STAGES, dst_access: int = _ALL_ACCESS) -> None:
        mb = new(
            "VkMemoryBarrier",
            sType=vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
            srcAccessMask=vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
            dstAccessMask=dst_access,
        )
        lib.vkCmdPipelineBarrier(self.cmd, _WORK_STAGES, dst_stage, 0, 1, mb, 0, ffi.NULL, 0, ffi.NULL)
        self.hazards.clear()
        self.barriers += 1

    def _order(self, reads: list[tuple], writes: list[tuple]) -> None:
        """A barrier first when this command depends on, or overwrites, work since the last one."""
        if self.hazards.conflicts(reads, writes):
            self.barrier()
        self.hazards.add(reads, writes)

    def _after(self, label: str) -> None:
        self.labels.append(label)
        if self.query_pool is not None:  # a timestamp after every command: the pool bounds their count
            if len(self.labels) >= self.max_queries:
                raise ValueError(f"more than {self.max_queries - 1} timestamped commands: raise max_commands")
            stage = vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT
            lib.vkCmdWriteTimestamp(self.cmd, stage, self.query_pool, len(self.labels))

    def dispatch(self, kernel: Kernel, buffers: Sequence[Binding], push, groups, label: str = "") -> None:
        assert self._recording, "begin() first"
        kernel.check_args(buffers, push)
        keys = [_key_of(b) for b in buffers]
        writes = [keys[i] for i in kernel.written]
        self._order([r for i, r in enumerate(keys) if i not in kernel.written], writes)
        kernel.record(self.cmd, buffers, push, groups)
        self._after(label or kernel.name)

    def copy(self, src: BufferView, dst: BufferView, nbytes: int | None = None, label: str = "copy") -> None:
        assert self._recording, "begin() first"
        n = src.nbytes if nbytes is None else nbytes
        self._order([_key_of((src, 0, n))], [_key_of((dst, 0, n))])
        region = new("VkBufferCopy", srcOffset=src.offset, dstOffset=dst.offset, size=n)
        lib.vkCmdCopyBuffer(self.cmd, src.buffer, dst.buffer, 1, region)
        self._after(label)

    def fill(self, dst: BufferView, value: int = 0, label: str = "fill") -> None:
        """Set every 32-bit word of ``dst`` to ``value`` (vkCmdFillBuffer; ``dst``'s size a multiple of 4)."""
        assert self._recording, "begin() first"
        self._order([], [_key_of(dst)])
        lib.vkCmdFillBuffer(self.cmd, dst.buffer, dst.offset, dst.nbytes, value)
        self._after(label)

    def end(self) -> CommandRecorder:
        # Make the last writes visible to the host (mapped readback) after the fence.
        self.barrier(vk.VK_PIPELINE_STAGE_HOST_BIT, vk.VK_ACCESS_HOST_READ_BIT)
        check(lib.vkEndCommandBuffer(self.cmd), "vkEndCommandBuffer")
        self._recording = False
        return self

    def submit(self, wait: bool = True, timeout_s: float = 60.0) -> float:
        """Run the recorded buffer once; returns host seconds from submit to fence (when ``wait``)."""
        assert not self._recording, "end() first"
        t0 = time.perf_counter()
        check(lib.vkResetFences(self.device.handle, 1, self._fences), "vkResetFences")
        check(lib.vkQueueSubmit(self.device.queue, 1, self._submit_info, self.fence), "vkQueueSubmit")
        self.submits += 1
        if wait:
            self.wait(timeout_s)
        return time.perf_counter() - t0

    def wait(self, timeout_s: float = 60.0) -> None:
        r = lib.vkWaitForFences(self.device.handle, 1, self._fences, 1, int(timeout_s * 1e9))
        check(r, "vkWaitForFences(recorded step)")

    def gpu_times(self) -> dict[str, Any]:
        """GPU ns per command and for the whole buffer, from the last submit's timestamps."""
        if self.query_pool is None:
            return {}
        n = len(self.labels) + 1
        data = np.zeros(n, np.uint64)
        flags = vk.VK_QUERY_RESULT_64_BIT | vk.VK_QUERY_RESULT_WAIT_BIT
        r = lib.vkGetQueryPoolResults(
            self.device.handle, self.query_pool, 0, n, data.nbytes, ffi.from_buffer(data), 8, flags
        )
        check(r, "vkGetQueryPoolResults")
        bits = self.device.info.timestamp_valid_bits
        if bits < 64:
            data &= np.uint64((1 << bits) - 1)
        ns = np.diff(data.astype(np.int64)) * self.device.limits["timestampPeriod"]
        return {
            "total_ns": float(ns.sum()),
            "commands": [(lab, float(t)) for lab, t in zip(self.labels, ns, strict=True)],
        }

    def close(self) -> None:
        d = self.device.handle
        if self.submits:
            lib.vkWaitForFences(d, 1, self._fences, 1, 10**10)
        lib.vkFreeCommandBuffers(d, self.device.command_pool, 1, self._cmds)
        lib.vkDestroyFence(d, self.fence, ffi.NULL)
        if self.query_pool is not None:
            lib.vkDestroyQueryPool(d, self.query_pool, ffi.NULL)
