"""Compute pipelines: :class:`Kernel`, one SPIR-V variant from ``shaders/spv`` built once.

A kernel is a shader module, a descriptor-set layout of N buffers (storage buffers; storage texel buffers
where the shader declares an ``imageBuffer``, viewed in the format it declares: program.TEXEL_FORMATS), a
pipeline layout with one push-constant range, and the pipeline with its workgroup size as specialization
constant 0. Its push constants are the ctypes struct (push.py) registered in
:data:`hmad.backends.vulkan.registry.KERNELS`, which mirrors the shader's ``Push`` block field by field; the
struct's offsets are checked against the SPIR-V when the kernel is built, and the binding count and struct
type are asserted at every ``record``.

Descriptor sets are made once per distinct tuple of buffer ranges and cached (descriptors.py), so a recorded
graph (recorder.py) binds the same sets on every replay.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import vulkan as vk

from hmad.backends.vulkan.descriptors import Binding, DescriptorAllocator, arenas_of, key_of, range_of
from hmad.backends.vulkan.device import Device
from hmad.backends.vulkan.program import TEXEL_FORMATS, load_spirv, reflect
from hmad.backends.vulkan.registry import KERNELS
from hmad.backends.vulkan.vkerrors import check
from hmad.backends.vulkan.vkffi import ffi, lib, new


class Kernel:
    """One compute pipeline; ``record()`` binds its cached descriptor set, pushes constants, dispatches."""

    def __init__(self, device: Device, name: str, block_size: int | None = None, descriptors=None):
        spec = KERNELS[name]
        self.device, self.name, self.spec = device, name, spec
        self.block_size = block_size or spec.block_size
        self.n_buffers, self.push_type = spec.n_buffers, spec.push
        self.push_size = ctypes.sizeof(spec.push)
        code = load_spirv(name)
        iface = reflect(code)
        self._check_interface(iface)
        self.descriptors = descriptors or DescriptorAllocator(device)
        self._own_descriptors = descriptors is None
        self._sets: dict[tuple, Any] = {}
        self.written = iface.written  # bindings the shader may write: what the recorder's barriers track
        self.texels = {b: TEXEL_FORMATS[f] for b, f in iface.texels.items()}  # binding -> (VkFormat, bytes)
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
        if iface.texels and not self.device.texel_loads:
            raise ValueError(f"{self.name}: reads texel buffers, which this device's buffers are not made as")

    def _type(self, binding: int) -> int:
        if binding in self.texels:
            return vk.VK_DESCRIPTOR_TYPE_STORAGE_TEXEL_BUFFER
        return vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER

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
            binds[i].descriptorType = self._type(i)
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
        key = tuple(key_of(b) for b in buffers)
        hit = self._sets.get(key)
        if hit is None:
            arenas = arenas_of(buffers)
            hit = self._sets[key] = (self._write_set([range_of(b) for b in buffers], arenas), arenas)
        return hit[0]

    def forget_closed(self) -> int:
        """Drop the cached sets that bind a closed buffer (they can never be hit again); returns how many.
        The sets themselves go back when their pool is destroyed."""
        dead = [k for k, (_, arenas) in self._sets.items() if any(a.closed for a in arenas)]
        for k in dead:
            del self._sets[k]
        return len(dead)

    def _write_set(self, ranges, arenas):
        for i, (_, off, n) in enumerate(ranges):
            self._check_range(i, off, n)
        ds = self.descriptors.allocate(self.set_layout)
        infos = ffi.new("VkDescriptorBufferInfo[]", len(ranges))
        views = ffi.new("VkBufferView[]", len(ranges))
        writes = ffi.new("VkWriteDescriptorSet[]", len(ranges))
        for i, (h, off, n) in enumerate(ranges):
            w = writes[i]
            w.sType = vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET
            w.dstSet, w.dstBinding, w.descriptorCount = ds, i, 1
            w.descriptorType = self._type(i)
            if i in self.texels:  # whole texels: a partial one at the end is never read
                fmt, size = self.texels[i]
                views[i] = arenas[i].texel_view(off, n - n % size, fmt)
                w.pTexelBufferView = views + i
            else:
                infos[i].buffer, infos[i].offset, infos[i].range = h, off, n
                w.pBufferInfo = infos + i
        lib.vkUpdateDescriptorSets(self.device.handle, len(ranges), writes, 0, ffi.NULL)
        return ds

    def _check_range(self, i: int, off: int, n: int) -> None:
        limits = self.device.limits
        if i in self.texels:
            align = limits["minTexelBufferOffsetAlignment"]
            max_range = limits["maxTexelBufferElements"] * self.texels[i][1]
            what = "minTexelBufferOffsetAlignment or maxTexelBufferElements"
        else:
            align, max_range = limits["minStorageBufferOffsetAlignment"], limits["maxStorageBufferRange"]
            what = "minStorageBufferOffsetAlignment or maxStorageBufferRange"
        if off % align or n > max_range:
            raise ValueError(
                f"{self.name} binding {i}: range (offset {off}, {n} bytes) breaks {what} ({align}, "
                f"{max_range} bytes): bind big tensors in ranges (BufferView.ranges)"
            )

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
