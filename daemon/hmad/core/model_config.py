"""ModelConfig: the architecture hyper-parameters, built from GGUF metadata or an HF config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer (Gemma 3 text first).

    Derived fields are filled in ``__post_init__``; loaders pass only what the file states.
    """

    arch: str  # registry key, e.g. "gemma3"
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    context_length: int = 32768
    rms_eps: float = 1e-6
    rope_base_global: float = 1_000_000.0
    rope_base_local: float = 10_000.0
    rope_scale_global: float = 1.0  # linear scaling factor (8 for 4B/12B/27B)
    sliding_window: int = 512
    sliding_window_pattern: int = 6  # every 6th layer (i % 6 == 5) is global
    query_pre_attn_scalar: float | None = None  # attention scale = 1/sqrt(this); default head_dim
    layer_is_global: list[bool] = field(default_factory=list)
    tied_embeddings: bool = True
    bos_id: int = 2
    eos_ids: list[int] = field(default_factory=lambda: [1])
    name: str = ""
    #: the file's key for each field (``n_layers`` -> ``gemma3.block_count``), for messages that name them
    source_keys: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.query_pre_attn_scalar is None:
            self.query_pre_attn_scalar = float(self.head_dim)
        if not self.layer_is_global:
            p = self.sliding_window_pattern
            self.layer_is_global = [(i + 1) % p == 0 for i in range(self.n_layers)]
        if len(self.layer_is_global) != self.n_layers:
            raise ValueError(
                f"layer_is_global has {len(self.layer_is_global)} entries for {self.n_layers} layers"
            )

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar)

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.d_model)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def rope_for_layer(self, i: int) -> tuple[float, float]:
        """(base, linear scale) of layer i: global layers use the file's base and scaling, local 10k and 1."""
        if self.layer_is_global[i]:
            return self.rope_base_global, self.rope_scale_global
        return self.rope_base_local, 1.0

    def summary(self) -> dict[str, Any]:
        return {
            k: getattr(self, k)
            for k in (
                "arch",
                "name",
                "n_layers",
                "d_model",
                "n_heads",
                "n_kv_heads",
                "head_dim",
                "d_ff",
                "vocab_size",
                "context_length",
                "sliding_window",
            )
        }
