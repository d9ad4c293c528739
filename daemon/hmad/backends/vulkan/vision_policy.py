"""Which vision-encoder kernel runs, and how its tensors are stored: pure functions of the options, the
device's capabilities (:class:`~hmad.backends.vulkan.policy.DeviceCaps`) and the shapes, testable without
a GPU (tests/test_vulkan_vision.py), as policy.py is for the text model.

Every kernel here has one plain path (no subgroup operation, no cooperative matrix), which lavapipe runs and
which is the only path so far; a cooperative-matrix GEMM and attention would be picked here, by
``caps.coopmat``, once they exist.
"""

from __future__ import annotations

import math

from hmad.backends.vulkan.policy import DeviceCaps
from hmad.backends.vulkan.variants import VISION_ATTENTION_DH, VISION_ATTENTION_MAX_DH

#: how the matrices are stored on the device: "auto" (as the array given: float16 stays float16, anything
#: else becomes float32), "f32" or "f16" (half the memory; the product still sums in float32)
WEIGHT_FORMATS = ("auto", "f32", "f16")
#: tensors that are not GEMM operands stay float32 whatever the option: vectors (norms, biases) and the
#: position embedding, which vision_add reads as float32
ADDEND_NAMES = ("v.position_embd.weight",)


def weight_format(option: str, name: str, ndim: int, dtype_name: str) -> str:
    """ "f32" or "f16": how the tensor ``name`` (its ndim and numpy dtype's name) is stored on the device."""
    if option not in WEIGHT_FORMATS:
        raise ValueError(f"vision weight format {option!r}: one of {WEIGHT_FORMATS}")
    if ndim < 2 or name in ADDEND_NAMES:
        return "f32"
    if option == "auto":
        return "f16" if dtype_name == "float16" else "f32"
    return option


def gemm_kernel(fmt: str, transposed: bool) -> str:
    """The GEMM variant: ``transposed`` for a weight stored (in, out) (the projector), else (out, in)."""
    return f"vision_{'matmul' if transposed else 'linear'}_{fmt}"


def attention_kernel(head_dim: int) -> str | None:
    """The attention variant for ``head_dim``: one built for it, else the run-time-sized one (a multiple of
    4 up to VISION_ATTENTION_MAX_DH), else None (unsupported)."""
    if head_dim in VISION_ATTENTION_DH:
        return f"vision_attention_dh{head_dim}"
    if head_dim % 4 == 0 and 0 < head_dim <= VISION_ATTENTION_MAX_DH:
        return "vision_attention_any"
    return None


def unsupported(hidden: int, n_heads: int) -> str | None:
    """Why the kernels cannot take a tower of this width and head count, or None."""
    dh = hidden // n_heads
    if attention_kernel(dh) is None:
        most = VISION_ATTENTION_MAX_DH
        return f"vision head size {dh}: the attention kernel takes multiples of 4 up to {most}"
    return None


def activation_bytes(n_patches: int, hidden: int, ffn: int, patch_values: int) -> int:
    """Bytes of the largest activation of one image (float32): the MLP's hidden layer, or the im2col rows."""
    return 4 * n_patches * max(hidden, ffn, patch_values)


def images_per_pass(n: int, per_image_bytes: int, caps: DeviceCaps) -> int:
    """How many of ``n`` images one pass of the encoder takes: each activation is bound whole, so the
    largest (``per_image_bytes`` an image) must fit maxStorageBufferRange. At least 1 (one image over the
    range is refused by the scratch pool, with its size)."""
    return max(1, min(n, caps.max_range // max(1, per_image_bytes)))


def groups_2d(n: int, max_x: int) -> tuple[int, int, int]:
    """n workgroups as (x, y, 1) within maxComputeWorkGroupCount[0] (the shader uses group_index())."""
    if n <= max_x:
        return (max(n, 1), 1, 1)
    return (max_x, math.ceil(n / max_x), 1)
