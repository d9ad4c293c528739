"""Push-constant structs: one per shader ``Push`` block, the same fields in the same order.

Each mirrors its shader's block field by field; :class:`hmad.backends.vulkan.pipelines.Kernel` checks the
struct's offsets and size against the SPIR-V when it builds the kernel, and the recorder asserts the struct
type at every dispatch. Which struct a kernel takes is :data:`hmad.backends.vulkan.registry.KERNELS`'.
"""

from __future__ import annotations

import ctypes

from hmad.backends.vulkan.variants import COOPMAT_PEAK, COOPMAT_PEAK_STAGED

u32, f32 = ctypes.c_uint32, ctypes.c_float


class CopyPush(ctypes.Structure):
    """shaders/copy.comp"""

    _fields_ = [("n", u32)]  # vec4 elements


class AddPush(ctypes.Structure):
    """shaders/add.comp"""

    _fields_ = [("n", u32)]


class RmsNormPush(ctypes.Structure):
    """shaders/rms_norm.comp"""

    _fields_ = [("ncols", u32), ("nrows", u32), ("x_stride", u32), ("y_stride", u32), ("eps", f32)]


# The *_off fields below are word offsets of sections of the step metadata (hmad/backends/vulkan/stepmeta.py).


class EmbedPush(ctypes.Structure):
    """shaders/embed.comp"""

    _fields_ = [
        *[(n, u32) for n in ("n_tokens", "dim", "ids_off", "row_begin", "n_rows", "y_stride")],
        ("scale", f32),
        *[(n, u32) for n in ("src_off", "row0_off")],  # the _in variants' (input embeddings)
    ]


class EmbedDqPush(ctypes.Structure):
    """shaders/embed_dq.comp"""

    _fields_ = [
        *[(n, u32) for n in ("n_tokens", "dim", "ids_off", "row_begin", "n_rows", "y_stride", "row_bytes")],
        ("scale", f32),
        *[(n, u32) for n in ("src_off", "row0_off")],  # the _in variants' (input embeddings)
    ]


class RopePush(ctypes.Structure):
    """shaders/rope.comp"""

    _fields_ = [
        *[(n, u32) for n in ("n_tokens", "n_heads", "head_dim", "x_stride", "y_stride", "pos_off")],
        ("base", f32),
        ("scale", f32),
    ]


class GegluPush(ctypes.Structure):
    """shaders/geglu.comp"""

    _fields_ = [(n, u32) for n in ("n_cols", "n_rows", "gate_stride", "up_stride", "y_stride")]


class KvWritePush(ctypes.Structure):
    """shaders/kv_write.comp"""

    _fields_ = [(n, u32) for n in ("n_tokens", "row", "k_stride", "v_stride", "slot_off")]


class AttentionSplitPush(ctypes.Structure):
    """shaders/attention_split.comp"""

    _fields_ = [
        *[(n, u32) for n in ("n_tokens", "n_heads", "n_kv_heads", "head_dim", "q_stride", "n_splits")],
        *[(n, u32) for n in ("block_size", "window", "pos_off", "seq_off", "info_off")],
        ("scale", f32),
        ("skip_off", u32),
        ("min_keys", u32),
        ("vis_off", u32),  # 0, or the visible section (an image's rows see past their own position)
    ]


class AttentionPrefillPush(ctypes.Structure):
    """shaders/attention_prefill.comp and attention_prefill_cm.comp"""

    _fields_ = [
        *[(n, u32) for n in ("max_tiles", "n_heads", "n_kv_heads", "head_dim", "q_stride", "n_splits")],
        *[(n, u32) for n in ("block_size", "window", "pos_off", "info_off", "tiles_off")],
        ("scale", f32),
        ("vis_off", u32),  # 0, or the visible section (an image's rows see past their own position)
    ]


class AttentionReducePush(ctypes.Structure):
    """shaders/attention_reduce.comp"""

    _fields_ = [(n, u32) for n in ("n_tokens", "n_heads", "head_dim", "n_splits", "o_stride")]


class QuantizeQ8Push(ctypes.Structure):
    """shaders/quantize_q8.comp"""

    _fields_ = [(n, u32) for n in ("K", "T", "x_stride")]


class ResidualNormPush(ctypes.Structure):
    """shaders/residual_norm.comp; ``splits``: how many K-split partial sums ``a`` comes as (1: its values)"""

    _fields_ = [("ncols", u32), ("nrows", u32), ("eps", f32), ("splits", u32)]

    def __init__(self, ncols: int, nrows: int, eps: float, splits: int = 1):
        super().__init__(ncols, nrows, eps, splits)


class NormRopePush(ctypes.Structure):
    """shaders/norm_rope.comp"""

    _fields_ = [
        *[(n, u32) for n in ("n_tokens", "n_heads", "head_dim", "x_stride", "y_stride", "pos_off")],
        *[(n, f32) for n in ("base", "scale", "eps")],
    ]


class NormRopeKvPush(ctypes.Structure):
    """shaders/norm_rope_kv.comp; ``splits``: how many K-split partial sums q, k and v come as (1: values).
    Heads of at most MAX_HEAD_DIM values (the shader's shared copy of a head)."""

    MAX_HEAD_DIM = 512

    _fields_ = [
        *[(n, u32) for n in ("n_tokens", "n_heads", "n_kv_heads", "head_dim", "pos_off", "slot_off")],
        *[(n, f32) for n in ("base", "scale", "eps")],
        *[(n, u32) for n in ("q_splits", "k_splits", "v_splits")],
    ]

    def __init__(self, *args, splits: tuple[int, int, int] = (1, 1, 1)):
        if len(args) > 3 and args[3] > self.MAX_HEAD_DIM:
            raise ValueError(f"norm_rope_kv: heads of {args[3]} values, at most {self.MAX_HEAD_DIM}")
        super().__init__(*args, *splits)


class ArgmaxPush(ctypes.Structure):
    """shaders/argmax.comp"""

    _fields_ = [(n, u32) for n in ("n_rows", "n_cols", "row_stride", "chunk")]


class FeedPush(ctypes.Structure):
    """shaders/feed_tokens.comp"""

    _fields_ = [(n, u32) for n in ("tokens_off", "feed_off", "max_tokens", "vocab")]


class LogitBiasPush(ctypes.Structure):
    """shaders/logit_bias.comp"""

    _fields_ = [(n, u32) for n in ("n_rows", "vocab", "row_stride", "capacity")]


class SampleTopkPush(ctypes.Structure):
    """shaders/sample_topk.comp"""

    _fields_ = [(n, u32) for n in ("n_rows", "k", "sample_off")]


class TopkPush(ctypes.Structure):
    """shaders/topk.comp"""

    _fields_ = [(n, u32) for n in ("n_rows", "n_cols", "row_stride", "k", "chunk")]


class RowLsePush(ctypes.Structure):
    """shaders/row_lse.comp"""

    _fields_ = [(n, u32) for n in ("n_rows", "n_cols", "row_stride", "chunk")]


class RowGatherPush(ctypes.Structure):
    """shaders/row_gather.comp"""

    _fields_ = [(n, u32) for n in ("n_rows", "n_cols", "row_stride", "targets_off")]


class CoopMatPeakPush(ctypes.Structure):
    """shaders/coopmat_peak.comp (bench_vulkan_coopmat_peak.py): built for the (NA, NB) fragment counts of
    VARIANTS (kernels ``coopmat_peak_a<NA>x<NB>``: NA NB accumulators a subgroup), ROUNDS x NA x NB products
    a loop iteration (variants.COOPMAT_PEAK: the list shaders/build.py builds)."""

    _fields_ = [("iters", u32), ("store_groups", u32), ("never", u32)]
    VARIANTS = COOPMAT_PEAK
    #: a4x4 with its fragments from shared memory (``_lds``), and the tile stored each step too (``_step``)
    STAGED = tuple(suffix for suffix, _ in COOPMAT_PEAK_STAGED)
    ROUNDS = 4
    NAN = 0x7FC00000  # ``never``: no sum equals a NaN


# -- the matmul kernels (kernels_matmul.py, kernels_q8.py, kernels_coopmat.py, kernels_mmq.py) -------------
class MatMulPush(ctypes.Structure):
    """shaders/mul_mat_vec.comp, mul_mat_vec_unit.comp, mul_mat_vec_q8.comp, mul_mat.comp, mul_mat_reg.comp"""

    _fields_ = [
        ("K", u32),  # weights per row
        ("N", u32),  # rows of W in the bound range
        ("T", u32),  # tokens
        ("x_stride", u32),  # floats between rows of x (multiple of 4)
        ("y_stride", u32),  # floats between rows of y
        ("row_bytes", u32),  # bytes of one stored W row
        ("row_offset", u32),  # y column of the range's first row
    ]


class CoopMatPush(ctypes.Structure):
    """shaders/mul_mm_coopmat.comp and mul_mmq_coopmat.comp"""

    _fields_ = [*MatMulPush._fields_, ("k_split", u32)]  # weights of K per split (workgroup z)


class RowScalePush(ctypes.Structure):
    """shaders/row_scale.comp"""

    _fields_ = [("K", u32), ("T", u32), ("x_stride", u32)]


class SplitReducePush(ctypes.Structure):
    """shaders/split_reduce.comp and geglu_row_scale.comp"""

    _fields_ = [("N", u32), ("T", u32), ("splits", u32), ("y_stride", u32), ("row_offset", u32)]
