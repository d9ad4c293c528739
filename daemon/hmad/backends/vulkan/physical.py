"""Physical devices: what each one offers (read before any logical device exists), which one to use, and
whether the shaders can run on it.

Device choice: a real GPU (discrete > integrated > virtual) over a CPU implementation (lavapipe/llvmpipe);
``select`` (``Device`` passes env ``HMAD_VULKAN_DEVICE`` when given none) picks by index (``"1"``) or by
name substring (``"780M"``).
What the shaders need is checked up front (:func:`missing_requirements` names every missing feature or
limit); optional features (cooperative matrix, subgroup arithmetic, memory budget, subgroup size control)
are reported by :func:`capabilities` so that later pipelines can pick shader variants.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import vulkan as vk

from hmad.backends.vulkan.program import TEXEL_FORMATS
from hmad.backends.vulkan.vkerrors import NoVulkanDeviceError, check
from hmad.backends.vulkan.vkffi import cstr, enumerate_all, ffi, lib, new, unpack_version

MIB = 1 << 20
#: Smallest maxStorageBufferRange we accept: big tensors are bound in ranges of at most this much anyway.
MIN_STORAGE_BUFFER_RANGE = 32 * MIB
MIN_API_VERSION = (1, 2)


DEVICE_TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
_TYPE_RANK = {"discrete": 0, "integrated": 1, "virtual": 2, "other": 3, "cpu": 4}
SUBGROUP_OPS = {
    "basic": 0x1,
    "vote": 0x2,
    "arithmetic": 0x4,
    "ballot": 0x8,
    "shuffle": 0x10,
    "shuffle_relative": 0x20,
    "clustered": 0x40,
    "quad": 0x80,
}
EXT_MEMORY_BUDGET = "VK_EXT_memory_budget"
EXT_COOPMAT = "VK_KHR_cooperative_matrix"
EXT_PIPELINE_STATS = "VK_KHR_pipeline_executable_properties"  # opt-in: Device(pipeline_stats=True)
OPTIONAL_EXTENSIONS = (EXT_MEMORY_BUDGET, EXT_COOPMAT)


@dataclass
class MemoryHeap:
    index: int
    size: int
    device_local: bool
    budget: int | None = None  # VK_EXT_memory_budget: what this process may use now
    usage: int | None = None  # VK_EXT_memory_budget: what this process uses now


@dataclass
class MemoryType:
    index: int
    heap: int
    flags: int  # VkMemoryPropertyFlags

    @property
    def names(self) -> list[str]:
        bits = {1: "device_local", 2: "host_visible", 4: "host_coherent", 8: "host_cached"}
        return [n for b, n in bits.items() if self.flags & b]


@dataclass
class PhysicalDeviceInfo:
    """What we read from one physical device, before any logical device exists (plain data: testable)."""

    index: int
    name: str
    type: str
    api_version: tuple[int, int, int]
    driver: str = ""
    vendor_id: int = 0
    limits: dict[str, Any] = field(default_factory=dict)
    features: dict[str, bool] = field(default_factory=dict)
    extensions: set[str] = field(default_factory=set)
    subgroup: dict[str, Any] = field(default_factory=dict)
    heaps: list[MemoryHeap] = field(default_factory=list)
    types: list[MemoryType] = field(default_factory=list)
    compute_queue_family: int | None = None
    timestamp_valid_bits: int = 0
    coopmat_shapes: list[dict[str, Any]] = field(default_factory=list)  # VK_KHR_cooperative_matrix
    storage_texel_buffers: bool = False  # every format of program.TEXEL_FORMATS as a storage texel buffer
    handle: Any = None

    @property
    def is_cpu(self) -> bool:
        low = self.name.lower()
        return self.type == "cpu" or "llvmpipe" in low or "lavapipe" in low


_FEATURES_11 = ("storageBuffer16BitAccess", "uniformAndStorageBuffer16BitAccess")
_FEATURES_12 = (
    "storageBuffer8BitAccess",
    "uniformAndStorageBuffer8BitAccess",
    "shaderFloat16",
    "shaderInt8",
    "bufferDeviceAddress",
    "timelineSemaphore",
)
_FEATURES_13 = ("subgroupSizeControl", "computeFullSubgroups", "shaderIntegerDotProduct", "maintenance4")
_LIMITS = (
    "maxStorageBufferRange",
    "minStorageBufferOffsetAlignment",
    "maxPushConstantsSize",
    "maxComputeSharedMemorySize",
    "maxComputeWorkGroupInvocations",
    "maxBoundDescriptorSets",
    "nonCoherentAtomSize",
    "timestampPeriod",
    "maxMemoryAllocationCount",
    "maxTexelBufferElements",
    "minTexelBufferOffsetAlignment",
)


def _feature_chain(api: tuple[int, int, int], coopmat: bool):
    """VkPhysicalDeviceFeatures2 -> 1.1 -> 1.2 [-> 1.3] [-> cooperative matrix]; returns (head, parts)."""
    parts = {
        "f11": new(
            "VkPhysicalDeviceVulkan11Features", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES
        ),
        "f12": new(
            "VkPhysicalDeviceVulkan12Features", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES
        ),
    }
    if api[:2] >= (1, 3):
        parts["f13"] = new(
            "VkPhysicalDeviceVulkan13Features", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES
        )
    if coopmat:
        parts["coopmat"] = new(
            "VkPhysicalDeviceCooperativeMatrixFeaturesKHR",
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR,
        )
    head = new("VkPhysicalDeviceFeatures2", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2)
    prev = head
    for p in parts.values():
        prev.pNext = p
        prev = p
    return head, parts


def read_features(handle, api, extensions) -> tuple[dict[str, bool], Any, dict]:
    head, parts = _feature_chain(api, EXT_COOPMAT in extensions)
    lib.vkGetPhysicalDeviceFeatures2(handle, head)
    f: dict[str, bool] = {"shaderInt16": bool(head.features.shaderInt16)}
    f.update({k: bool(getattr(parts["f11"], k)) for k in _FEATURES_11})
    f.update({k: bool(getattr(parts["f12"], k)) for k in _FEATURES_12})
    if "f13" in parts:
        f.update({k: bool(getattr(parts["f13"], k)) for k in _FEATURES_13})
    if "coopmat" in parts:
        f["cooperativeMatrix"] = bool(parts["coopmat"].cooperativeMatrix)
    return f, head, parts


def _read_properties(handle, info: PhysicalDeviceInfo) -> None:
    sub = new(
        "VkPhysicalDeviceSubgroupProperties", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES
    )
    drv = new(
        "VkPhysicalDeviceDriverProperties", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES
    )
    ssc = new(
        "VkPhysicalDeviceSubgroupSizeControlProperties",
        sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_PROPERTIES,
    )
    sub.pNext = drv
    drv.pNext = ssc if info.api_version[:2] >= (1, 3) else ffi.NULL
    props = new(
        "VkPhysicalDeviceProperties2", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, pNext=sub
    )
    lib.vkGetPhysicalDeviceProperties2(handle, props)
    lim = props.properties.limits
    info.limits = {k: getattr(lim, k) for k in _LIMITS}
    info.limits["maxComputeWorkGroupCount"] = tuple(lim.maxComputeWorkGroupCount)
    info.limits["maxComputeWorkGroupSize"] = tuple(lim.maxComputeWorkGroupSize)
    info.driver = f"{cstr(drv.driverName)} {cstr(drv.driverInfo)}".strip()
    ops = sub.supportedOperations if sub.supportedStages & vk.VK_SHADER_STAGE_COMPUTE_BIT else 0
    info.subgroup = {
        "size": sub.subgroupSize,
        "ops": sorted(n for n, b in SUBGROUP_OPS.items() if ops & b),
        "min_size": ssc.minSubgroupSize if drv.pNext != ffi.NULL else sub.subgroupSize,
        "max_size": ssc.maxSubgroupSize if drv.pNext != ffi.NULL else sub.subgroupSize,
    }


def read_memory(handle, info: PhysicalDeviceInfo) -> None:
    budget = None
    if EXT_MEMORY_BUDGET in info.extensions:
        budget = new(
            "VkPhysicalDeviceMemoryBudgetPropertiesEXT",
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT,
        )
    mp = new(
        "VkPhysicalDeviceMemoryProperties2",
        sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2,
        pNext=budget if budget is not None else ffi.NULL,
    )
    lib.vkGetPhysicalDeviceMemoryProperties2(handle, mp)
    m = mp.memoryProperties
    info.heaps = [
        MemoryHeap(
            i,
            int(m.memoryHeaps[i].size),
            bool(m.memoryHeaps[i].flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT),
            int(budget.heapBudget[i]) if budget is not None else None,
            int(budget.heapUsage[i]) if budget is not None else None,
        )
        for i in range(m.memoryHeapCount)
    ]
    info.types = [
        MemoryType(i, m.memoryTypes[i].heapIndex, m.memoryTypes[i].propertyFlags)
        for i in range(m.memoryTypeCount)
    ]


def _read_queues(handle, info: PhysicalDeviceInfo) -> None:
    n = ffi.new("uint32_t*")
    lib.vkGetPhysicalDeviceQueueFamilyProperties(handle, n, ffi.NULL)
    fams = ffi.new("VkQueueFamilyProperties[]", n[0])
    lib.vkGetPhysicalDeviceQueueFamilyProperties(handle, n, fams)
    # Prefer a compute queue without graphics (a dedicated/async compute family), else any compute family.
    best = None
    for i in range(n[0]):
        flags = fams[i].queueFlags
        if not flags & vk.VK_QUEUE_COMPUTE_BIT:
            continue
        rank = 0 if not flags & vk.VK_QUEUE_GRAPHICS_BIT else 1
        if best is None or rank < best[0]:
            best = (rank, i, fams[i].timestampValidBits)
    if best is not None:
        info.compute_queue_family, info.timestamp_valid_bits = best[1], best[2]


def read_physical_device(handle, index: int) -> PhysicalDeviceInfo:
    """All the facts device choice, feature checks and the memory plan need."""
    p = new("VkPhysicalDeviceProperties")
    lib.vkGetPhysicalDeviceProperties(handle, p)
    info = PhysicalDeviceInfo(
        index=index,
        name=cstr(p.deviceName),
        type=DEVICE_TYPES.get(p.deviceType, "other"),
        api_version=unpack_version(p.apiVersion),
        vendor_id=p.vendorID,
        handle=handle,
    )
    fn = lib.vkEnumerateDeviceExtensionProperties
    exts, _arr = enumerate_all(
        fn, "vkEnumerateDeviceExtensionProperties", "VkExtensionProperties", handle, ffi.NULL
    )
    info.extensions = {cstr(e.extensionName) for e in exts}
    if info.api_version[:2] >= MIN_API_VERSION:
        info.features, _, _ = read_features(handle, info.api_version, info.extensions)
        _read_properties(handle, info)
    read_memory(handle, info)
    _read_queues(handle, info)
    info.storage_texel_buffers = _texel_formats_supported(handle)
    return info


def _texel_formats_supported(handle) -> bool:
    fp = new("VkFormatProperties")
    bit = vk.VK_FORMAT_FEATURE_STORAGE_TEXEL_BUFFER_BIT
    for fmt, _ in TEXEL_FORMATS.values():
        lib.vkGetPhysicalDeviceFormatProperties(handle, fmt, fp)
        if not fp.bufferFeatures & bit:
            return False
    return True


def texel_loads(info: PhysicalDeviceInfo) -> bool:
    """Whether kernels read their large read-only inputs through storage texel buffers (``imageLoad``):
    on CPU implementations that take every :data:`TEXEL_FORMATS` format. llvmpipe loads a storage buffer
    lane by lane, behind a bounds check for each component, but fetches texels for all its SIMD lanes at
    once (docs/tuning.md: about 10x the loads a second); GPUs keep their storage buffers."""
    return info.is_cpu and info.storage_texel_buffers


# -- choice and requirements ---------------------------------------------------------------------------------
def choose_device(infos: list[PhysicalDeviceInfo], select: str | int | None = None) -> PhysicalDeviceInfo:
    """By index or name substring when ``select`` is given, else a real GPU over a CPU driver."""
    if not infos:
        raise NoVulkanDeviceError(
            "vkEnumeratePhysicalDevices", None, "no Vulkan devices (is a driver installed?)"
        )
    listing = ", ".join(f"{d.index}: {d.name}" for d in infos)
    if select is not None and str(select).strip() != "":
        s = str(select).strip()
        if s.isdigit():
            for d in infos:
                if d.index == int(s):
                    return d
            raise NoVulkanDeviceError("device selection", None, f"no device with index {s} (have {listing})")
        hits = [d for d in infos if s.lower() in d.name.lower()]
        if not hits:
            raise NoVulkanDeviceError(
                "device selection", None, f"no device name contains {s!r} (have {listing})"
            )
        infos = hits
    return min(infos, key=lambda d: (d.is_cpu, _TYPE_RANK.get(d.type, 3), d.index))


def missing_requirements(info: PhysicalDeviceInfo) -> list[str]:
    """Names of everything the shaders need that ``info`` lacks (empty: suitable)."""
    if info.api_version[:2] < MIN_API_VERSION:
        have = ".".join(map(str, info.api_version))
        return [f"Vulkan {MIN_API_VERSION[0]}.{MIN_API_VERSION[1]} (device has {have})"]
    missing = [
        f"feature {k}"
        for k in ("storageBuffer16BitAccess", "storageBuffer8BitAccess", "shaderFloat16", "shaderInt8")
        if not info.features.get(k)
    ]
    rng = info.limits.get("maxStorageBufferRange", 0)
    if rng < MIN_STORAGE_BUFFER_RANGE:
        missing.append(f"maxStorageBufferRange >= {MIN_STORAGE_BUFFER_RANGE >> 20} MiB (device has {rng})")
    if info.limits.get("maxPushConstantsSize", 0) < 128:
        missing.append("maxPushConstantsSize >= 128")
    if "basic" not in info.subgroup.get("ops", []):
        missing.append("subgroup basic operations in compute shaders")
    if info.compute_queue_family is None:
        missing.append("a compute queue")
    return missing


def capabilities(info: PhysicalDeviceInfo) -> dict[str, Any]:
    """Optional things shader variants may use; recorded, never required."""
    ops = info.subgroup.get("ops", [])
    return {
        "cooperative_matrix": bool(info.features.get("cooperativeMatrix")),
        "memory_budget": EXT_MEMORY_BUDGET in info.extensions,
        "subgroup_size": info.subgroup.get("size"),
        "subgroup_size_range": (info.subgroup.get("min_size"), info.subgroup.get("max_size")),
        "subgroup_arithmetic": "arithmetic" in ops,
        "subgroup_shuffle": "shuffle" in ops,
        "subgroup_size_control": bool(info.features.get("subgroupSizeControl")),
        "integer_dot_product": bool(info.features.get("shaderIntegerDotProduct")),
        "shader_int16": bool(info.features.get("shaderInt16")),
        "timestamps": info.timestamp_valid_bits > 0,
    }


def enumerate_devices(instance) -> list[PhysicalDeviceInfo]:
    handles, _arr = enumerate_all(
        lambda n, a: lib.vkEnumeratePhysicalDevices(instance, n, a),
        "vkEnumeratePhysicalDevices",
        "VkPhysicalDevice",
    )
    infos = [read_physical_device(h, i) for i, h in enumerate(handles)]
    for info in infos:
        if info.features.get("cooperativeMatrix"):
            info.coopmat_shapes = _read_coopmat_shapes(instance, info.handle)
    return infos


_COMPONENT_TYPES = {
    vk.VK_COMPONENT_TYPE_FLOAT16_KHR: "f16",
    vk.VK_COMPONENT_TYPE_FLOAT32_KHR: "f32",
    vk.VK_COMPONENT_TYPE_SINT8_KHR: "s8",
    vk.VK_COMPONENT_TYPE_UINT8_KHR: "u8",
    vk.VK_COMPONENT_TYPE_SINT32_KHR: "s32",
    vk.VK_COMPONENT_TYPE_UINT32_KHR: "u32",
}


def _read_coopmat_shapes(instance, handle) -> list[dict[str, Any]]:
    """The (M, N, K, A/B/C/result types, scope) combinations VK_KHR_cooperative_matrix supports."""
    name = b"vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR"
    ptr = lib.vkGetInstanceProcAddr(instance, name)
    if ptr == ffi.NULL:
        return []
    fn = ffi.cast("PFN_vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR", ptr)
    n = ffi.new("uint32_t*")
    check(fn(handle, n, ffi.NULL), "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
    arr = ffi.new("VkCooperativeMatrixPropertiesKHR[]", n[0])
    for i in range(n[0]):
        arr[i].sType = vk.VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR
    check(fn(handle, n, arr), "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
    ct = _COMPONENT_TYPES
    return [
        {
            "M": p.MSize,
            "N": p.NSize,
            "K": p.KSize,
            "A": ct.get(p.AType, str(p.AType)),
            "B": ct.get(p.BType, str(p.BType)),
            "C": ct.get(p.CType, str(p.CType)),
            "result": ct.get(p.ResultType, str(p.ResultType)),
            "subgroup_scope": p.scope == vk.VK_SCOPE_SUBGROUP_KHR,
        }
        for p in arr[0 : n[0]]
    ]
