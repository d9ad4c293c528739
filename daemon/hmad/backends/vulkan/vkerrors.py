"""Named Vulkan errors: one class per ``VkResult`` code, and :func:`check`, which raises the one a call
returned. :class:`DeviceLost` and :class:`Timeout` are also ``BackendUnusable``: the device runs nothing
more.
"""

from __future__ import annotations

from hmad.core.errors import BackendUnusable, HmadError


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
