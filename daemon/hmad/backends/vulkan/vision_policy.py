"""Which vision-encoder kernel runs, and how its tensors are stored: pure functions of the options, the
device's capabilities (:class:`~hmad.backends.vulkan.policy.DeviceCaps`) and the shapes, testable without
a GPU (tests/test_vulkan_vision.py), as policy.py is for the text model.

The GEMMs run the text model's matmul kernels where they fit (:func:`gemm_kernel`): the cooperative-matrix
GEMM on devices offering it, its plain tiled mat-mat otherwise; vision_linear.comp is the fallback. The
attention runs on cooperative matrices where the GEMM does (:func:`attention_kernel`), else on the plain
kernel. The other kernels have one plain path (no subgroup operation, no cooperative matrix), which lavapipe
runs.
"""

from __future__ import annotations

import math

from hmad.backends.vulkan import policy
from hmad.backends.vulkan.kernels_coopmat import coopmat_kernel_name
from hmad.backends.vulkan.options import VulkanOptions
from hmad.backends.vulkan.policy import DeviceCaps
from hmad.backends.vulkan.variants import VISION_ATTENTION_CM_DH, VISION_ATTENTION_DH, VISION_ATTENTION_MAX_DH
from hmad.core.tensors import QType

#: how the matrices are stored on the device: "auto" (float16 where the GEMMs run on cooperative matrices,
#: whose operand it is, or where the array given is float16; else float32, exact), "f32" or "f16" (half the
#: memory; the products still sum in float32)
WEIGHT_FORMATS = ("auto", "f32", "f16")
#: the matrices given (in, out), stored transposed, (out, in), as the text kernels read W (N, K)
TRANSPOSED_NAMES = ("mm.input_projection.weight",)
#: the text kernels take K in whole steps of this many values (mul_mm_coopmat.comp's BK; mul_mat.comp needs
#: K % 32, mul_mat_reg.comp and row_scale.comp K % 8)
TEXT_K_GROUP = 64
#: where a GEMM's K is padded with zeros to whole TEXT_K_GROUP steps when the tower is uploaded (by name):
#: the patch embedding's K (C * p * p: im2col writes the zeros), and the FFN width (Gemma 3's 4304): fc1's
#: weight gains zero rows and its bias zeros (so fc1's padding columns are 0, and GELU(0) = 0), fc2's
#: weight zero columns
PAD_ROWS_SUFFIXES = ("ffn_up.weight", "ffn_up.bias")
PAD_COLS_SUFFIXES = ("ffn_down.weight",)
#: tensors that are not GEMM operands stay float32 whatever the option: vectors (norms, biases) and the
#: position embedding, which vision_add reads as float32
ADDEND_NAMES = ("v.position_embd.weight",)


def weight_format(option: str, name: str, ndim: int, dtype_name: str, coopmat: bool = False) -> str:
    """ "f32" or "f16": how the tensor ``name`` (its ndim and numpy dtype's name) is stored on the device;
    ``coopmat``: the GEMMs run on cooperative matrices (policy.coopmat_on), where "auto" means float16."""
    if option not in WEIGHT_FORMATS:
        raise ValueError(f"vision weight format {option!r}: one of {WEIGHT_FORMATS}")
    if ndim < 2 or name in ADDEND_NAMES:
        return "f32"
    if option == "auto":
        return "f16" if coopmat or dtype_name == "float16" else "f32"
    return option


def padded_k(k: int) -> int:
    """A GEMM's K padded with zeros to whole TEXT_K_GROUP steps (PAD_ROWS_SUFFIXES), so that it runs the
    text kernels."""
    return -(-k // TEXT_K_GROUP) * TEXT_K_GROUP


def gemm_kernel(o: VulkanOptions, c: DeviceCaps, fmt: str, t: int, k: int) -> str:
    """The kernel of y (t, N) = x (t, k) float32 · Wᵀ, W stored (N, k) in ``fmt`` (``o``: the resolved
    text options, whose ``coopmat`` and ``matmul_registers`` apply here too):

    - float16 W on a device with the float16 cooperative matrix (policy.coopmat_on): the text model's
      cooperative-matrix GEMM (``mul_mm_coopmat_f16_<BT>x<BN>``, x as row_scale.comp's float16 copy);
    - else the text model's tiled float32 mat-mat (``mul_mat_<fmt>``, or ``mul_mat_reg_<fmt>`` where
      policy.matmul_registers says: CPU drivers);
    - K not a multiple of TEXT_K_GROUP: vision_linear.comp (``vision_linear_<fmt>``), which takes any K.
      Uploaded towers never have one (Gemma 3's width 1152 is whole steps; the patch embedding's 588 and
      the FFN's 4304 are padded: PAD_ROWS_SUFFIXES); weights handed to the ops as arrays keep their K.
    """
    if k % TEXT_K_GROUP:
        return fallback_kernel(fmt)
    if fmt == "f16" and policy.coopmat_on(o, c):
        return coopmat_kernel_name(t, QType.F16)
    return policy.matmul_kernel(fmt, o.matmul_registers == "on", c.texel_loads)


def fallback_kernel(fmt: str, transposed: bool = False) -> str:
    """vision_linear.comp's variant: ``transposed`` for a weight stored (in, out), else (out, in)."""
    return f"vision_{'matmul' if transposed else 'linear'}_{fmt}"


def attention_cm(o: VulkanOptions, c: DeviceCaps) -> bool:
    """Whether the attention may run on cooperative matrices (vision_attention_cm.comp): the text model's
    ``attention_cm`` option and float16 cooperative matrices (policy.coopmat_on: 32-wide subgroups), with
    subgroup shuffles (its softmax's two lanes a row)."""
    return bool(o.attention_cm) and policy.coopmat_on(o, c) and c.subgroup_shuffle


def attention_kernel(head_dim: int, cm: bool = False) -> str | None:
    """The attention variant for ``head_dim``: with ``cm`` (:func:`attention_cm`) and a head of whole
    8-value groups up to the largest VISION_ATTENTION_CM_DH, the cooperative-matrix one built for the
    smallest of those that holds it (the head padded with zeros: Gemma 3's 72 runs ``_d80``); else the
    plain one built for it, else the run-time-sized one (a multiple of 4 up to VISION_ATTENTION_MAX_DH),
    else None (unsupported)."""
    padded = next((d for d in VISION_ATTENTION_CM_DH if head_dim <= d), None)
    if cm and head_dim % 8 == 0 and padded:
        return f"vision_attention_cm_d{padded}"
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
