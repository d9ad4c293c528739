"""A tiny random Gemma 3 HF checkpoint (config.json + safetensors + tokenizer.json), written with numpy only.

``make_tiny_hf_checkpoint(directory, seed=0, dtype=..., sharded=..., multimodal=...)`` writes a checkpoint
that transformers' ``Gemma3ForCausalLM`` loads as it is (see tests/fixtures/make_hf_reference.py) and hmad's
``read_hf_checkpoint`` reads. Shapes (TINY): vocab 512, hidden 64, 6 layers (layer 5 global), 4 heads,
2 KV heads, head_dim 16, FFN 128, sliding window 8 (shorter than the test prompts, so the window matters),
rope 1e6 global with linear scaling x2, 1e4 local, query_pre_attn_scalar 16.

Weights are drawn in float32 from ``numpy.random.default_rng(seed)`` and then stored in ``dtype``; the values
a reader must return are the stored ones (``stored_values``). Norm weights are random around 0 (HF's
convention: the model multiplies by ``1 + w``). Scales are chosen so that logits have a std of a few units
(the embeddings, which are also the tied output head, have std 0.3 and are multiplied by sqrt(64) on input).

bf16: numpy has no bfloat16 dtype and safetensors' numpy API cannot write one, so bf16 files are written by
``write_safetensors`` here (header + raw bytes), the float32 values rounded to bf16 bits with
round-to-nearest-even (``to_bf16_bits``). F32/F16 files go through ``safetensors.numpy.save_file`` so the
reader is also checked against the library's own writer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

TINY = dict(vocab=512, hidden=64, layers=6, heads=4, kv_heads=2, head_dim=16, ffn=128, window=8)
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]  # ids 0..5
BOS, EOS = 2, 1
ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}

#: fixed text the tiny tokenizer's merges are trained on
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny tokenizer for testing the gemma three daemon",
    "<start_of_turn>user\nwhat is the answer?<end_of_turn>\n<start_of_turn>model\nthe answer is forty two",
    "numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation: ; ! ? ( ) [ ] { } ' \" - _ / \\ @ # $ % ^ & *",
    "she sells sea shells by the sea shore; the shells she sells are surely sea shells",
    "inference servers stream tokens to their clients over a socket, one frame per token",
] * 4


def text_config(tied: bool = True) -> dict:
    """The text model's config.json entries (Gemma3TextConfig keys, old ``rope_*`` style as on the Hub)."""
    t = TINY
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": t["vocab"],
        "hidden_size": t["hidden"],
        "intermediate_size": t["ffn"],
        "num_hidden_layers": t["layers"],
        "num_attention_heads": t["heads"],
        "num_key_value_heads": t["kv_heads"],
        "head_dim": t["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "sliding_window": t["window"],
        "sliding_window_pattern": 6,
        "layer_types": [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(t["layers"])
        ],
        "query_pre_attn_scalar": 16,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": tied,
        "pad_token_id": 0,
        "bos_token_id": BOS,
        "eos_token_id": [EOS, 5],
        "torch_dtype": "float32",
    }


def random_text_weights(seed: int, tied: bool = True) -> dict[str, np.ndarray]:
    """float32 weights under HF CausalLM names (``model.*``, ``lm_head.weight`` when untied)."""
    t = TINY
    rng = np.random.default_rng(seed)
    D, F, Dh = t["hidden"], t["ffn"], t["head_dim"]
    q, kv = t["heads"] * Dh, t["kv_heads"] * Dh

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w = {"model.embed_tokens.weight": normal((t["vocab"], D), 0.3)}
    for i in range(t["layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = normal((D,), 0.1)
        w[p + "self_attn.q_proj.weight"] = normal((q, D), 0.1)
        w[p + "self_attn.k_proj.weight"] = normal((kv, D), 0.1)
        w[p + "self_attn.v_proj.weight"] = normal((kv, D), 0.1)
        w[p + "self_attn.q_norm.weight"] = normal((Dh,), 0.1)
        w[p + "self_attn.k_norm.weight"] = normal((Dh,), 0.1)
        w[p + "self_attn.o_proj.weight"] = normal((D, q), 0.1)
        w[p + "post_attention_layernorm.weight"] = normal((D,), 0.1)
        w[p + "pre_feedforward_layernorm.weight"] = normal((D,), 0.1)
        w[p + "mlp.gate_proj.weight"] = normal((F, D), 0.1)
        w[p + "mlp.up_proj.weight"] = normal((F, D), 0.1)
        w[p + "mlp.down_proj.weight"] = normal((D, F), 0.07)
        w[p + "post_feedforward_layernorm.weight"] = normal((D,), 0.1)
    w["model.norm.weight"] = normal((D,), 0.1)
    if not tied:
        w["lm_head.weight"] = normal((t["vocab"], D), 0.3)
    return w


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def stored_values(x: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 values a reader gets back after ``x`` is stored as ``dtype``."""
    if dtype == "bfloat16":
        return from_bf16_bits(to_bf16_bits(x))
    return x.astype(dtype).astype(np.float32)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A safetensors file from (dtype name, array of the raw element bytes) pairs, e.g. ("BF16", u16)."""
    header, offset, blobs = {}, 0, []
    for name, (dtype, arr) in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        span = [offset, offset + len(data)]
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": span}
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # data 8-byte aligned, as the library writes it
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for data in blobs:
            f.write(data)


def save_tensors(path: Path, weights: dict[str, np.ndarray], dtype: str) -> None:
    if dtype == "bfloat16":
        write_safetensors(path, {n: ("BF16", to_bf16_bits(a)) for n, a in weights.items()})
    elif dtype in ("float32", "float16"):
        save_file({n: np.ascontiguousarray(a.astype(dtype)) for n, a in weights.items()}, str(path))
    else:
        raise ValueError(f"dtype {dtype!r}")


def vision_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A few stand-in vision tower / projector tensors; one is F64, which the text loader must not touch."""
    return {
        "vision_tower.vision_model.embeddings.patch_embedding.weight": rng.standard_normal(
            (32, 3, 4, 4)
        ).astype(np.float32),
        "vision_tower.vision_model.post_layernorm.weight": rng.standard_normal(32).astype(np.float32),
        "multi_modal_projector.mm_input_projection_weight": rng.standard_normal((32, 64)).astype(np.float64),
    }


def multimodal_config(tied: bool = True) -> dict:
    """Gemma3ForConditionalGeneration config: the text model under text_config, ids at the top level."""
    text = {
        k: v
        for k, v in text_config(tied).items()
        if k not in ("architectures", "bos_token_id", "eos_token_id", "torch_dtype")
    }
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text,
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "image_size": 16,
            "patch_size": 4,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 64,
        },
        "mm_tokens_per_image": 4,
        "boi_token_index": 510,
        "eoi_token_index": 511,
        "image_token_index": 509,
        "bos_token_id": BOS,
        "eos_token_id": [EOS, 5],
        "torch_dtype": "float32",
    }


def mm_rename(name: str, layout: str) -> str:
    """CausalLM name -> multimodal name: ``old`` language_model.model.*, ``new`` model.language_model.*."""
    if name == "lm_head.weight":
        return "language_model.lm_head.weight" if layout == "old" else name
    rest = name.removeprefix("model.")
    return f"language_model.model.{rest}" if layout == "old" else f"model.language_model.{rest}"


def make_tiny_hf_checkpoint(
    directory: str | Path,
    seed: int = 0,
    dtype: str = "float32",
    sharded: bool = False,
    multimodal: bool = False,
    mm_layout: str = "new",
    tied: bool = True,
) -> Path:
    """Write the tiny checkpoint into ``directory`` (created) and return it. Deterministic in its arguments.

    ``sharded`` splits the weights over 3 files with ``model.safetensors.index.json``; ``multimodal`` writes a
    Gemma3ForConditionalGeneration layout (``mm_layout`` "new": model.language_model.*, "old":
    language_model.model.*) with a few vision tensors beside the text tower; ``tied=False`` adds lm_head.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = random_text_weights(seed, tied)
    config = text_config(tied)
    if multimodal:
        weights = {mm_rename(n, mm_layout): a for n, a in weights.items()}
        weights.update(vision_weights(np.random.default_rng(seed + 1000)))
        config = multimodal_config(tied)
    config["torch_dtype"] = dtype
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    plain = {n: a for n, a in weights.items() if a.dtype == np.float32}
    other = {n: a for n, a in weights.items() if a.dtype != np.float32}  # F64 vision stand-in
    if sharded:
        write_shards(directory, plain, other, dtype)
    else:
        save_tensors(directory / "model.safetensors", plain, dtype)
        if other:
            save_file(other, str(directory / "model-extra.safetensors"))
    write_tokenizer(directory / "tokenizer.json")
    return directory


def write_shards(
    directory: Path, plain: dict[str, np.ndarray], other: dict[str, np.ndarray], dtype: str, n: int = 3
) -> None:
    names = list(plain)
    weight_map, total = {}, 0
    for k in range(n):
        file = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        part = {name: plain[name] for name in names[k::n]}
        if k == n - 1 and other:
            save_file(other, str(directory / f"extra-{file}"))
            weight_map.update({name: f"extra-{file}" for name in other})
        save_tensors(directory / file, part, dtype)
        weight_map.update({name: file for name in part})
        total += (directory / file).stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# --- tokenizer ---------------------------------------------------------------------------------------------


def build_tokenizer():
    """A Gemma-like BPE tokenizer.json with exactly TINY["vocab"] entries.

    Ids: 0..5 SPECIALS, 6..261 byte-fallback tokens <0x00>..<0xFF>, then printable ASCII, "▁" and merges
    trained on CORPUS (padded with <unusedN> to 512). Spaces become "▁" (no pre-tokenizer, like Gemma);
    the post-processor prepends <bos>; the decoder undoes "▁" and fuses byte-fallback bytes.
    """
    from tokenizers import Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    alphabet = [chr(c) for c in range(33, 127)] + ["▁", "\n"]
    n_learned = TINY["vocab"] - len(SPECIALS) - 256
    trainer_tok = Tokenizer(BPE(unk_token="<unk>"))
    trainer_tok.normalizer = normalizers.Replace(" ", "▁")
    trainer = BpeTrainer(
        vocab_size=len(SPECIALS) + n_learned,
        special_tokens=SPECIALS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    trainer_tok.train_from_iterator(CORPUS, trainer)
    learned = json.loads(trainer_tok.to_str())["model"]
    pieces = [p for p, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]) if p not in SPECIALS]
    pieces += [f"<unused{k}>" for k in range(n_learned - len(pieces))]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + pieces)}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS)]
    )
    tok.add_special_tokens(SPECIALS)
    assert tok.get_vocab_size() == TINY["vocab"], tok.get_vocab_size()
    return tok


def write_tokenizer(path: Path) -> None:
    build_tokenizer().save(str(path))


# --- the transformers reference (needs torch + transformers) -----------------------------------------------


def transformers_logits(directory: str | Path, prompts: list[list[int]]) -> list[np.ndarray]:
    """Logits (T, V) float32 of every position of each prompt, from transformers' Gemma3ForCausalLM.

    float32, eager attention (the sliding window applied by an explicit mask), one prompt at a time, no
    padding. Checks that every weight came from the file (none left at its random init).
    """
    import torch
    from transformers import Gemma3ForCausalLM

    model, info = Gemma3ForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v}  # missing / unexpected / mismatched keys, error messages
    if bad:
        raise RuntimeError(f"transformers did not load every weight from {directory}: {bad}")
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            out.append(logits.float().numpy().copy())
    return out


def fixed_prompts(lengths=(5, 13, 21), seed: int = 1234) -> list[list[int]]:
    """Token-id prompts starting with <bos>, ids drawn from the non-special range."""
    rng = np.random.default_rng(seed)
    return [[BOS] + rng.integers(6, TINY["vocab"], n - 1).tolist() for n in lengths]


def weights_checksum(directory: str | Path) -> float:
    """sum(|w|) over the float32 text weights as stored, to tell a changed generator from a wrong model."""
    from safetensors import safe_open

    total = 0.0
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if "vision" not in name and "projector" not in name:
                    total += float(np.abs(f.get_tensor(name).astype(np.float64)).sum())
    return total
