"""Architectures by name: how to read a config from GGUF metadata and which class runs the forward pass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hmad.core.errors import ModelFormatError, UnsupportedArchitectureError
from hmad.core.model_config import ModelConfig
from hmad.model import gemma3
from hmad.model.hparams import check_hparams


@dataclass(frozen=True)
class Architecture:
    name: str
    model_cls: type
    config_from_gguf: Callable[[dict[str, Any], str], ModelConfig]
    tensor_names: Callable[[ModelConfig], list[str]]


#: ModelConfig field -> (GGUF key under ``gemma3.``, default when absent; ModelFormatError: required)
GEMMA3_GGUF_KEYS: dict[str, tuple[str, Any]] = {
    "n_layers": ("block_count", ModelFormatError),
    "d_model": ("embedding_length", ModelFormatError),
    "n_heads": ("attention.head_count", ModelFormatError),
    "d_ff": ("feed_forward_length", ModelFormatError),
    "context_length": ("context_length", 32768),
    "rms_eps": ("attention.layer_norm_rms_epsilon", 1e-6),
    "rope_base_global": ("rope.freq_base", 1_000_000.0),
    "sliding_window": ("attention.sliding_window", 512),
}


def _gemma3_from_gguf(meta: dict[str, Any], path: str) -> ModelConfig:
    """Gemma 3 hyper-parameters from ``gemma3.*`` GGUF keys (as llama.cpp's converter writes them), checked
    by hmad.model.hparams before the config is built."""

    def stated(key: str, default: Any = ModelFormatError) -> tuple[str, Any]:
        full = f"gemma3.{key}"
        if full in meta:
            return full, meta[full]
        if default is ModelFormatError:
            raise ModelFormatError(path, f"missing metadata key {full!r}")
        return full, default

    s = {field: stated(key, default) for field, (key, default) in GEMMA3_GGUF_KEYS.items()}
    base = check_hparams(path, {f: s[f] for f in ("n_layers", "d_model", "n_heads")})
    s["n_kv_heads"] = stated("attention.head_count_kv", base["n_heads"])
    derived = ("gemma3.embedding_length / gemma3.attention.head_count", base["d_model"] // base["n_heads"])
    s["head_dim"] = stated("attention.key_length", None) if "gemma3.attention.key_length" in meta else derived
    if "gemma3.attention.value_length" in meta:
        s["v_head_dim"] = stated("attention.value_length")
    tokens = meta.get("tokenizer.ggml.tokens")
    s["vocab_size"] = ("tokenizer.ggml.tokens (its length)", len(tokens)) if tokens else stated("vocab_size")
    if stated("rope.scaling.type", "none")[1] == "linear":
        s["rope_scale_global"] = stated("rope.scaling.factor", 1.0)
    if meta.get("tokenizer.ggml.add_bos_token", True) is not False:
        s["bos_id"] = ("tokenizer.ggml.bos_token_id", meta.get("tokenizer.ggml.bos_token_id", 2))
    s["eos_ids"] = ("tokenizer.ggml.eos_token_id", meta.get("tokenizer.ggml.eos_token_id", 1))
    v = check_hparams(path, s)
    v.pop("v_head_dim", None)
    v.setdefault("bos_id", 2)
    # llama.cpp: the 27B model (62 layers) scales queries by 1/sqrt(d_model / n_heads), others 1/sqrt(Dh)
    scalar = v["d_model"] / v["n_heads"] if v["n_layers"] == 62 else None
    keys = {f: key for f, (key, _) in s.items()}
    name = str(meta.get("general.name", ""))
    return ModelConfig(arch="gemma3", name=name, query_pre_attn_scalar=scalar, source_keys=keys, **v)


ARCHITECTURES: dict[str, Architecture] = {
    "gemma3": Architecture("gemma3", gemma3.Gemma3, _gemma3_from_gguf, gemma3.tensor_names),
}

#: HF ``architectures[0]`` / ``model_type`` -> registry key
HF_ALIASES = {
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}


def get_architecture(name: str) -> Architecture:
    key = HF_ALIASES.get(name, name)
    if key not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedArchitectureError(f"architecture {name!r} is not supported (known: {known})")
    return ARCHITECTURES[key]
