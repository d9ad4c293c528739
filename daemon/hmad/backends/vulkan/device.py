"""Vulkan device: the instance, and the logical device with one compute queue on the chosen physical device.

Everything talks to the loader through the ``vulkan`` package's raw cffi handles (``vkffi``), not its Python
wrappers: results come back as plain ``VkResult`` ints that :func:`~hmad.backends.vulkan.vkerrors.check`
turns into named errors. Which physical device, and whether it is suitable, is ``physical.py``'s; a device
that lacks what the shaders need is refused with an error naming every missing feature or limit, and the
optional features are recorded in :attr:`Device.caps`.
"""

from __future__ import annotations

import os
from typing import Any

import vulkan as vk

from hmad.backends.vulkan.physical import (
    EXT_COOPMAT,
    EXT_PIPELINE_STATS,
    OPTIONAL_EXTENSIONS,
    MemoryHeap,
    MemoryType,
    capabilities,
    choose_device,
    enumerate_devices,
    missing_requirements,
    read_features,
    read_memory,
    texel_loads,
)
from hmad.backends.vulkan.vkerrors import (
    DeviceUnsuitableError,
    IncompatibleDriver,
    InitializationFailed,
    NoVulkanDeviceError,
    check,
)
from hmad.backends.vulkan.vkffi import ffi, lib, new


def _create_instance():
    app = new(
        "VkApplicationInfo",
        sType=vk.VK_STRUCTURE_TYPE_APPLICATION_INFO,
        pApplicationName=(name := ffi.new("char[]", b"hmad")),
        pEngineName=name,
        apiVersion=vk.VK_MAKE_VERSION(1, 3, 0),
    )
    ci = new("VkInstanceCreateInfo", sType=vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, pApplicationInfo=app)
    out = ffi.new("VkInstance*")
    try:
        check(lib.vkCreateInstance(ci, ffi.NULL, out), "vkCreateInstance")
    except (InitializationFailed, IncompatibleDriver) as e:
        raise NoVulkanDeviceError("vkCreateInstance", e.result, "no usable Vulkan driver") from e
    return out[0]


class Device:
    """One logical device with one compute queue and a command pool; owns the instance too.

    Not thread-safe: the engine thread owns it (one queue, one submitter). ``close()`` destroys everything.
    """

    def __init__(self, select: str | int | None = None, require: bool = True, pipeline_stats: bool = False):
        """``pipeline_stats``: enable VK_KHR_pipeline_executable_properties where the driver has it, so that
        kernels report the compiler's statistics (registers, ...: ``Kernel.statistics``; a diagnostic,
        bench/kernel_stats.py; it may slow pipeline creation)."""
        self.pipeline_stats = False
        if select is None:
            select = os.environ.get("HMAD_VULKAN_DEVICE")
        self.instance = _create_instance()
        try:
            self.all_devices = enumerate_devices(self.instance)
            self.info = choose_device(self.all_devices, select)
            missing = missing_requirements(self.info)
            if missing and require:
                raise DeviceUnsuitableError(self.info.name, missing)
            self.caps = capabilities(self.info)
            self.limits = self.info.limits
            self.texel_loads = texel_loads(self.info)  # buffers may also be storage texel buffers
            self.handle, self.queue = self._create_device(pipeline_stats)
            self.command_pool = self.create_command_pool()
        except BaseException:
            self.close()
            raise
        self.name = self.info.name

    def _create_device(self, pipeline_stats: bool = False):
        info = self.info
        exts = [e for e in OPTIONAL_EXTENSIONS if e in info.extensions]
        if EXT_COOPMAT in exts and not info.features.get("cooperativeMatrix"):
            exts.remove(EXT_COOPMAT)
        # Enable every supported feature we read (re-read, so the chain matches the enabled extensions),
        # except robust buffer access: bounds checks cost bandwidth and the shaders stay in range.
        _, head, parts = read_features(info.handle, info.api_version, set(exts))
        head.features.robustBufferAccess = 0
        if "f13" in parts:
            parts["f13"].robustImageAccess = 0
        stats = None
        if pipeline_stats and EXT_PIPELINE_STATS in info.extensions:
            stats = new(
                "VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR",
                sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PIPELINE_EXECUTABLE_PROPERTIES_FEATURES_KHR,
                pipelineExecutableInfo=1,
            )
            list(parts.values())[-1].pNext = stats
            exts.append(EXT_PIPELINE_STATS)
            self.pipeline_stats = True
        prio = ffi.new("float[]", [1.0])
        qci = new(
            "VkDeviceQueueCreateInfo",
            sType=vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO,
            queueFamilyIndex=info.compute_queue_family,
            queueCount=1,
            pQueuePriorities=prio,
        )
        names = [ffi.new("char[]", e.encode()) for e in exts]
        pnames = ffi.new("char*[]", names) if names else ffi.NULL
        dci = new(
            "VkDeviceCreateInfo",
            sType=vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO,
            pNext=head,
            queueCreateInfoCount=1,
            pQueueCreateInfos=qci,
            enabledExtensionCount=len(names),
            ppEnabledExtensionNames=pnames,
        )
        out = ffi.new("VkDevice*")
        check(lib.vkCreateDevice(info.handle, dci, ffi.NULL, out), "vkCreateDevice")
        q = ffi.new("VkQueue*")
        lib.vkGetDeviceQueue(out[0], info.compute_queue_family, 0, q)
        self.enabled_extensions = exts
        return out[0], q[0]

    def create_command_pool(self):
        """A command pool of the compute queue's family. Recording into command buffers of one pool is
        externally synchronized: a thread that records while another does (the uploader while the steps
        are recorded) takes a pool of its own."""
        ci = new(
            "VkCommandPoolCreateInfo",
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
            flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
            queueFamilyIndex=self.info.compute_queue_family,
        )
        out = ffi.new("VkCommandPool*")
        check(lib.vkCreateCommandPool(self.handle, ci, ffi.NULL, out), "vkCreateCommandPool")
        return out[0]

    # -- memory facts --------------------------------------------------------------------------------------
    def refresh_heaps(self) -> list[MemoryHeap]:
        """Re-read heap sizes and (with VK_EXT_memory_budget) the current budgets and usage."""
        read_memory(self.info.handle, self.info)
        return self.info.heaps

    @property
    def heaps(self) -> list[MemoryHeap]:
        return self.info.heaps

    @property
    def memory_types(self) -> list[MemoryType]:
        return self.info.types

    def describe(self) -> dict[str, Any]:
        """Device facts for ``hmactl status``: name, driver, heaps (size/budget/usage), capabilities."""
        info = self.info
        heaps = [
            {
                "index": h.index,
                "size": h.size,
                "device_local": h.device_local,
                "budget": h.budget,
                "usage": h.usage,
            }
            for h in self.refresh_heaps()
        ]
        return {
            "name": info.name,
            "type": info.type,
            "driver": info.driver,
            "api_version": ".".join(map(str, info.api_version)),
            "heaps": heaps,
            "memory_types": [{"index": t.index, "heap": t.heap, "flags": t.names} for t in info.types],
            "capabilities": dict(self.caps),
            "limits": {
                k: self.limits[k]
                for k in (
                    "maxStorageBufferRange",
                    "minStorageBufferOffsetAlignment",
                    "maxComputeSharedMemorySize",
                )
            },
            "others": [f"{d.index}: {d.name}" for d in self.all_devices if d is not info],
        }

    # -- sync ------------------------------------------------------------------------------------------------
    def create_fence(self, signaled: bool = False):
        ci = new(
            "VkFenceCreateInfo",
            sType=vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO,
            flags=vk.VK_FENCE_CREATE_SIGNALED_BIT if signaled else 0,
        )
        out = ffi.new("VkFence*")
        check(lib.vkCreateFence(self.handle, ci, ffi.NULL, out), "vkCreateFence")
        return out[0]

    def wait_idle(self) -> None:
        check(lib.vkDeviceWaitIdle(self.handle), "vkDeviceWaitIdle")

    def close(self) -> None:
        """Destroy the device and instance (after every buffer/pipeline made from it has been closed)."""
        if getattr(self, "handle", None) is not None:
            lib.vkDeviceWaitIdle(self.handle)
            if getattr(self, "command_pool", None) is not None:
                lib.vkDestroyCommandPool(self.handle, self.command_pool, ffi.NULL)
                self.command_pool = None
            lib.vkDestroyDevice(self.handle, ffi.NULL)
            self.handle = None
        if getattr(self, "instance", None) is not None:
            lib.vkDestroyInstance(self.instance, ffi.NULL)
            self.instance = None

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
