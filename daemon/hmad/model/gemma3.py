"""Gemma 3 text decoder, written once over the op interface of backends/base.py.

Per layer (MODELS.md): pre-norm -> q/k/v -> per-head q/k RMS norm -> RoPE (local layers base 10k, global
layers the file's base and linear scaling) -> paged attention (sliding window on local layers) -> output
projection -> post-norm -> residual; then pre-norm -> gelu_tanh(gate) * up -> down -> post-norm -> residual.
Written with the fused ops of backends/base.py (residual_norm: post-norm + residual + the next pre-norm;
normed_attention: q/k norm + RoPE + attention; ffn: gate/up, GeGLU, down; matmuls), whose defaults are the
plain sequence above.
Embeddings are scaled by sqrt(D) (an image's soft tokens, given as ``batch.embeds``, are not); the output
projection is tied to the embedding unless the file has one.
Norm weights follow GGUF's convention (they already include Gemma's ``1 +``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hmad.backends.base import Act, Backend, Weight
from hmad.core.batch import StepBatch
from hmad.core.model_config import ModelConfig

LAYER_TENSORS = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_q_norm",
    "attn_k_norm",
    "attn_output",
    "post_attention_norm",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "post_ffw_norm",
)


def tensor_names(cfg: ModelConfig) -> list[str]:
    """Every tensor the architecture needs (``output.weight`` is optional: tied to the embedding)."""
    names = ["token_embd.weight", "output_norm.weight"]
    for i in range(cfg.n_layers):
        names += [f"blk.{i}.{t}.weight" for t in LAYER_TENSORS]
    return names


@dataclass
class Layer:
    """One decoder block's weights (backend handles)."""

    attn_norm: Weight
    attn_q: Weight
    attn_k: Weight
    attn_v: Weight
    attn_q_norm: Weight
    attn_k_norm: Weight
    attn_output: Weight
    post_attention_norm: Weight
    ffn_norm: Weight
    ffn_gate: Weight
    ffn_up: Weight
    ffn_down: Weight
    post_ffw_norm: Weight


class Gemma3:
    """The forward pass: ``forward(batch) -> logits (S_out, V)`` for the batch's ``logit_rows``."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, Weight], ops: Backend):
        self.cfg, self.ops = cfg, ops
        self.embed_table = weights["token_embd.weight"]
        self.output_norm = weights["output_norm.weight"]
        self.output = weights.get("output.weight", self.embed_table)
        self.layers = [
            Layer(**{t: weights[f"blk.{i}.{t}.weight"] for t in LAYER_TENSORS}) for i in range(cfg.n_layers)
        ]

    def forward(self, batch: StepBatch) -> Act:
        ops, cfg, eps = self.ops, self.cfg, self.cfg.rms_eps
        ops.begin_step(batch)
        x = ops.embed(self.embed_table, batch.tokens, cfg.embed_scale)  # (T, D)
        if batch.embeds is not None:  # an image's soft tokens, as they are (not scaled)
            x = ops.put_rows(x, batch.embed_rows, batch.embeds)
        h = ops.rms_norm(x, self.layers[0].attn_norm, eps)
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
            x, h = self.block(i, layer, x, h, nxt, batch)
        x = ops.rows(x, batch.logit_rows)  # (S_out, D)
        x = ops.rms_norm(x, self.output_norm, eps)
        return ops.matmul(x, self.output)  # (S_out, V)

    def block(
        self, i: int, layer: Layer, x: Act, h: Act, nxt: Layer | None, batch: StepBatch
    ) -> tuple[Act, Act]:
        """One decoder block on the residual stream x, given h = attn_norm(x); returns (x, h) with h the next
        block's attn_norm(x) (None after the last). The weights of the matmuls that follow a small op (the
        output projection, gate/up, the next block's q/k/v) are announced (``prefetch``) after that op."""
        ops, eps = self.ops, self.cfg.rms_eps
        a = self.attention(i, layer, h, batch)  # (T, H*Dh)
        ops.prefetch([layer.attn_output])
        a = ops.matmul_for_residual(a, layer.attn_output)  # (T, D)
        x, h = ops.residual_norm(x, a, layer.post_attention_norm, layer.ffn_norm, eps)
        ops.prefetch([layer.ffn_gate, layer.ffn_up])
        f = ops.ffn(h, layer.ffn_gate, layer.ffn_up, layer.ffn_down)  # (T, D), through (T, F)
        x, h = ops.residual_norm(x, f, layer.post_ffw_norm, nxt.attn_norm if nxt else None, eps)
        if nxt is not None:
            ops.prefetch([nxt.attn_q, nxt.attn_k, nxt.attn_v])
        return x, h

    def attention(self, i: int, layer: Layer, h: Act, batch: StepBatch) -> Act:
        """The attention sub-layer up to its output projection: (T, D) -> (T, H*Dh)."""
        ops, cfg = self.ops, self.cfg
        t, dh = batch.n_tokens, cfg.head_dim
        q, k, v = ops.matmuls_for_attention(h, [layer.attn_q, layer.attn_k, layer.attn_v])
        q = ops.reshape(q, (t, cfg.n_heads, dh))  # (T, H, Dh)
        k = ops.reshape(k, (t, cfg.n_kv_heads, dh))  # (T, Hkv, Dh)
        v = ops.reshape(v, (t, cfg.n_kv_heads, dh))
        window = None if cfg.layer_is_global[i] else cfg.sliding_window
        norms, rope = (layer.attn_q_norm, layer.attn_k_norm), cfg.rope_for_layer(i)
        return ops.normed_attention(q, k, v, *norms, cfg.rms_eps, batch, rope, i, window, cfg.attn_scale)
