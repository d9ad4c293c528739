"""Gemma 3's vision tower + projector in numpy (hmad.model.siglip over hmad.backends.vision_ops.VisionOps).

Checked against transformers' Gemma3ForConditionalGeneration.get_image_features on the tiny VLM
(tests/fixtures/hf_tiny_vlm_reference.npz, made by make_hf_vlm_reference.py), against llama.cpp's mmproj
layout (hf_tiny.make_tiny_mmproj), and against a plain loop re-implementation written here.

Tolerances: the HF path matches transformers' float32 features to rtol = atol = 1e-4 (soft tokens of std
~1.7). The mmproj path holds the projection in F16 (llama.cpp's converter forces it), so its tokens match the
HF path's to atol 2e-2; Q8_0/BF16 files to atol 0.15.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import hf_tiny
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hmad.backends.vision_ops import VisionOps
from hmad.core.errors import ModelFormatError
from hmad.model.siglip import VisionTower
from hmad.model.vision import (
    VisionConfig,
    expected_shapes,
    read_hf_vision,
    read_mmproj,
    vision_config_from_gguf,
    vision_config_from_hf,
)

FIXTURE = Path(__file__).parent / "fixtures" / "hf_tiny_vlm_reference.npz"
RTOL = ATOL = 1e-4


@pytest.fixture(scope="module")
def ref():
    return np.load(FIXTURE)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return hf_tiny.make_tiny_hf_checkpoint(
        tmp_path_factory.mktemp("vlm") / "ck", seed=0, multimodal=True, vision="real"
    )


@pytest.fixture(scope="module")
def hf_vision(vlm):
    return read_hf_vision(vlm)


def test_config_of_the_tiny_vlm(hf_vision):
    cfg, w = hf_vision
    v = hf_tiny.TINY_VISION
    assert (cfg.image_size, cfg.patch_size, cfg.hidden, cfg.n_layers, cfg.n_heads, cfg.ffn) == (
        v["image_size"], v["patch_size"], v["hidden"], v["layers"], v["heads"], v["ffn"],
    )  # fmt: skip
    assert (cfg.eps, cfg.mm_tokens_per_image, cfg.text_hidden) == (1e-6, 4, 64)
    assert (cfg.n_patches, cfg.patches_per_side, cfg.tokens_per_side) == (16, 4, 2)
    assert (cfg.pool, cfg.head_dim) == (2, 16)
    assert cfg.image_mean == cfg.image_std == (0.5, 0.5, 0.5)
    assert {n: a.shape for n, a in w.items()} == expected_shapes(cfg)
    assert all(a.dtype == np.float32 for a in w.values())


def test_features_match_transformers(ref, hf_vision):
    cfg, w = hf_vision
    tower = VisionTower(cfg, w, VisionOps())
    for k in (0, 1):
        pixels = ref[f"pixels_{k}"]
        x = tower.embed(pixels)
        for i in range(cfg.n_layers):
            x = tower.layer(x, i)
        hidden = tower.ops.layer_norm(x, w["v.post_ln.weight"], w["v.post_ln.bias"], cfg.eps)
        np.testing.assert_allclose(hidden, ref[f"vision_hidden_{k}"], rtol=RTOL, atol=ATOL)
        out = tower.encode(pixels)
        assert out.shape == (2, 4, 64) and out.dtype == np.float32
        np.testing.assert_allclose(out, ref[f"features_{k}"], rtol=RTOL, atol=ATOL)


def test_old_layout_reads_the_same(tmp_path, hf_vision):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "old", multimodal=True, vision="real", mm_layout="old")
    cfg, w = read_hf_vision(d)
    assert cfg == hf_vision[0]
    assert all(np.array_equal(w[n], hf_vision[1][n]) for n in w)


def test_sharded_bf16_checkpoint(tmp_path, hf_vision):
    d = hf_tiny.make_tiny_hf_checkpoint(
        tmp_path / "bf16", multimodal=True, vision="real", dtype="bfloat16", sharded=True
    )
    cfg, w = read_hf_vision(d)
    for n, a in w.items():
        want = hf_tiny.stored_values(hf_vision[1][n] - (n == "mm.soft_emb_norm.weight"), "bfloat16")
        np.testing.assert_array_equal(a, want + np.float32(n == "mm.soft_emb_norm.weight"), err_msg=n)


# --- llama.cpp's mmproj ------------------------------------------------------------------------------------


@pytest.mark.parametrize("ftype", ["f32", "f16"])
def test_mmproj_equals_hf(tmp_path, vlm, hf_vision, ftype):
    cfg, w = hf_vision
    path = hf_tiny.make_tiny_mmproj(tmp_path / f"mmproj-{ftype}.gguf", vlm, ftype)
    cfg2, w2 = read_mmproj(path)
    assert math.isclose(cfg2.eps, cfg.eps, rel_tol=1e-6)  # stored as float32
    assert dataclasses.replace(cfg2, eps=cfg.eps) == cfg
    assert w2.keys() == w.keys()
    for n in w:
        if n == "mm.input_projection.weight" or (ftype == "f16" and w[n].ndim == 2 and "embd" not in n):
            np.testing.assert_array_equal(w2[n], w[n].astype(np.float16).astype(np.float32), err_msg=n)
        else:
            np.testing.assert_array_equal(w2[n], w[n], err_msg=n)
    pixels = np.random.default_rng(5).uniform(-1, 1, (3, 3, 16, 16)).astype(np.float32)
    a = VisionTower(cfg, w, VisionOps()).encode(pixels)
    b = VisionTower(cfg2, w2, VisionOps()).encode(pixels)
    np.testing.assert_allclose(b, a, atol=2e-2)


@pytest.mark.parametrize("ftype", ["bf16", "q8_0"])
def test_mmproj_quantized(tmp_path, vlm, hf_vision, ftype):
    path = hf_tiny.make_tiny_mmproj(tmp_path / f"mmproj-{ftype}.gguf", vlm, ftype)
    cfg, w = read_mmproj(path)
    pixels = np.random.default_rng(6).uniform(-1, 1, (2, 3, 16, 16)).astype(np.float32)
    a = VisionTower(*hf_vision, VisionOps()).encode(pixels)
    np.testing.assert_allclose(VisionTower(cfg, w, VisionOps()).encode(pixels), a, atol=0.15)


def test_mmproj_layout_is_llamacpps(tmp_path, vlm):
    """The file as llama.cpp's converter writes it (read back with gguf-py's own reader)."""
    from gguf import GGUFReader

    r = GGUFReader(str(hf_tiny.make_tiny_mmproj(tmp_path / "m.gguf", vlm, "q8_0")))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["v.patch_embd.weight"] == types["v.position_embd.weight"] == "F32"
    assert types["mm.input_projection.weight"] == "F16" and types["v.blk.0.attn_q.weight"] == "Q8_0"
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}  # ggml ne order
    assert shapes["mm.input_projection.weight"] == (64, 32) and shapes["v.patch_embd.weight"] == (4, 4, 3, 32)
    field = r.get_field("clip.projector_type")
    assert field.contents() == "gemma3"
    assert r.get_field("clip.vision.projector.scale_factor").contents() == 2


# --- an independent re-implementation ----------------------------------------------------------------------


def plain_encoder(cfg: VisionConfig, w: dict[str, np.ndarray], pixels: np.ndarray) -> np.ndarray:
    """Loops, float64, one image at a time, straight from the transformers definitions."""
    p, g, D = cfg.patch_size, cfg.patches_per_side, cfg.hidden
    W = {n: a.astype(np.float64) for n, a in w.items()}

    def ln(x, n):
        return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + cfg.eps) * W[
            n + ".weight"
        ] + W[n + ".bias"]

    def lin(x, n):
        return x @ W[n + ".weight"].T + W[n + ".bias"]

    outs = []
    for img in pixels.astype(np.float64):
        x = np.zeros((g * g, D))
        for r in range(g):
            for c in range(g):
                patch = img[:, r * p : (r + 1) * p, c * p : (c + 1) * p]
                for d in range(D):
                    x[r * g + c, d] = (patch * W["v.patch_embd.weight"][d]).sum() + W["v.patch_embd.bias"][d]
        x = x + W["v.position_embd.weight"]
        for i in range(cfg.n_layers):
            b = f"v.blk.{i}."
            h = ln(x, b + "ln1")
            q, k, v = lin(h, b + "attn_q"), lin(h, b + "attn_k"), lin(h, b + "attn_v")
            o = np.zeros_like(h)
            for hd in range(cfg.n_heads):
                s = slice(hd * cfg.head_dim, (hd + 1) * cfg.head_dim)
                a = q[:, s] @ k[:, s].T / math.sqrt(cfg.head_dim)
                a = np.exp(a - a.max(1, keepdims=True))
                o[:, s] = (a / a.sum(1, keepdims=True)) @ v[:, s]
            x = x + lin(o, b + "attn_out")
            u = lin(ln(x, b + "ln2"), b + "ffn_up")
            u = 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
            x = x + lin(u, b + "ffn_down")
        x = ln(x, "v.post_ln").reshape(g, g, D)
        t, k = cfg.tokens_per_side, cfg.pool
        blocks = [x[r * k : (r + 1) * k, c * k : (c + 1) * k] for r in range(t) for c in range(t)]
        pooled = np.array([b.mean((0, 1)) for b in blocks])
        rms = np.sqrt((pooled**2).mean(-1, keepdims=True) + cfg.eps)
        normed = pooled / rms * W["mm.soft_emb_norm.weight"]
        outs.append(normed @ W["mm.input_projection.weight"])
    return np.array(outs)


def test_random_input_vs_plain_loops(hf_vision):
    cfg, w = hf_vision
    pixels = np.random.default_rng(11).uniform(-1, 1, (3, 3, 16, 16)).astype(np.float32)
    out = VisionTower(cfg, w, VisionOps()).encode(pixels)
    np.testing.assert_allclose(out, plain_encoder(cfg, w, pixels), rtol=RTOL, atol=ATOL)


def test_bigger_geometry_vs_plain_loops():
    """Another geometry: 3 heads, 6x6 patches pooled 3x3 into 4 tokens, patch 2, 1 layer."""
    cfg = VisionConfig(12, 2, 24, 1, 3, 40, 1e-6, 4, 16)
    rng = np.random.default_rng(3)
    w = {n: (rng.standard_normal(s) * 0.3).astype(np.float32) for n, s in expected_shapes(cfg).items()}
    pixels = rng.uniform(-1, 1, (2, 3, 12, 12)).astype(np.float32)
    out = VisionTower(cfg, w, VisionOps()).encode(pixels)
    np.testing.assert_allclose(out, plain_encoder(cfg, w, pixels), rtol=RTOL, atol=ATOL)


def test_encode_refuses_wrong_pixels(hf_vision):
    tower = VisionTower(*hf_vision, VisionOps())
    for shape in [(1, 3, 16, 15), (3, 16, 16), (1, 1, 16, 16), (0, 3, 16, 16)]:
        with pytest.raises(ValueError, match="expected"):
            tower.encode(np.zeros(shape, np.float32))


def test_tower_refuses_weights_of_another_config(hf_vision):
    cfg, w = hf_vision
    with pytest.raises(ValueError, match="v.blk.0.ffn_up.weight"):
        VisionTower(dataclasses.replace(cfg, ffn=48), w, VisionOps())


# --- configs ---------------------------------------------------------------------------------------------


def test_text_only_config_is_none(vlm):
    assert vision_config_from_hf(hf_tiny.text_config()) is None
    assert vision_config_from_hf({"model_type": "gemma3", "text_config": {}}) is None


def test_read_hf_vision_of_a_text_checkpoint(tmp_path):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "text")
    with pytest.raises(ModelFormatError, match="no vision_config"):
        read_hf_vision(d)


def test_gemma3_4b_style_config_defaults():
    """A Hub-style config (google/gemma-3-4b-it's vision_config states no eps, no mm_tokens default)."""
    raw = {
        "model_type": "gemma3",
        "text_config": {"hidden_size": 2560},
        "vision_config": {
            "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "patch_size": 14,
            "num_attention_heads": 16, "num_hidden_layers": 27, "vision_use_head": False,
            "model_type": "siglip_vision_model",
        },
    }  # fmt: skip
    cfg = vision_config_from_hf(raw)
    assert (cfg.n_patches, cfg.mm_tokens_per_image, cfg.pool) == (4096, 256, 4)
    assert (cfg.eps, cfg.text_hidden) == (1e-6, 2560)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"mm_tokens_per_image": 3}, "not a square"),
        ({"mm_tokens_per_image": 9}, "does not divide"),
        ({"vision_config": {"image_size": 18}}, "not a multiple of patch_size"),
        ({"vision_config": {"num_attention_heads": 5}}, "not a multiple of n_heads"),
        ({"vision_config": {"hidden_act": "gelu"}}, "hidden_act"),
        ({"vision_config": {"hidden_size": -32}}, "hidden"),
        ({"vision_config": {"num_hidden_layers": 10**9}}, "n_layers"),
        ({"vision_config": {"layer_norm_eps": "x"}}, "layer_norm_eps"),
    ],
)
def test_bad_hf_config(tmp_path, vlm, change, match):
    config = json.loads((vlm / "config.json").read_text())
    for key, value in change.items():
        if isinstance(value, dict):
            config[key].update(value)
        else:
            config[key] = value
    with pytest.raises(ModelFormatError, match=match) as e:
        vision_config_from_hf(config, path=tmp_path / "config.json")
    assert "config.json" in str(e.value)


def test_bad_gguf_meta():
    good = {
        "clip.projector_type": "gemma3",
        "clip.vision.image_size": 16,
        "clip.vision.patch_size": 4,
        "clip.vision.embedding_length": 32,
        "clip.vision.block_count": 2,
        "clip.vision.attention.head_count": 2,
        "clip.vision.feed_forward_length": 64,
        "clip.vision.projection_dim": 64,
        "clip.vision.attention.layer_norm_epsilon": 1e-6,
        "clip.vision.projector.scale_factor": 2,
    }
    assert vision_config_from_gguf(good).mm_tokens_per_image == 4
    default_scale = {k: v for k, v in good.items() if k != "clip.vision.projector.scale_factor"}
    assert vision_config_from_gguf({**default_scale, "clip.vision.image_size": 64}).mm_tokens_per_image == 16
    for change, match in [
        ({"clip.projector_type": "llava"}, "not 'gemma3'"),
        ({"clip.vision.projector.scale_factor": 3}, "does not divide"),
        ({"clip.vision.block_count": "2"}, "not an integer"),
        ({"clip.vision.embedding_length": 0}, "hidden"),
    ]:
        with pytest.raises(ModelFormatError, match=match):
            vision_config_from_gguf({**good, **change}, "m.gguf")
    meta = dict(good)
    del meta["clip.vision.patch_size"]
    with pytest.raises(ModelFormatError, match="clip.vision.patch_size"):
        vision_config_from_gguf(meta)


# --- corrupt checkpoints and files -------------------------------------------------------------------------


def rewrite(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_missing_hf_tensor(tmp_path):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck", multimodal=True, vision="real")
    name = "model.vision_tower.vision_model.encoder.layers.1.mlp.fc2.bias"
    rewrite(d, lambda t: t.pop(name))
    with pytest.raises(ModelFormatError, match="missing vision tensors: " + name.replace(".", r"\.")):
        read_hf_vision(d)


def test_wrong_shape_hf_tensor(tmp_path):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck", multimodal=True, vision="real")
    name = "model.multi_modal_projector.mm_input_projection_weight"
    rewrite(d, lambda t: t.__setitem__(name, np.zeros((32, 48), np.float32)))
    shown = r"mm_input_projection_weight .*\[32, 48\], expected \[32, 64\]"
    with pytest.raises(ModelFormatError, match=shown):
        read_hf_vision(d)


def test_extra_hf_layer(tmp_path):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck", multimodal=True, vision="real")
    name = "model.vision_tower.vision_model.encoder.layers.2.layer_norm1.weight"
    rewrite(d, lambda t: t.__setitem__(name, np.zeros(32, np.float32)))
    with pytest.raises(ModelFormatError, match="more encoder layers"):
        read_hf_vision(d)


def test_unsupported_hf_dtype(tmp_path):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck", multimodal=True, vision="real")
    name = "model.vision_tower.vision_model.post_layernorm.bias"
    rewrite(d, lambda t: t.__setitem__(name, t[name].astype(np.float64)))
    with pytest.raises(ModelFormatError, match="post_layernorm.bias: dtype F64"):
        read_hf_vision(d)


def test_mmproj_missing_and_misshapen(tmp_path):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck", multimodal=True, vision="real")
    rewrite(d, lambda t: t.pop("model.vision_tower.vision_model.encoder.layers.0.self_attn.k_proj.bias"))
    with pytest.raises(ModelFormatError, match=r"mmproj\.gguf: missing tensors: v\.blk\.0\.attn_k\.bias"):
        read_mmproj(hf_tiny.make_tiny_mmproj(tmp_path / "mmproj.gguf", d))
    d2 = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck2", multimodal=True, vision="real")
    config = json.loads((d2 / "config.json").read_text())
    config["vision_config"]["intermediate_size"] = 48  # the file says 48, the tensors hold 64
    (d2 / "config.json").write_text(json.dumps(config))
    shown = r"v\.blk\.0\.ffn_up\.weight has shape \[64, 32\], expected \[48, 32\]"
    with pytest.raises(ModelFormatError, match=shown):
        read_mmproj(hf_tiny.make_tiny_mmproj(tmp_path / "m2.gguf", d2))


def test_mmproj_of_another_projector(tmp_path, vlm):
    path = hf_tiny.make_tiny_mmproj(tmp_path / "llava.gguf", vlm, projector_type="mlp")
    with pytest.raises(ModelFormatError, match="llava.gguf: clip.projector_type is 'mlp', not 'gemma3'"):
        read_mmproj(path)


def test_mmproj_truncated(tmp_path, vlm):
    path = hf_tiny.make_tiny_mmproj(tmp_path / "t.gguf", vlm)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelFormatError, match="t.gguf"):
        read_mmproj(path)


# --- the VLM tokenizer -------------------------------------------------------------------------------------


def test_vision_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    hf_tiny.write_tokenizer(tmp_path / "t.json", vision=True)
    tok = Tokenizer.from_file(str(tmp_path / "t.json"))
    assert tok.get_vocab_size() == 512
    ids = tok.encode("look <start_of_image><image_soft_token><end_of_image> here").ids
    assert [i for i in ids if i >= 509] == [510, 509, 511]
    assert tok.decode([509, 510, 511], skip_special_tokens=True) == ""
    plain = hf_tiny.build_tokenizer()
    same = [i for i in range(509) if plain.id_to_token(i) == tok.id_to_token(i)]
    assert len(same) == 509
