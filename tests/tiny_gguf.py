"""Write tiny random Gemma 3 GGUF files for tests (gguf's GGUFWriter; weights random but valid).

The default shape is small enough for fast numpy tests yet keeps every Gemma 3 feature: 6 layers (layer 5
global), GQA (4 query heads over 2 KV heads), a sliding window of 8 positions, rope scaling on global
layers, K-quant rows of 256.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType, GGUFWriter

from hmad.core.quants import quantize_q4_0, quantize_q5_0, quantize_q8_0, random_blocks

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
WORDS = ["the", "and", "of", "to", "in", "is", "it", "that", "model", "hello", "world", "cat", "dog"]

#: per tensor kind, the quant type used by the "mixed" preset (as the real 270M file mixes them)
MIXED = {
    "attn_q": Q.Q5_0,
    "attn_k": Q.Q5_0,
    "attn_v": Q.Q8_0,
    "attn_output": Q.Q4_K,
    "ffn_gate": Q.Q5_0,
    "ffn_up": Q.Q4_0,
    "ffn_down": Q.Q6_K,
    "token_embd": Q.Q8_0,
}
_QUANTIZERS = {Q.Q8_0: quantize_q8_0, Q.Q4_0: quantize_q4_0, Q.Q5_0: quantize_q5_0}


def tiny_vocab(byte_tokens: bool = True) -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece-style vocab: specials, 256 byte tokens, letters and a few words.

    ``byte_tokens=False`` leaves the byte tokens out (as bench_vulkan_model.write_model's synthetic
    vocabularies do): then only text made of the pieces below can be encoded (lower-case ASCII letters,
    digits, space, ``.``, ``,``, ``\\n`` and the special tokens' texts).
    """
    tokens = list(SPECIAL) + ([f"<0x{b:02X}>" for b in range(256)] if byte_tokens else [])
    types = [3, 3, 3, 2, 3, 3] + ([6] * 256 if byte_tokens else [])
    pieces = ["▁"] + [chr(c) for c in range(97, 123)] + ["▁" + chr(c) for c in range(97, 123)]
    pieces += [str(d) for d in range(10)] + ["▁" + w for w in WORDS] + [".", ",", "\n"]
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    tokens += pieces
    types += [1] * len(pieces)
    return tokens, scores, types


def _weight(rng, shape, qtype: Q, scale: float) -> np.ndarray:
    if qtype in _QUANTIZERS:
        return _QUANTIZERS[qtype]((rng.standard_normal(shape) * scale).astype(np.float32))
    if qtype == Q.F32:
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    if qtype == Q.F16:
        return (rng.standard_normal(shape) * scale).astype(np.float16)
    return random_blocks(qtype, shape, rng)


def make_tiny_gguf(
    path: str | Path,
    seed: int = 0,
    types: dict[str, Q] | None = None,
    n_layers: int = 6,
    d_model: int = 256,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 64,
    d_ff: int = 512,
    window: int = 8,
    rope_scale: float = 2.0,
    byte_tokens: bool = True,
    metadata: dict[str, tuple[Any, GGUFValueType]] | None = None,
    alignment: int | None = None,
) -> Path:
    """Write a random Gemma 3 GGUF; ``types`` maps tensor kinds (e.g. ``attn_q``) to quant types
    (default: F32 everywhere); ``byte_tokens=False``: a vocabulary without byte-fallback tokens
    (``tiny_vocab``); ``metadata``: keys to add or overwrite, as (value, GGUF value type), after the usual
    ones (weights keep the shapes of the arguments: a file whose metadata lies about them);
    ``alignment``: the data alignment the file is written with (and states in ``general.alignment``);
    returns the path."""
    rng = np.random.default_rng(seed)
    types = {**{k: Q.F32 for k in MIXED}, **(types or {})}
    tokens, scores, ttypes = tiny_vocab(byte_tokens)
    w = GGUFWriter(str(path), "gemma3")
    w.add_name(f"tiny-gemma3-seed{seed}")
    w.add_block_count(n_layers)
    w.add_context_length(4096)
    w.add_embedding_length(d_model)
    w.add_feed_forward_length(d_ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(window)
    if rope_scale != 1.0:
        w.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_scale)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(ttypes)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (value, vtype) in (metadata or {}).items():
        w.kv_data[0].pop(key, None)  # (add_key_value would log a warning for each overwrite)
        w.add_key_value(key, value, vtype)
    vocab = len(tokens)
    w.add_tensor(
        "token_embd.weight",
        _weight(rng, (vocab, d_model), types["token_embd"], 0.5),
        raw_dtype=types["token_embd"],
    )
    w.add_tensor("output_norm.weight", (1.0 + 0.1 * rng.standard_normal(d_model)).astype(np.float32))
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    shapes = {
        "attn_q": (q, d_model),
        "attn_k": (kv, d_model),
        "attn_v": (kv, d_model),
        "attn_output": (d_model, q),
        "ffn_gate": (d_ff, d_model),
        "ffn_up": (d_ff, d_model),
        "ffn_down": (d_model, d_ff),
    }
    norms = {
        "attn_norm": d_model,
        "attn_q_norm": head_dim,
        "attn_k_norm": head_dim,
        "post_attention_norm": d_model,
        "ffn_norm": d_model,
        "post_ffw_norm": d_model,
    }
    for i in range(n_layers):
        for kind, shape in shapes.items():
            data = _weight(rng, shape, types[kind], 1.0 / np.sqrt(shape[1]))
            w.add_tensor(f"blk.{i}.{kind}.weight", data, raw_dtype=types[kind])
        for kind, n in norms.items():
            w.add_tensor(f"blk.{i}.{kind}.weight", (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
