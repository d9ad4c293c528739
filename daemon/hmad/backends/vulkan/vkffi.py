"""The raw cffi handles to the Vulkan loader (``ffi``, ``lib``) and the small helpers every caller shares.

Every struct handed to the driver is an ``ffi.new`` pointer held in a local variable until the call returns
(an inline temporary can be freed before the driver reads it: see ../shared/GPU.md).
"""

from __future__ import annotations

from typing import Any

import vulkan as vk

from hmad.backends.vulkan.vkerrors import check

ffi, lib = vk.ffi, vk.lib


def new(ctype: str, **fields: Any):
    """``ffi.new('ctype*')`` with fields; the caller keeps the pointer alive until the call that reads it."""
    return ffi.new(ctype + "*", fields)


def cstr(arr) -> str:
    return ffi.string(arr).decode(errors="replace")


def unpack_version(v: int) -> tuple[int, int, int]:
    return ((v >> 22) & 0x7F, (v >> 12) & 0x3FF, v & 0xFFF)


def enumerate_all(fn, what: str, ctype: str, *args):
    """The two-call enumerate idiom: count, then fill."""
    n = ffi.new("uint32_t*")
    check(fn(*args, n, ffi.NULL), what)
    arr = ffi.new(f"{ctype}[]", n[0])
    check(fn(*args, n, arr), what)
    return [arr[i] for i in range(n[0])], arr
