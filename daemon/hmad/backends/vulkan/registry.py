"""The kernel registry: :data:`KERNELS`, SPIR-V variant name -> its interface (:class:`KernelSpec`).

Every variant of :data:`hmad.backends.vulkan.variants.VARIANTS` (the list shaders/build.py compiles) is
registered with the binding count written there and, by its source, the push struct that mirrors the
shader's ``Push`` block and the default workgroup size (specialization constant 0). Variants share a .comp
and its push struct; a mul_mm_coopmat variant's workgroup size is its layout's.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from hmad.backends.vulkan import push as p
from hmad.backends.vulkan.kernels_coopmat import coopmat_variant
from hmad.backends.vulkan.kernels_matmul import MATMUL_BLOCK, MATMUL_REG_BLOCK, MATVEC_BLOCK, UNIT_BLOCK
from hmad.backends.vulkan.kernels_mmq import MMQ_BLOCK
from hmad.backends.vulkan.kernels_q8 import Q8_MATVEC_BLOCK
from hmad.backends.vulkan.shapes import ATTENTION_ONE_LANE_BLOCK, RESIDUAL_BLOCK
from hmad.backends.vulkan.variants import VARIANTS, Variant
from hmad.backends.vulkan.vision_push import VISION_SOURCES


@dataclass(frozen=True)
class KernelSpec:
    source: str  # the .comp it is built from (documentation; the build list is variants.VARIANTS)
    n_buffers: int
    push: type[ctypes.Structure]
    block_size: int  # default workgroup size (specialization constant 0)


#: source -> (push struct, default workgroup size)
SOURCES: dict[str, tuple[type[ctypes.Structure], int]] = {
    "copy.comp": (p.CopyPush, 256),
    "read.comp": (p.CopyPush, 256),
    "add.comp": (p.AddPush, 256),
    "rms_norm.comp": (p.RmsNormPush, 128),
    "embed.comp": (p.EmbedPush, 128),
    "embed_dq.comp": (p.EmbedDqPush, 128),
    "rope.comp": (p.RopePush, 256),
    "geglu.comp": (p.GegluPush, 256),
    "kv_write.comp": (p.KvWritePush, 256),
    "attention_decode.comp": (p.AttentionSplitPush, 256),
    "attention_decode_kl.comp": (p.AttentionSplitPush, 256),
    "attention_prefill.comp": (p.AttentionPrefillPush, 256),
    "attention_prefill_cm.comp": (p.AttentionPrefillPush, 128),
    "attention_split.comp": (p.AttentionSplitPush, 256),
    "attention_split_l1.comp": (p.AttentionSplitPush, ATTENTION_ONE_LANE_BLOCK),
    "attention_reduce.comp": (p.AttentionReducePush, 256),
    "argmax.comp": (p.ArgmaxPush, 256),
    "topk.comp": (p.TopkPush, 256),
    "row_lse.comp": (p.RowLsePush, 256),
    "row_gather.comp": (p.RowGatherPush, 64),
    "feed_tokens.comp": (p.FeedPush, 64),
    "logit_bias.comp": (p.LogitBiasPush, 64),
    "sample_topk.comp": (p.SampleTopkPush, 128),  # block >= topk's candidates
    "norm_rope.comp": (p.NormRopePush, 128),
    "norm_rope_kv.comp": (p.NormRopeKvPush, 128),
    "quantize_q8.comp": (p.QuantizeQ8Push, 128),
    "residual_norm.comp": (p.ResidualNormPush, RESIDUAL_BLOCK),
    "mul_mat_vec_q8.comp": (p.MatMulPush, Q8_MATVEC_BLOCK),
    "mul_mat_vec.comp": (p.MatMulPush, MATVEC_BLOCK),
    "mul_mat_vec_unit.comp": (p.MatMulPush, UNIT_BLOCK),
    "mul_mat.comp": (p.MatMulPush, MATMUL_BLOCK),
    "mul_mat_reg.comp": (p.MatMulPush, MATMUL_REG_BLOCK),
    "mul_mm_coopmat.comp": (p.CoopMatPush, MATMUL_BLOCK),  # the block: each variant's layout's
    "coopmat_peak.comp": (p.CoopMatPeakPush, 128),
    "mul_mmq_coopmat.comp": (p.CoopMatPush, MMQ_BLOCK),
    "split_reduce.comp": (p.SplitReducePush, 256),
    "row_scale.comp": (p.RowScalePush, 256),
    "geglu_row_scale.comp": (p.SplitReducePush, 256),
    **VISION_SOURCES,  # the vision encoder's (vision_push.py)
}


def spec_of(v: Variant) -> KernelSpec:
    """The interface of one variant."""
    push, block = SOURCES[v.source]
    if v.source == "mul_mm_coopmat.comp":
        block = coopmat_variant(v.name)[1].block
    return KernelSpec(v.source, v.n_buffers, push, block)


#: SPIR-V variant name -> interface.
KERNELS: dict[str, KernelSpec] = {v.name: spec_of(v) for v in VARIANTS}
