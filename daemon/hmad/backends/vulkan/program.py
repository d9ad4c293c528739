"""SPIR-V programs: find the committed ``shaders/spv/<name>.spv``, and read what its interface is.

The reflection is deliberately tiny (a few opcodes of the SPIR-V binary): the buffer bindings of set 0
(and which of them the shader may write: a ``readonly`` block is decorated NonWritable), which of those are
storage texel buffers (``imageBuffer`` with a format: :data:`TEXEL_FORMATS`), and the push-constant
block's member offsets and size. :class:`~hmad.backends.vulkan.pipelines.Kernel` uses it
to assert, when a pipeline is built, that the Python push-constant struct mirrors the shader's block and that
the binding count it will be given matches the shader: a drifted struct fails loudly at load, not as garbage.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

SPIRV_MAGIC = 0x07230203
# opcodes
OP_TYPE_INT, OP_TYPE_FLOAT, OP_TYPE_VECTOR, OP_TYPE_IMAGE = 21, 22, 23, 25
OP_TYPE_STRUCT, OP_TYPE_POINTER = 30, 32
OP_VARIABLE, OP_DECORATE, OP_MEMBER_DECORATE = 59, 71, 72
# decorations, storage classes
DEC_NON_WRITABLE, DEC_BINDING, DEC_SET, DEC_OFFSET = 24, 33, 34, 35
SC_UNIFORM_CONSTANT, SC_UNIFORM, SC_PUSH_CONSTANT, SC_STORAGE_BUFFER = 0, 2, 9, 12
DIM_BUFFER = 5  # an OpTypeImage's Dim: a texel buffer

#: SPIR-V image format of a storage texel buffer -> (VkFormat, bytes a texel): the formats the shaders'
#: ``imageBuffer`` bindings declare (r16ui, r32ui, rgba32ui, rgba32f, rgba16f, r32f, rg32f)
TEXEL_FORMATS: dict[int, tuple[int, int]] = {
    38: (74, 2),  # R16ui: VK_FORMAT_R16_UINT
    33: (98, 4),  # R32ui: VK_FORMAT_R32_UINT
    30: (107, 16),  # Rgba32ui: VK_FORMAT_R32G32B32A32_UINT
    1: (109, 16),  # Rgba32f: VK_FORMAT_R32G32B32A32_SFLOAT
    2: (97, 8),  # Rgba16f: VK_FORMAT_R16G16B16A16_SFLOAT
    3: (100, 4),  # R32f: VK_FORMAT_R32_SFLOAT
    6: (103, 8),  # Rg32f: VK_FORMAT_R32G32_SFLOAT
}


def shader_dir() -> Path:
    """``HMAD_SHADER_DIR`` if set, else ``shaders/spv`` of the source tree this package lives in."""
    env = os.environ.get("HMAD_SHADER_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[4] / "shaders" / "spv"


def load_spirv(name: str) -> bytes:
    path = shader_dir() / f"{name}.spv"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no compiled shader {name!r} (python3 shaders/build.py makes it)")
    code = path.read_bytes()
    if len(code) % 4 or struct.unpack_from("<I", code)[0] != SPIRV_MAGIC:
        raise ValueError(f"{path}: not a SPIR-V module")
    return code


@dataclass(frozen=True)
class Interface:
    bindings: tuple[int, ...]  # buffer binding numbers in set 0 (storage buffers and texel buffers), sorted
    push_offsets: tuple[int, ...]  # byte offset of each push-constant member, in declaration order
    push_size: int  # bytes up to the end of the last member (0: no push constants)
    written: tuple[int, ...] = ()  # the bindings the shader may write (not declared readonly)
    texels: dict[int, int] = field(default_factory=dict)  # storage texel buffer binding -> SPIR-V format


def reflect(code: bytes) -> Interface:
    """Bindings and push-constant layout of a compute module (scalars and vectors in the push block).
    A texel-buffer binding whose format :data:`TEXEL_FORMATS` lacks is refused (ValueError)."""
    words = struct.unpack(f"<{len(code) // 4}I", code)
    sizes: dict[int, int] = {}
    structs: dict[int, list[int]] = {}
    pointers: dict[int, int] = {}
    variables: list[tuple[int, int, int]] = []  # (pointer type, id, storage class)
    binding: dict[int, int] = {}
    dset: dict[int, int] = {}
    offsets: dict[tuple[int, int], int] = {}
    readonly: set[int] = set()  # variables, and (struct, member) pairs, decorated NonWritable
    images: dict[int, int] = {}  # buffer-dimensioned image type -> its SPIR-V image format
    i = 5
    while i < len(words):
        op, n = words[i] & 0xFFFF, words[i] >> 16
        a = words[i + 1 : i + n]
        if op in (OP_TYPE_INT, OP_TYPE_FLOAT):
            sizes[a[0]] = a[1] // 8
        elif op == OP_TYPE_VECTOR:
            sizes[a[0]] = sizes.get(a[1], 4) * a[2]
        elif op == OP_TYPE_IMAGE and a[2] == DIM_BUFFER:
            images[a[0]] = a[7]
        elif op == OP_TYPE_STRUCT:
            structs[a[0]] = list(a[1:])
        elif op == OP_TYPE_POINTER:
            pointers[a[0]] = a[2]
        elif op == OP_VARIABLE:
            variables.append((a[0], a[1], a[2]))
        elif op == OP_DECORATE and a[1] in (DEC_BINDING, DEC_SET):
            (binding if a[1] == DEC_BINDING else dset)[a[0]] = a[2]
        elif op == OP_DECORATE and a[1] == DEC_NON_WRITABLE:
            readonly.add(a[0])
        elif op == OP_MEMBER_DECORATE and a[2] == DEC_OFFSET:
            offsets[(a[0], a[1])] = a[3]
        elif op == OP_MEMBER_DECORATE and a[2] == DEC_NON_WRITABLE:
            readonly.add((a[0], a[1]))
        i += max(n, 1)

    def is_buffer(ptr: int, sc: int) -> bool:  # a block, or a texel buffer
        texel = sc == SC_UNIFORM_CONSTANT and pointers.get(ptr) in images
        return sc in (SC_STORAGE_BUFFER, SC_UNIFORM) or texel

    buffers = [
        (binding[v], ptr, v)
        for ptr, v, sc in variables
        if dset.get(v, 0) == 0 and v in binding and is_buffer(ptr, sc)
    ]
    texels = {b: images[pointers[ptr]] for b, ptr, _ in buffers if pointers.get(ptr) in images}
    unknown = {b: f for b, f in texels.items() if f not in TEXEL_FORMATS}
    if unknown:
        raise ValueError(f"texel buffer bindings {unknown} (binding: SPIR-V image format) of no known format")
    bufs = sorted({b for b, _, _ in buffers})  # a binding may be declared twice (aliases)

    def is_readonly(ptr: int, var: int) -> bool:
        members = structs.get(pointers.get(ptr, -1), [])
        sid = pointers.get(ptr, -1)
        return var in readonly or (bool(members) and all((sid, m) in readonly for m in range(len(members))))

    written = tuple(sorted({b for b, ptr, v in buffers if not is_readonly(ptr, v)}))
    push_offsets: tuple[int, ...] = ()
    push_size = 0
    for ptr, _, sc in variables:
        if sc == SC_PUSH_CONSTANT:
            sid = pointers[ptr]
            members = structs[sid]
            push_offsets = tuple(offsets[(sid, m)] for m in range(len(members)))
            push_size = push_offsets[-1] + sizes.get(members[-1], 4) if members else 0
    return Interface(tuple(bufs), push_offsets, push_size, written, texels)
