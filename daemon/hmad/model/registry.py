"""Architectures by name: how to read a config from GGUF metadata and which class runs the forward pass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hmad.errors import ModelFormatError, UnsupportedArchitectureError
from hmad.model import gemma3
from hmad.model.config import ModelConfig


@dataclass(frozen=True)
class Architecture:
    name: str
    model_cls: type
    config_from_gguf: Callable[[dict[str, Any], str], ModelConfig]
    tensor_names: Callable[[ModelConfig], list[str]]


def _gemma3_from_gguf(meta: dict[str, Any], path: str) -> ModelConfig:
    """Gemma 3 hyper-parameters from ``gemma3.*`` GGUF keys (as llama.cpp's converter writes them)."""

    def get(key: str, default: Any = ModelFormatError) -> Any:
        full = f"gemma3.{key}"
        if full in meta:
            return meta[full]
        if default is ModelFormatError:
            raise ModelFormatError(path, f"missing metadata key {full!r}")
        return default

    n_layers, d_model, n_heads = (
        int(get("block_count")),
        int(get("embedding_length")),
        int(get("attention.head_count")),
    )
    scaling = get("rope.scaling.type", "none")
    return ModelConfig(
        arch="gemma3",
        name=str(meta.get("general.name", "")),
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=int(get("attention.key_length", d_model // n_heads)),
        d_ff=int(get("feed_forward_length")),
        vocab_size=len(meta.get("tokenizer.ggml.tokens", ())) or int(get("vocab_size")),
        context_length=int(get("context_length", 32768)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_base_global=float(get("rope.freq_base", 1_000_000.0)),
        rope_scale_global=float(get("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
        sliding_window=int(get("attention.sliding_window", 512)),
        # llama.cpp: the 27B model (62 layers) scales queries by 1/sqrt(d_model / n_heads), others 1/sqrt(Dh)
        query_pre_attn_scalar=d_model / n_heads if n_layers == 62 else None,
        bos_id=int(meta.get("tokenizer.ggml.bos_token_id", 2)),
        eos_ids=[int(meta.get("tokenizer.ggml.eos_token_id", 1))],
    )


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
