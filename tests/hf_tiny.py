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

Vision (``multimodal=True``): ``vision="stub"`` (the default) adds a few stand-in vision tensors the text
loader must ignore; ``vision="real"`` writes a real tiny SigLIP tower + Gemma 3 projector (TINY_VISION:
width 32, 16 px images, 4 px patches so 16 patches, 2 layers, 2 heads, FFN 64, eps 1e-6, 4 soft tokens per
image, so a 2 x 2 average pool), every tensor transformers' Gemma3ForConditionalGeneration wants, a
``preprocessor_config.json`` and the VLM tokenizer (ids 509/510/511 = ``<image_soft_token>``,
``<start_of_image>``, ``<end_of_image>``, special). ``make_tiny_mmproj`` writes llama.cpp's mmproj GGUF
of such a checkpoint, as ``convert_hf_to_gguf.py --mmproj`` would.

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
TINY_VISION = dict(hidden=32, image_size=16, patch_size=4, layers=2, heads=2, ffn=64, eps=1e-6, mm_tokens=4)
#: the VLM tokenizer's image tokens (Gemma3Config: image_token_index, boi_token_index, eoi_token_index)
IMAGE_TOKEN, BOI, EOI = 509, 510, 511
VISION_SPECIALS = {IMAGE_TOKEN: "<image_soft_token>", BOI: "<start_of_image>", EOI: "<end_of_image>"}
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


def real_vision_weights(seed: int, prefix: str = "model.") -> dict[str, np.ndarray]:
    """float32 SigLIP tower + Gemma 3 projector under HF names (``prefix`` "model." new exports, "" old).

    LayerNorm weights around 1 (SigLIP's LayerNorm multiplies by w), the projector's RMSNorm weight around 0
    (Gemma's convention: 1 + w), the rest scaled so the soft tokens have a std of a few units.
    """
    v = TINY_VISION
    rng = np.random.default_rng(seed)
    D, F, p = v["hidden"], v["ffn"], v["patch_size"]
    n_patches = (v["image_size"] // p) ** 2

    def normal(shape, std, mean=0.0):
        return (mean + rng.standard_normal(shape) * std).astype(np.float32)

    t = f"{prefix}vision_tower.vision_model."
    w = {
        t + "embeddings.patch_embedding.weight": normal((D, 3, p, p), 0.15),
        t + "embeddings.patch_embedding.bias": normal((D,), 0.1),
        t + "embeddings.position_embedding.weight": normal((n_patches, D), 0.3),
    }
    for i in range(v["layers"]):
        lp = f"{t}encoder.layers.{i}."
        for norm in ("layer_norm1", "layer_norm2"):
            w[lp + norm + ".weight"] = normal((D,), 0.1, 1.0)
            w[lp + norm + ".bias"] = normal((D,), 0.1)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            w[f"{lp}self_attn.{proj}.weight"] = normal((D, D), 0.2)
            w[f"{lp}self_attn.{proj}.bias"] = normal((D,), 0.05)
        w[lp + "mlp.fc1.weight"] = normal((F, D), 0.2)
        w[lp + "mlp.fc1.bias"] = normal((F,), 0.05)
        w[lp + "mlp.fc2.weight"] = normal((D, F), 0.15)
        w[lp + "mlp.fc2.bias"] = normal((D,), 0.05)
    w[t + "post_layernorm.weight"] = normal((D,), 0.1, 1.0)
    w[t + "post_layernorm.bias"] = normal((D,), 0.1)
    w[f"{prefix}multi_modal_projector.mm_soft_emb_norm.weight"] = normal((D,), 0.1)
    w[f"{prefix}multi_modal_projector.mm_input_projection_weight"] = normal((D, TINY["hidden"]), 0.3)
    return w


def real_vision_config() -> dict:
    """SiglipVisionConfig entries of the real tiny tower (no pooling head, as in Gemma 3)."""
    v = TINY_VISION
    return {
        "model_type": "siglip_vision_model",
        "hidden_size": v["hidden"],
        "image_size": v["image_size"],
        "patch_size": v["patch_size"],
        "num_hidden_layers": v["layers"],
        "num_attention_heads": v["heads"],
        "intermediate_size": v["ffn"],
        "layer_norm_eps": v["eps"],
        "hidden_act": "gelu_pytorch_tanh",
        "num_channels": 3,
        "vision_use_head": False,
    }


def preprocessor_config() -> dict:
    """The tiny VLM's preprocessor_config.json (Gemma3ImageProcessor's keys, sized for 16 px images)."""
    v = TINY_VISION
    return {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "do_convert_rgb": None,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "do_pan_and_scan": None,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_seq_length": v["mm_tokens"],
        "resample": 2,
        "rescale_factor": 1 / 255,
        "size": {"height": v["image_size"], "width": v["image_size"]},
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
    vision: str = "stub",
) -> Path:
    """Write the tiny checkpoint into ``directory`` (created) and return it. Deterministic in its arguments.

    ``sharded`` splits the weights over 3 files with ``model.safetensors.index.json``; ``multimodal`` writes a
    Gemma3ForConditionalGeneration layout (``mm_layout`` "new": model.language_model.*, "old":
    language_model.model.*) with a few vision tensors beside the text tower (``vision="stub"``) or a real
    tiny vision tower + projector (``vision="real"``: model.vision_tower.* / model.multi_modal_projector.*
    for "new", vision_tower.* / multi_modal_projector.* for "old"), a preprocessor_config.json and the VLM
    tokenizer; ``tied=False`` adds lm_head.
    """
    if vision not in ("stub", "real"):
        raise ValueError(f"vision {vision!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = random_text_weights(seed, tied)
    config = text_config(tied)
    if multimodal:
        weights = {mm_rename(n, mm_layout): a for n, a in weights.items()}
        config = multimodal_config(tied)
        if vision == "real":
            weights.update(real_vision_weights(seed + 2000, "model." if mm_layout == "new" else ""))
            config["vision_config"] = real_vision_config()
            pre = json.dumps(preprocessor_config(), indent=2)
            (directory / "preprocessor_config.json").write_text(pre)
        else:
            weights.update(vision_weights(np.random.default_rng(seed + 1000)))
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
    write_tokenizer(directory / "tokenizer.json", vision=multimodal and vision == "real")
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


def write_tokenizer(path: Path, vision: bool = False) -> None:
    """The tiny tokenizer.json; ``vision`` gives the VLM variant (``build_vision_tokenizer``)."""
    (build_vision_tokenizer() if vision else build_tokenizer()).save(str(path))


def build_vision_tokenizer():
    """``build_tokenizer`` with ids 509/510/511 turned into the special ``<image_soft_token>``,
    ``<start_of_image>``, ``<end_of_image>`` (as in Gemma 3's vocabulary, where they are special too).

    The learned pieces those ids held are dropped with every merge that makes or uses them, so text
    that used them tokenizes into smaller pieces; every other id keeps its piece.
    """
    from tokenizers import Tokenizer

    spec = json.loads(build_tokenizer().to_str())
    vocab = spec["model"]["vocab"]
    by_id = {i: piece for piece, i in vocab.items()}
    dropped = {by_id[i] for i in VISION_SPECIALS}
    for i, name in VISION_SPECIALS.items():
        del vocab[by_id[i]]
        vocab[name] = i
    spec["model"]["merges"] = [
        m for m in spec["model"]["merges"] if not ({*_merge_pair(m), "".join(_merge_pair(m))} & dropped)
    ]
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens(list(VISION_SPECIALS.values()))
    assert tok.get_vocab_size() == TINY["vocab"], tok.get_vocab_size()
    assert all(tok.token_to_id(name) == i for i, name in VISION_SPECIALS.items())
    return tok


def _merge_pair(m) -> tuple[str, str]:
    return tuple(m.split(" ")) if isinstance(m, str) else tuple(m)


# --- llama.cpp's mmproj GGUF of the vision tower ------------------------------------------------------------

#: llama.cpp's tensor names (gguf-py constants.py / tensor_mapping.py) for the HF vision names, written out
#: here independently of hmad.model.vision so the reader is checked against a second spelling of the table
MMPROJ_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_out",
    "layer_norm1": "ln1",
    "layer_norm2": "ln2",
    "mlp.fc1": "ffn_up",
    "mlp.fc2": "ffn_down",
}
MMPROJ_TOP = {
    "embeddings.patch_embedding": "v.patch_embd",
    "embeddings.position_embedding": "v.position_embd",
    "post_layernorm": "v.post_ln",
}
#: --outtype -> (LlamaFileType value written as general.file_type, GGML type of the 2-D weights)
MMPROJ_FTYPES = {"f32": (0, "F32"), "f16": (1, "F16"), "bf16": (32, "BF16"), "q8_0": (7, "Q8_0")}


def mmproj_name(hf: str) -> str:
    """HF vision name -> llama.cpp mmproj name (either HF prefix layout)."""
    name = hf.removeprefix("model.").replace("_weight", ".weight")  # as Gemma3VisionModel.filter_tensors
    if name.startswith("multi_modal_projector."):
        rest = name.removeprefix("multi_modal_projector.")
        return {"mm_input_projection.weight": "mm.input_projection.weight"}.get(
            rest, rest.replace("mm_soft_emb_norm", "mm.soft_emb_norm")
        )
    rest = name.removeprefix("vision_tower.vision_model.")
    if rest.startswith("encoder.layers."):
        i, tail = rest.removeprefix("encoder.layers.").split(".", 1)
        module, kind = tail.rsplit(".", 1)
        return f"v.blk.{i}.{MMPROJ_LAYER[module]}.{kind}"
    module, kind = rest.rsplit(".", 1)
    return f"{MMPROJ_TOP[module]}.{kind}"


def mmproj_qtype(hf: str, array: np.ndarray, ftype: str) -> str:
    """The GGML type llama.cpp's converter stores an HF vision tensor as (Gemma3VisionModel's rules)."""
    if "input_projection" in hf:
        return "F16"  # tensor_force_quant, llama.cpp issue 13025
    if ".embeddings." in hf or array.ndim <= 1:
        return "F32"  # the patch and position embeddings; every 1-D tensor
    return MMPROJ_FTYPES[ftype][1]


def make_tiny_mmproj(
    path: str | Path, hf_dir: str | Path, ftype: str = "f16", projector_type: str = "gemma3"
) -> Path:
    """Write ``hf_dir``'s vision tower + projector as an mmproj GGUF, as ``convert_hf_to_gguf.py --mmproj
    --outtype {ftype}`` writes it: general.architecture "clip", general.type "mmproj", clip.projector_type
    "gemma3", clip.vision.* from vision_config (projection_dim = the text width), image mean/std and the
    pooling scale (image_seq_length from preprocessor_config.json; written only when not 4); names mapped,
    ``mm.soft_emb_norm.weight`` stored as ``1 + w``, nothing transposed; dtypes by ``mmproj_qtype``.
    ``projector_type`` other than "gemma3" makes a file the reader must refuse.
    """
    import gguf
    from safetensors import safe_open

    hf_dir, path = Path(hf_dir), Path(path)
    config = json.loads((hf_dir / "config.json").read_text())
    pre = json.loads((hf_dir / "preprocessor_config.json").read_text())
    vc = config["vision_config"]
    tower = dict(
        image_size=vc["image_size"],
        patch_size=vc["patch_size"],
        hidden=vc["hidden_size"],
        ffn=vc["intermediate_size"],
        n_layers=vc["num_hidden_layers"],
        n_heads=vc["num_attention_heads"],
    )
    w = clip_writer(
        path, config["text_config"]["hidden_size"], tower, pre["image_mean"], pre["image_std"],
        vc.get("layer_norm_eps", 1e-6), projector_type,
    )  # fmt: skip
    w.add_file_type(MMPROJ_FTYPES[ftype][0])
    per_side = int(pre.get("image_seq_length", 256) ** 0.5)
    scale = (vc["image_size"] // vc["patch_size"]) // per_side
    if scale > 0 and scale != 4:
        w.add_vision_projector_scale_factor(scale)
    for hf, array in _hf_vision_tensors(hf_dir, safe_open):
        if "soft_emb_norm" in hf:
            array = array + np.float32(1.0)
        _add_tensor(w, gguf, mmproj_name(hf), array, mmproj_qtype(hf, array, ftype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def clip_writer(
    path: str | Path,
    text_width: int,
    tower: dict,
    mean,
    std,
    eps: float = 1e-6,
    projector_type: str = "gemma3",
):
    """A GGUFWriter of an mmproj file with its ``clip.*`` keys written as llama.cpp's converter writes them
    (``tower``: image_size, patch_size, hidden, ffn, n_layers, n_heads); the caller adds the tensors."""
    import gguf

    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(text_width)
    w.add_vision_image_size(tower["image_size"])
    w.add_vision_patch_size(tower["patch_size"])
    w.add_vision_embedding_length(tower["hidden"])
    w.add_vision_feed_forward_length(tower["ffn"])
    w.add_vision_block_count(tower["n_layers"])
    w.add_vision_head_count(tower["n_heads"])
    w.add_vision_image_mean(list(mean))
    w.add_vision_image_std(list(std))
    w.add_clip_projector_type(projector_type)
    w.add_vision_attention_layernorm_eps(eps)
    w.add_vision_use_gelu(True)
    return w


def _hf_vision_tensors(hf_dir: Path, safe_open):
    """(HF name, float32 array) of every vision tower / projector tensor, in file order."""
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if "vision_tower." in name or "multi_modal_projector." in name:
                    yield name, f.get_tensor(name).astype(np.float32)


def _add_tensor(w, gguf, name: str, array: np.ndarray, qtype: str) -> None:
    if qtype == "F32":
        w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    elif qtype == "F16":
        w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float16))
    else:
        kind = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(array), kind), raw_dtype=kind)


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
