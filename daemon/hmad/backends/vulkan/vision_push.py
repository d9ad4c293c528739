"""Push-constant structs of the vision encoder's shaders (shaders/vision_*.comp), field for field their
``Push`` blocks, and :data:`VISION_SOURCES` (source -> (struct, default workgroup size)), which the kernel
registry adds to its SOURCES. Kept apart from push.py, the text model's structs, so the two change apart."""

from __future__ import annotations

import ctypes

u32, f32 = ctypes.c_uint32, ctypes.c_float

#: the tiled GEMM's workgroup (vision_linear.comp requires 256) and the row norms' (a power of two <= 256)
LINEAR_BLOCK = 256
NORM_BLOCK = 256
#: query rows per attention workgroup (one an invocation)
ATTENTION_BLOCK = 64
#: vision_attention_cm.comp: 4 subgroups of 32 a workgroup (BLOCK_SIZE), 16 query rows each; its operands
#: (vision_qkv_f16.comp) hold each head's rows rounded up to whole workgroups
ATTENTION_CM_BLOCK = 128
ATTENTION_CM_ROWS = 64


class VisionLinearPush(ctypes.Structure):
    """shaders/vision_linear.comp"""

    _fields_ = [(n, u32) for n in ("K", "N", "T", "has_bias")]


class VisionNormPush(ctypes.Structure):
    """shaders/vision_norm.comp"""

    _fields_ = [("D", u32), ("rows", u32), ("eps", f32)]


class VisionEltwisePush(ctypes.Structure):
    """shaders/vision_eltwise.comp"""

    _fields_ = [("n", u32), ("nb", u32), ("nc", u32)]


class VisionIm2colPush(ctypes.Structure):
    """shaders/vision_im2col.comp"""

    _fields_ = [(n, u32) for n in ("n", "S", "psize", "C", "Kp")]


class VisionPoolPush(ctypes.Structure):
    """shaders/vision_pool.comp"""

    _fields_ = [(n, u32) for n in ("n", "side", "k", "D")]


class VisionAttentionPush(ctypes.Structure):
    """shaders/vision_attention.comp"""

    _fields_ = [("P", u32), ("W", u32), ("dh", u32), ("scale", f32), ("bias", u32)]


class VisionQkvPush(ctypes.Structure):
    """shaders/vision_qkv_f16.comp"""

    _fields_ = [(n, u32) for n in ("n", "P", "PP", "W", "dh", "DHP")] + [("scale", f32), ("bias", u32)]


VISION_SOURCES: dict[str, tuple[type[ctypes.Structure], int]] = {
    "vision_linear.comp": (VisionLinearPush, LINEAR_BLOCK),
    "vision_norm.comp": (VisionNormPush, NORM_BLOCK),
    "vision_eltwise.comp": (VisionEltwisePush, 256),
    "vision_im2col.comp": (VisionIm2colPush, 256),
    "vision_pool.comp": (VisionPoolPush, 256),
    "vision_attention.comp": (VisionAttentionPush, ATTENTION_BLOCK),
    "vision_attention_cm.comp": (VisionAttentionPush, ATTENTION_CM_BLOCK),
    "vision_qkv_f16.comp": (VisionQkvPush, 256),
}
