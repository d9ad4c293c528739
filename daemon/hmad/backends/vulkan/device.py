"""Vulkan device: instance, physical-device choice, feature checks, logical device + one compute queue.

Everything talks to the loader through the ``vulkan`` package's raw cffi handles (``vk.lib``/``vk.ffi``), not
its Python wrappers: results come back as plain ``VkResult`` ints that :func:`check` turns into named
errors, and every struct handed to the driver is an ``ffi.new`` pointer held in a local variable until the
call returns (an inline temporary can be freed before the driver reads it: see ../shared/GPU.md).

Device choice: a real GPU (discrete > integrated > virtual) over a CPU implementation (lavapipe/llvmpipe);
``select`` (or env ``HMAD_VULKAN_DEVICE``) picks by index (``"1"``) or by name substring (``"780M"``).
What the shaders need is checked up front and a device that lacks it is refused with an error naming every
missing feature or limit; optional features (cooperative matrix, subgroup arithmetic, memory budget, subgroup
size control) are recorded in :attr:`Device.caps` so that later pipelines can pick shader variants.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import vulkan as vk

from hmad.core.errors import BackendUnusable, HmadError

ffi, lib = vk.ffi, vk.lib

MIB = 1 << 20
#: Smallest maxStorageBufferRange we accept: big tensors are bound in ranges of at most this much anyway.
MIN_STORAGE_BUFFER_RANGE = 32 * MIB
MIN_API_VERSION = (1, 2)


# -- errors ----------------------------------------------------------------------------------------------
class VulkanError(HmadError):
    """A Vulkan call failed. ``result`` is the VkResult code, ``vk_name`` its enum name, ``what`` the call."""

    vk_name = "VK_ERROR"

    def __init__(self, what: str, result: int | None = None, detail: str = ""):
        self.what = what
        self.result = result
        msg = f"{what}: {self.vk_name}" + (f" ({result})" if result is not None else "")
        super().__init__(msg + (f": {detail}" if detail else ""))


class NoVulkanDeviceError(VulkanError):
    """No Vulkan loader/driver, or no device matching the selection."""

    vk_name = "no Vulkan device"


class DeviceUnsuitableError(VulkanError):
    """The chosen device lacks a feature or limit the shaders need; ``missing`` lists them by name."""

    vk_name = "device unsuitable"

    def __init__(self, device_name: str, missing: list[str]):
        self.missing = missing
        super().__init__(f"device {device_name!r}", None, "missing " + "; ".join(missing))


def _err(cls_name: str, vk_name: str) -> type[VulkanError]:
    return type(cls_name, (VulkanError,), {"vk_name": vk_name, "__doc__": f"{vk_name} from the driver."})


# VkResult -> error class, named after the enum (VK_ERROR_OUT_OF_DEVICE_MEMORY -> OutOfDeviceMemory).
NotReady = _err("NotReady", "VK_NOT_READY")


class Timeout(VulkanError, BackendUnusable):
    """VK_TIMEOUT: we only see it from fence waits with a finite timeout, i.e. the GPU hung and its buffers
    may still be in use, so no further step may run (the engine stops; exit 1)."""

    vk_name = "VK_TIMEOUT"


Incomplete = _err("Incomplete", "VK_INCOMPLETE")
OutOfHostMemory = _err("OutOfHostMemory", "VK_ERROR_OUT_OF_HOST_MEMORY")
OutOfDeviceMemory = _err("OutOfDeviceMemory", "VK_ERROR_OUT_OF_DEVICE_MEMORY")
InitializationFailed = _err("InitializationFailed", "VK_ERROR_INITIALIZATION_FAILED")


class DeviceLost(VulkanError, BackendUnusable):
    """VK_ERROR_DEVICE_LOST from the driver: the device runs nothing more (the engine stops; exit 1)."""

    vk_name = "VK_ERROR_DEVICE_LOST"


MemoryMapFailed = _err("MemoryMapFailed", "VK_ERROR_MEMORY_MAP_FAILED")
LayerNotPresent = _err("LayerNotPresent", "VK_ERROR_LAYER_NOT_PRESENT")
ExtensionNotPresent = _err("ExtensionNotPresent", "VK_ERROR_EXTENSION_NOT_PRESENT")
FeatureNotPresent = _err("FeatureNotPresent", "VK_ERROR_FEATURE_NOT_PRESENT")
IncompatibleDriver = _err("IncompatibleDriver", "VK_ERROR_INCOMPATIBLE_DRIVER")
TooManyObjects = _err("TooManyObjects", "VK_ERROR_TOO_MANY_OBJECTS")
FormatNotSupported = _err("FormatNotSupported", "VK_ERROR_FORMAT_NOT_SUPPORTED")
FragmentedPool = _err("FragmentedPool", "VK_ERROR_FRAGMENTED_POOL")
UnknownError = _err("UnknownError", "VK_ERROR_UNKNOWN")
OutOfPoolMemory = _err("OutOfPoolMemory", "VK_ERROR_OUT_OF_POOL_MEMORY")
InvalidExternalHandle = _err("InvalidExternalHandle", "VK_ERROR_INVALID_EXTERNAL_HANDLE")
FragmentationError = _err("FragmentationError", "VK_ERROR_FRAGMENTATION")
InvalidOpaqueCaptureAddress = _err("InvalidOpaqueCaptureAddress", "VK_ERROR_INVALID_OPAQUE_CAPTURE_ADDRESS")

# Codes we branch on (not vk.VK_ERROR_*: the vulkan package has VK_ERROR_OUT_OF_POOL_MEMORY as +1000069000).
VK_ERROR_FRAGMENTED_POOL = -12
VK_ERROR_OUT_OF_POOL_MEMORY = -1000069000

RESULT_ERRORS: dict[int, type[VulkanError]] = {
    1: NotReady,
    2: Timeout,
    5: Incomplete,
    -1: OutOfHostMemory,
    -2: OutOfDeviceMemory,
    -3: InitializationFailed,
    -4: DeviceLost,
    -5: MemoryMapFailed,
    -6: LayerNotPresent,
    -7: ExtensionNotPresent,
    -8: FeatureNotPresent,
    -9: IncompatibleDriver,
    -10: TooManyObjects,
    -11: FormatNotSupported,
    -12: FragmentedPool,
    -13: UnknownError,
    -1000069000: OutOfPoolMemory,
    -1000072003: InvalidExternalHandle,
    -1000161000: FragmentationError,
    -1000257000: InvalidOpaqueCaptureAddress,
}


def check(result: int, what: str) -> None:
    """Raise the :class:`VulkanError` subclass named after ``result`` unless it is VK_SUCCESS.

    Every non-success code is an error here: we never poll (VK_TIMEOUT from a fence wait with a finite
    timeout means the GPU hung, VK_INCOMPLETE means we under-sized an array).
    """
    result = int(result)
    if result == 0:
        return
    cls = RESULT_ERRORS.get(result)
    if cls is None:
        cls = _err("VulkanError", f"VkResult({result})")
    raise cls(what, result)


# -- small cffi helpers ----------------------------------------------------------------------------------
def new(ctype: str, **fields: Any):
    """``ffi.new('ctype*')`` with fields; the caller keeps the pointer alive until the call that reads it."""
    return ffi.new(ctype + "*", fields)


def _str(arr) -> str:
    return ffi.string(arr).decode(errors="replace")


def _version(v: int) -> tuple[int, int, int]:
    return ((v >> 22) & 0x7F, (v >> 12) & 0x3FF, v & 0xFFF)


def _enumerate(fn, what: str, ctype: str, *args):
    """The two-call enumerate idiom: count, then fill."""
    n = ffi.new("uint32_t*")
    check(fn(*args, n, ffi.NULL), what)
    arr = ffi.new(f"{ctype}[]", n[0])
    check(fn(*args, n, arr), what)
    return [arr[i] for i in range(n[0])], arr


# -- physical device facts ---------------------------------------------------------------------------------
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


def _read_features(handle, api, extensions) -> tuple[dict[str, bool], Any, dict]:
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
    info.driver = f"{_str(drv.driverName)} {_str(drv.driverInfo)}".strip()
    ops = sub.supportedOperations if sub.supportedStages & vk.VK_SHADER_STAGE_COMPUTE_BIT else 0
    info.subgroup = {
        "size": sub.subgroupSize,
        "ops": sorted(n for n, b in SUBGROUP_OPS.items() if ops & b),
        "min_size": ssc.minSubgroupSize if drv.pNext != ffi.NULL else sub.subgroupSize,
        "max_size": ssc.maxSubgroupSize if drv.pNext != ffi.NULL else sub.subgroupSize,
    }


def _read_memory(handle, info: PhysicalDeviceInfo) -> None:
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
        name=_str(p.deviceName),
        type=DEVICE_TYPES.get(p.deviceType, "other"),
        api_version=_version(p.apiVersion),
        vendor_id=p.vendorID,
        handle=handle,
    )
    fn = lib.vkEnumerateDeviceExtensionProperties
    exts, _arr = _enumerate(
        fn, "vkEnumerateDeviceExtensionProperties", "VkExtensionProperties", handle, ffi.NULL
    )
    info.extensions = {_str(e.extensionName) for e in exts}
    if info.api_version[:2] >= MIN_API_VERSION:
        info.features, _, _ = _read_features(handle, info.api_version, info.extensions)
        _read_properties(handle, info)
    _read_memory(handle, info)
    _read_queues(handle, info)
    return info


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


# -- the device ----------------------------------------------------------------------------------------------
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


def enumerate_devices(instance) -> list[PhysicalDeviceInfo]:
    handles, _arr = _enumerate(
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
        _, head, parts = _read_features(info.handle, info.api_version, set(exts))
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
        _read_memory(self.info.handle, self.info)
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
