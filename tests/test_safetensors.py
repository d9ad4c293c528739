"""HF checkpoint loader (hmad.model.safetensors) and the forward pass against transformers' Gemma 3.

The checkpoints are the tiny random ones of tests/hf_tiny.py (numpy only). The logits tests compare
``forward_full(load_model(dir), ids)`` with transformers' Gemma3ForCausalLM: against the committed fixture
tests/fixtures/hf_tiny_reference.npz (made by tests/fixtures/make_hf_reference.py), and live on other random
weights when torch + transformers are importable.

Tolerance: max |hmad - transformers| <= 1e-4 * max |logit|, both float32. The two sides differ only in
summation order (numpy's BLAS vs torch's kernels), ~1e-7 relative per op; measured ~6e-6 on logits of max
~14 (4e-7 of it), so the bound leaves >100x headroom. A modelling mistake is far above it: a sliding window
off by one changes logits by ~5, no rope scaling on global layers by ~1, a wrong local rope base by ~2.4, a
wrong attention scale by ~3 (measured with transformers on this checkpoint).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import hf_tiny
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hmad.core.errors import ModelFormatError
from hmad.core.tensors import QType
from hmad.model.safetensors import (
    LAYER_NAMES,
    NORM_NAMES,
    read_hf_checkpoint,
    read_hf_config,
    read_safetensors_header,
)

FIXTURE = Path(__file__).parent / "fixtures" / "hf_tiny_reference.npz"
REL_TOL = 1e-4  # of max |logit|; see the module docstring
QTYPES = {"float32": QType.F32, "float16": QType.F16, "bfloat16": QType.BF16}


def gguf_to_hf() -> dict[str, str]:
    """GGUF name -> CausalLM HF name for the tiny model (untied head included)."""
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    for i in range(hf_tiny.TINY["layers"]):
        for hf, gg in LAYER_NAMES.items():
            names[f"blk.{i}.{gg}.weight"] = f"model.layers.{i}.{hf}.weight"
    return names


def is_norm(gguf_name: str) -> bool:
    return gguf_name.split(".")[-2] in NORM_NAMES or gguf_name == "output_norm.weight"


def is_file_view(a: np.ndarray) -> bool:
    """True when ``a`` is a view of a memory map (walks the .base chain)."""
    while a is not None:
        if isinstance(a, np.memmap):
            return True
        a = a.base if isinstance(a, np.ndarray) else None
    return False


def values(t) -> np.ndarray:
    """float32 values of a plain WeightTensor (bf16 bits widened)."""
    if t.qtype == QType.BF16:
        return hf_tiny.from_bf16_bits(np.asarray(t.data))
    return np.asarray(t.data, dtype=np.float32)


def check_values(ck, written: dict[str, np.ndarray], dtype: str, tied: bool = True) -> None:
    """Every canonical tensor holds what was written: matrices as stored views, norms as 1 + w in float32."""
    expected = {g: h for g, h in gguf_to_hf().items() if h in written}
    assert set(ck.tensors) == set(expected) - ({"output.weight"} if tied else set())
    for g, t in ck.tensors.items():
        stored = hf_tiny.stored_values(written[expected[g]], dtype)
        assert t.shape == stored.shape, g
        if is_norm(g):
            assert t.qtype == QType.F32 and t.data.dtype == np.float32
            np.testing.assert_array_equal(t.data, stored + np.float32(1.0), err_msg=g)
        else:
            assert t.qtype == QTYPES[dtype], g
            assert is_file_view(t.data) and not t.data.flags.writeable, f"{g} is not a view of the file"
            np.testing.assert_array_equal(values(t), stored, err_msg=g)


# --- values, layouts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_values_round_trip(tmp_path, dtype):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck", seed=3, dtype=dtype)
    ck = read_hf_checkpoint(d)
    written = hf_tiny.random_text_weights(3)
    check_values(ck, written, dtype)
    assert ck.tokenizer_path == d / "tokenizer.json"
    if dtype == "bfloat16":  # 8 significant bits, rounded to nearest: error <= half an ulp <= 2^-8 relative
        emb = values(ck.tensors["token_embd.weight"])
        src = written["model.embed_tokens.weight"]
        assert np.all(np.abs(emb - src) <= np.abs(src) * 2.0**-8)
        assert np.abs(emb - src).max() > 0  # really rounded, not float32 in disguise


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_reader_agrees_with_safetensors_library(tmp_path, dtype):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck", seed=4, dtype=dtype)
    lib = load_file(str(d / "model.safetensors"))
    ck = read_hf_checkpoint(d)
    t = ck.tensors["blk.2.ffn_down.weight"]
    np.testing.assert_array_equal(t.data, lib["model.layers.2.mlp.down_proj.weight"])


def test_bf16_writer_agrees_with_torch(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file as torch_load

    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck", seed=5, dtype="bfloat16")
    ref = torch_load(str(d / "model.safetensors"))["model.layers.1.self_attn.q_proj.weight"]
    src = torch.from_numpy(hf_tiny.random_text_weights(5)["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(ref, src.to(torch.bfloat16))  # torch's own rounding == ours
    ck = read_hf_checkpoint(d)
    np.testing.assert_array_equal(values(ck.tensors["blk.1.attn_q.weight"]), ref.float().numpy())


def test_sharded_index(tmp_path):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck", seed=6, dtype="bfloat16", sharded=True)
    assert len(list(d.glob("model-*-of-00003.safetensors"))) == 3
    ck = read_hf_checkpoint(d)
    check_values(ck, hf_tiny.random_text_weights(6), "bfloat16")
    assert len({t.source for t in ck.tensors.values() if not is_norm(t.name)}) == 3


@pytest.mark.parametrize("layout", ["new", "old"])
def test_multimodal_text_tower(tmp_path, layout):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "mm", seed=7, multimodal=True, mm_layout=layout)
    raw = json.loads((d / "config.json").read_text())
    assert raw["model_type"] == "gemma3" and "text_config" in raw
    ck = read_hf_checkpoint(d)
    check_values(ck, hf_tiny.random_text_weights(7), "float32")
    assert not any("vision" in t.source for t in ck.tensors.values())
    cfg = ck.config
    assert (cfg.n_layers, cfg.d_model, cfg.vocab_size, cfg.eos_ids) == (6, 64, 512, [1, 5])


@pytest.mark.parametrize(("multimodal", "layout"), [(False, "new"), (True, "old"), (True, "new")])
def test_untied_head(tmp_path, multimodal, layout):
    d = hf_tiny.make_tiny_hf_checkpoint(
        tmp_path / "ck", seed=8, tied=False, sharded=True, multimodal=multimodal, mm_layout=layout
    )
    ck = read_hf_checkpoint(d)
    assert not ck.config.tied_embeddings
    check_values(ck, hf_tiny.random_text_weights(8, tied=False), "float32", tied=False)


def test_vision_tensors_ignored(tmp_path):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "mm", seed=9, multimodal=True)
    extra = load_file(str(d / "model-extra.safetensors"))
    assert any(a.dtype == np.float64 for a in extra.values())  # a dtype the text loader does not read
    ck = read_hf_checkpoint(d)
    assert all(n.startswith(("blk.", "token_embd", "output_norm")) for n in ck.tensors)


# --- config.json mapping ----------------------------------------------------------------------------------


def write_config(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_config_mapping(tmp_path):
    cfg = read_hf_config(write_config(tmp_path, hf_tiny.text_config()))
    assert (cfg.arch, cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff) == (
        "gemma3",
        6,
        64,
        4,
        2,
        16,
        128,
    )
    assert (cfg.vocab_size, cfg.context_length, cfg.rms_eps, cfg.sliding_window) == (512, 1024, 1e-6, 8)
    assert (cfg.rope_base_global, cfg.rope_base_local, cfg.rope_scale_global) == (1e6, 1e4, 2.0)
    assert cfg.rope_for_layer(5) == (1e6, 2.0) and cfg.rope_for_layer(0) == (1e4, 1.0)
    assert cfg.layer_is_global == [False] * 5 + [True]
    assert cfg.attn_scale == pytest.approx(0.25) and cfg.tied_embeddings
    assert (cfg.bos_id, cfg.eos_ids) == (2, [1, 5])


def test_config_pattern_and_transformers5_rope(tmp_path):
    c = hf_tiny.text_config()
    del c["layer_types"], c["rope_theta"], c["rope_local_base_freq"], c["rope_scaling"]
    c.update(
        num_hidden_layers=12,
        sliding_window_pattern=4,
        eos_token_id=1,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 2e4},
        },
    )
    cfg = read_hf_config(write_config(tmp_path, c))
    assert cfg.layer_is_global == [(i + 1) % 4 == 0 for i in range(12)]
    assert (cfg.rope_base_global, cfg.rope_scale_global, cfg.rope_base_local) == (5e5, 8.0, 2e4)
    assert cfg.eos_ids == [1]


def test_multimodal_config_defaults(tmp_path):
    """A sparse text_config (as in gemma-3-4b) takes the rest from Gemma3TextConfig's defaults."""
    c = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
    }
    cfg = read_hf_config(write_config(tmp_path, c))
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (2560, 34, 8, 4, 256)
    assert (cfg.vocab_size, cfg.rope_scale_global, cfg.rope_base_global, cfg.rope_base_local) == (
        262_208,
        8.0,
        1e6,
        1e4,
    )
    assert cfg.eos_ids == [1, 106] and cfg.query_pre_attn_scalar == 256 and cfg.sliding_window == 1024


# --- errors name the file ---------------------------------------------------------------------------------


def raises_naming(path: Path, match: str):
    """pytest.raises for a ModelFormatError whose message starts with ``path``."""
    return pytest.raises(ModelFormatError, match=f"^{re.escape(str(path))}: .*{match}")


def test_missing_config(tmp_path):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck")
    (d / "config.json").unlink()
    with raises_naming(d / "config.json", "missing config.json"):
        read_hf_checkpoint(d)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "unsupported architecture"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"layer_types": ["full_attention"] * 5}, "layer_types"),
        ({"num_hidden_layers": "six"}, "num_hidden_layers = 'six' is not an integer"),
    ],
)
def test_config_refused(tmp_path, change, match):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck")
    c = json.loads((d / "config.json").read_text())
    c.update(change)
    (d / "config.json").write_text(json.dumps(c))
    with raises_naming(d / "config.json", match):
        read_hf_checkpoint(d)


def rewrite_without(path: Path, drop: str | None = None, replace: dict | None = None) -> None:
    tensors = load_file(str(path))
    tensors.pop(drop, None)
    tensors.update(replace or {})
    save_file(tensors, str(path))


def test_missing_tensor(tmp_path):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck")
    rewrite_without(d / "model.safetensors", drop="model.layers.3.mlp.up_proj.weight")
    with raises_naming(d / "model.safetensors", "missing tensors: model.layers.3.mlp.up_proj.weight"):
        read_hf_checkpoint(d)


def test_missing_tensor_sharded_names_index(tmp_path):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck", sharded=True)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = d / index["weight_map"]["model.norm.weight"]
    rewrite_without(shard, drop="model.norm.weight")
    with raises_naming(d / "model.safetensors.index.json", "model.norm.weight"):
        read_hf_checkpoint(d)


def test_missing_shard(tmp_path):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck", sharded=True)
    (d / "model-00002-of-00003.safetensors").unlink()
    with raises_naming(d / "model.safetensors.index.json", "model-00002-of-00003.safetensors"):
        read_hf_checkpoint(d)


def test_missing_lm_head_when_untied(tmp_path):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck", tied=False)
    rewrite_without(d / "model.safetensors", drop="lm_head.weight")
    with raises_naming(d / "model.safetensors", "lm_head.weight"):
        read_hf_checkpoint(d)


def test_bad_shape(tmp_path):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck", sharded=True)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.k_proj.weight"
    shard = d / index["weight_map"][name]
    rewrite_without(shard, replace={name: np.zeros((16, 64), np.float32)})
    implied = "num_key_value_heads = 2, head_dim = 16, hidden_size = 64 in config.json imply"
    with raises_naming(shard, rf"{name} has shape \[16, 64\], but {implied} \[32, 64\]"):
        read_hf_checkpoint(d)


def test_extra_layers_refused(tmp_path):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck")
    extra = {"model.layers.6.mlp.up_proj.weight": np.zeros((4,), np.float32)}
    rewrite_without(d / "model.safetensors", replace=extra)
    with raises_naming(
        d / "model.safetensors", "num_hidden_layers = 6, but the file holds tensors of layers 0-6"
    ):
        read_hf_checkpoint(d)


@pytest.mark.parametrize("corruption", ["truncated", "huge_length", "not_json", "bad_offsets", "tiny"])
def test_corrupt_header(tmp_path, corruption):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck")
    path = d / "model.safetensors"
    blob = bytearray(path.read_bytes())
    n = int.from_bytes(blob[:8], "little")
    if corruption == "truncated":
        blob = blob[: 8 + n + 100]  # data cut short: offsets point past the end
    elif corruption == "huge_length":
        blob[:8] = (len(blob) * 2).to_bytes(8, "little")
    elif corruption == "not_json":
        blob[8:12] = b"\xff\xfe{["
    elif corruption == "bad_offsets":
        header = json.loads(blob[8 : 8 + n])
        header["model.norm.weight"]["data_offsets"][1] += 4
        text = json.dumps(header).encode()
        blob = bytearray(len(text).to_bytes(8, "little")) + text + blob[8 + n :]
    else:
        blob = blob[:5]
    path.write_bytes(bytes(blob))
    with raises_naming(path, "corrupt safetensors header"):
        read_hf_checkpoint(d)


def test_header_reader_skips_metadata(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"a": np.ones((2, 3), np.float16)}, str(path), metadata={"format": "pt"})
    f = read_safetensors_header(path)
    assert list(f.entries) == ["a"]
    t = f.tensor("a")
    assert t.qtype == QType.F16 and t.shape == (2, 3) and np.all(t.data == 1)


def test_missing_tokenizer(tmp_path):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck")
    (d / "tokenizer.json").unlink()
    with raises_naming(d / "tokenizer.json", "tokenizer.json"):
        read_hf_checkpoint(d)
    assert read_hf_checkpoint(d, require_tokenizer=False).tokenizer_path is None


def test_tokenizer_file(tmp_path):
    from tokenizers import Tokenizer

    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size() == 512
    assert [tok.token_to_id(s) for s in hf_tiny.SPECIALS] == [0, 1, 2, 3, 4, 5]
    text = "<start_of_turn>user\nhello wörld<end_of_turn>"
    ids = tok.encode(text).ids
    assert ids[:2] == [2, 4] and ids[-1] == 5 and max(ids) < 512
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + text


# --- logits against transformers ------------------------------------------------------------------------


def hmad_logits(directory: Path, prompts: list[list[int]]) -> list[np.ndarray]:
    from hmad.composition import load_model
    from hmad.engine.generate import forward_full

    model = load_model(directory, backend="cpu", numerics="f32")
    return [forward_full(model, ids) for ids in prompts]


def assert_logits_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape and got.dtype == np.float32, what
    err, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
    assert err <= REL_TOL * scale, f"{what}: max abs error {err:.3g} > {REL_TOL} * max|logit| {scale:.3g}"
    assert np.array_equal(got.argmax(-1), want.argmax(-1)), what


def test_logits_match_committed_transformers_fixture(tmp_path):
    ref = np.load(FIXTURE)
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck", seed=int(ref["seed"]), dtype="float32")
    assert hf_tiny.weights_checksum(d) == pytest.approx(float(ref["weights_checksum"]), rel=1e-9), (
        "hf_tiny now writes different weights than the fixture was made from: "
        "rerun tests/fixtures/make_hf_reference.py"
    )
    prompts = [ref[f"prompt_{k}"].tolist() for k in range(int(ref["n_prompts"]))]
    assert max(len(p) for p in prompts) > hf_tiny.TINY["window"]
    for k, got in enumerate(hmad_logits(d, prompts)):
        what = f"prompt {k} (fixture from transformers {ref['transformers_version']})"
        assert_logits_close(got, ref[f"logits_{k}"], what)


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_live_transformers(tmp_path, tied):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck", seed=11, dtype="float32", tied=tied)
    prompts = hf_tiny.fixed_prompts((3, 9, 17, 30), seed=99)
    want = hf_tiny.transformers_logits(d, prompts)
    for k, got in enumerate(hmad_logits(d, prompts)):
        assert_logits_close(got, want[k], f"prompt {k} (tied={tied})")


@pytest.mark.parametrize(
    ("change", "drop", "match"),
    [
        ({"num_hidden_layers": 4294967295}, "layer_types", "num_hidden_layers = 4294967295 is out of range"),
        (
            {"num_hidden_layers": 5},
            "layer_types",
            "num_hidden_layers = 5, but the file holds tensors of layers 0-5",
        ),
        ({"num_hidden_layers": 7}, None, "layer_types must list num_hidden_layers = 7"),
        ({"sliding_window_pattern": 0}, "layer_types", "sliding_window_pattern = 0 is out of range"),
        ({"num_attention_heads": 0}, None, "num_attention_heads = 0 is out of range"),
        ({"head_dim": 8}, None, "head_dim = 8"),
        ({"query_pre_attn_scalar": 0}, None, "query_pre_attn_scalar = 0 is out of range"),
        ({"rope_scaling": 2.0}, None, "rope_scaling = 2.0 is not an object"),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": -2}},
            None,
            "rope_scaling.factor = -2 is out of range",
        ),
        ({"eos_token_id": [1, 512]}, None, "eos_token_id = 512 is not a token id: vocab_size = 512"),
        ({"vocab_size": 500}, None, "vocab_size = 500, hidden_size = 64 in config.json imply [500, 64]"),
    ],
)
def test_config_numbers_checked(tmp_path, change, drop, match):
    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck")
    c = json.loads((d / "config.json").read_text())
    c.pop(drop or "", None)
    c.update(change)
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(ModelFormatError) as e:
        read_hf_checkpoint(d)
    assert match in e.value.problem


def test_tokenizer_larger_than_the_embedding_refused(tmp_path):
    from hmad.model.loader import check_tensors, read_model_files

    d = hf_tiny.make_tiny_hf_checkpoint(tmp_path / "ck")
    weights = load_file(str(d / "model.safetensors"))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:500]
    save_file(weights, str(d / "model.safetensors"))
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "vocab_size": 500}))
    with pytest.raises(
        ModelFormatError, match="the tokenizer has 512 tokens, more than the embedding's vocab_size"
    ):
        check_tensors(read_model_files(d))
