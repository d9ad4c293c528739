"""HF checkpoints: ``config.json`` + ``*.safetensors`` (+ index) + ``tokenizer.json`` -> config and weights.

``read_hf_checkpoint(directory)`` returns an ``HFCheckpoint`` whose ``tensors`` carry the **canonical GGUF
names** the forward pass uses (``token_embd.weight``, ``blk.{i}.attn_q.weight`` ...), so an HF checkpoint
and a GGUF file look alike to everything after the loader.

Layouts read:
- ``Gemma3ForCausalLM`` / model_type ``gemma3_text``: weights ``model.layers.N...``, config at the top level;
- the text tower of ``Gemma3ForConditionalGeneration`` / model_type ``gemma3``: config under ``text_config``,
  weights ``language_model.model.*`` (older exports) or ``model.language_model.*`` (newer ones); the vision
  tower and projector are ignored.
Sharded checkpoints name their files in ``model.safetensors.index.json`` (``weight_map``); without an index
every ``*.safetensors`` file in the directory is read.

Safetensors file format (read here directly)::

    u64 little-endian N | N bytes of JSON header | data
    header: {"name": {"dtype": "F32"|"F16"|"BF16"|..., "shape": [...], "data_offsets": [begin, end]}, ...,
             "__metadata__": {...}}     offsets are relative to the start of the data (byte 8 + N)

Why not ``safetensors.safe_open(..., framework="np")``: its ``get_tensor`` returns a *copy* (a writeable array
built from the bytes, checked with safetensors 0.8), and it cannot give bf16 at all (numpy has no bfloat16
dtype). So each file is memory-mapped once (``np.memmap``, read-only) and every tensor is a zero-copy view of
it: F32 -> float32, F16 -> float16, BF16 -> **uint16 holding the bf16 bits, with QType.BF16** (the
WeightTensor convention). The views keep the map alive; nothing is read until a tensor is touched.

``sanitize()`` does the checkpoint fix-ups, like mlx-lm: HF stores Gemma's RMSNorm weight ``w`` and the
model multiplies by ``1 + w``; GGUF files (and so the forward pass) hold ``1 + w``. Norm weights are therefore
converted to float32 and incremented by one (small new arrays: D or Dh floats each). A tied ``lm_head`` is
dropped; an untied one becomes ``output.weight``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hmad.core.errors import ModelFormatError
from hmad.core.model_config import ModelConfig
from hmad.core.tensors import QType, WeightTensor
from hmad.model.hparams import Stated, check_hparams, check_layer_count, layer_indices, shape_problem

#: safetensors dtype -> (QType, numpy dtype of the view); bf16 is viewed as its raw uint16 bits.
DTYPES: dict[str, tuple[QType, type]] = {
    "F32": (QType.F32, np.float32),
    "F16": (QType.F16, np.float16),
    "BF16": (QType.BF16, np.uint16),
}
#: bytes per element of every dtype the format defines, to check offsets of tensors we do not use
DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit

#: text-model prefixes, tried in this order: CausalLM, new multimodal export, old multimodal export
TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.")
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")

#: HF per-layer suffix -> GGUF per-layer name (both without the ``.weight``)
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_feedforward_layernorm": "post_ffw_norm",
}
NORM_NAMES = {"attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"}

#: Gemma3TextConfig's defaults (transformers), used for keys a config.json leaves out — the multimodal
#: exports' ``text_config`` states only what differs from these.
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rope_scaling": None,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "attention_bias": False,
    "use_bidirectional_attention": False,
}
#: keys whose explicit null means something (elsewhere null means "the default")
NULLABLE = {
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "rope_scaling",
    "rope_parameters",
    "sliding_window",
    "layer_types",
}


@dataclass
class HFCheckpoint:
    """An HF checkpoint directory, parsed: config, memory-mapped weights under GGUF names, tokenizer file."""

    directory: Path
    config: ModelConfig
    tensors: dict[str, WeightTensor]
    tokenizer_path: Path | None
    files: list[Path] = field(default_factory=list)  # the safetensors files the weights live in


def read_hf_checkpoint(directory: str | Path, *, require_tokenizer: bool = True) -> HFCheckpoint:
    """Parse an HF Gemma 3 checkpoint directory (nothing is copied but the norm weights).

    Raises ``ModelFormatError`` naming the file for a missing ``config.json``, an unsupported architecture or
    config value, a corrupt safetensors header, a missing tensor or one of the wrong shape, and (when
    ``require_tokenizer``) a missing ``tokenizer.json``.
    """
    directory = Path(directory)
    config = read_hf_config(directory / "config.json")
    files = open_safetensors_files(directory)
    raw = {name: f for f in files for name in f.entries}
    tensors = canonical_tensors(raw, config, directory)
    tensors = sanitize(tensors, config)
    tokenizer_path = directory / "tokenizer.json"
    if not tokenizer_path.is_file():
        if require_tokenizer:
            raise ModelFormatError(tokenizer_path, "missing tokenizer.json (the HF fast-tokenizer file)")
        tokenizer_path = None
    return HFCheckpoint(directory, config, tensors, tokenizer_path, [f.path for f in files])


# --- config.json -----------------------------------------------------------------------------------------


def read_hf_config(path: str | Path) -> ModelConfig:
    """``config.json`` -> ModelConfig (Gemma 3 text, or the text tower of the multimodal model)."""
    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(path, "missing config.json (not an HF checkpoint directory?)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(path, f"cannot parse config.json: {e}") from e
    if not isinstance(raw, dict):
        raise ModelFormatError(path, "config.json is not a JSON object")
    c = text_config(raw, path)
    try:
        return config_from_hf(c, path)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFormatError(path, f"bad config value: {e!r}") from e


def text_config(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """The text model's config dict, with Gemma3TextConfig's defaults for absent keys."""
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if model_type == "gemma3" or "Gemma3ForConditionalGeneration" in archs:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ModelFormatError(path, "model_type gemma3 without a text_config object")
        text = dict(text)
        for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):  # stated at the top level
            if key not in text and raw.get(key) is not None:
                text[key] = raw[key]
    elif model_type == "gemma3_text" or "Gemma3ForCausalLM" in archs:
        text = dict(raw)
    else:
        raise ModelFormatError(
            path,
            f"unsupported architecture {archs or None} (model_type {model_type!r}); "
            "hmad reads Gemma3ForCausalLM (gemma3_text) and the text tower of "
            "Gemma3ForConditionalGeneration (gemma3)",
        )
    return {**TEXT_DEFAULTS, **{k: v for k, v in text.items() if v is not None or k in NULLABLE}}


#: ModelConfig field -> Gemma3TextConfig key
HF_KEYS = {
    "n_layers": "num_hidden_layers",
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "d_ff": "intermediate_size",
    "vocab_size": "vocab_size",
    "context_length": "max_position_embeddings",
    "rms_eps": "rms_norm_eps",
    "sliding_window": "sliding_window",
    "query_pre_attn_scalar": "query_pre_attn_scalar",
    "bos_id": "bos_token_id",
    "eos_ids": "eos_token_id",
}


def config_from_hf(c: dict[str, Any], path: Path) -> ModelConfig:
    """Map Gemma3TextConfig keys onto ModelConfig, refusing what the forward pass does not implement; every
    number is checked (hmad.model.hparams) before anything is sized by it."""
    refuse_unsupported(c, path)
    s: Stated = {f: (key, c[key]) for f, key in HF_KEYS.items()}
    pattern_key = "_sliding_window_pattern" if c.get("_sliding_window_pattern") else "sliding_window_pattern"
    s["sliding_window_pattern"] = (pattern_key, c[pattern_key])
    s.update(rope_settings(c, path))
    v = check_hparams(path, s)
    return ModelConfig(
        arch="gemma3",
        name=path.parent.name,
        layer_is_global=layer_kinds(c, v["n_layers"], v["sliding_window_pattern"], path),
        tied_embeddings=bool(c["tie_word_embeddings"]),
        source_keys={f: key for f, (key, _) in s.items()},
        **v,
    )


def refuse_unsupported(c: dict[str, Any], path: Path) -> None:
    act = c.get("hidden_activation") or c.get("hidden_act")
    if act != "gelu_pytorch_tanh":
        raise ModelFormatError(path, f"hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.get(key) is not None:
            raise ModelFormatError(path, f"{key} = {c[key]} is not supported (must be null)")
    if c.get("attention_bias"):
        raise ModelFormatError(path, "attention_bias = true is not supported")
    if c.get("use_bidirectional_attention"):
        raise ModelFormatError(path, "use_bidirectional_attention = true is not supported")
    if c.get("sliding_window") is None:
        raise ModelFormatError(path, "sliding_window is null")


def rope_settings(c: dict[str, Any], path: Path) -> Stated:
    """``rope_base_global``, ``rope_scale_global`` (linear) and ``rope_base_local`` as stated, from either
    config style (checked by the caller).

    Old style (config.json files on the Hub): ``rope_theta`` (global), ``rope_local_base_freq`` (local),
    ``rope_scaling`` ``{"rope_type" | "type": "linear", "factor": f}`` applying to global layers only.
    transformers 5 style: ``rope_parameters`` = ``{"full_attention": {"rope_type", "rope_theta", "factor"},
    "sliding_attention": {...}}``.
    """
    params = c.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = _rope_dict(params.get("full_attention") or {}, "rope_parameters.full_attention", path)
        local = _rope_dict(params.get("sliding_attention") or {}, "rope_parameters.sliding_attention", path)
        if rope_scale(local, "rope_parameters.sliding_attention", path)[1] != 1.0:
            raise ModelFormatError(path, "rope scaling on sliding-window layers is not supported")
        return {
            "rope_base_global": (
                "rope_parameters.full_attention.rope_theta",
                full.get("rope_theta", c["rope_theta"]),
            ),
            "rope_base_local": (
                "rope_parameters.sliding_attention.rope_theta",
                local.get("rope_theta", c["rope_local_base_freq"]),
            ),
            "rope_scale_global": rope_scale(full, "rope_parameters.full_attention", path),
        }
    return {
        "rope_base_global": ("rope_theta", c["rope_theta"]),
        "rope_base_local": ("rope_local_base_freq", c["rope_local_base_freq"]),
        "rope_scale_global": rope_scale(
            _rope_dict(c["rope_scaling"] or {}, "rope_scaling", path), "rope_scaling", path
        ),
    }


def _rope_dict(spec: Any, key: str, path: Path) -> dict[str, Any]:
    if not isinstance(spec, dict):
        raise ModelFormatError(path, f"{key} = {spec!r} is not an object")
    return spec


def rope_scale(spec: dict[str, Any], key: str, path: Path) -> tuple[str, Any]:
    """(key, linear factor) of a rope-scaling object; 1.0 for the default type."""
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind == "default":
        return key, 1.0
    if kind != "linear":
        raise ModelFormatError(path, f"rope scaling type {kind!r} is not supported (only linear)")
    if "factor" not in spec:
        raise ModelFormatError(path, f"{key} is linear but has no factor")
    return f"{key}.factor", spec["factor"]


def layer_kinds(c: dict[str, Any], n_layers: int, pattern: int, path: Path) -> list[bool]:
    """layer_is_global from ``layer_types``, else from the sliding-window pattern (every p-th layer);
    ``n_layers`` and ``pattern`` already checked."""
    types = c.get("layer_types")
    if types is None:
        return [(i + 1) % pattern == 0 for i in range(n_layers)]
    kinds = {"sliding_attention", "full_attention"}
    if not isinstance(types, list) or len(types) != n_layers or not all(t in kinds for t in types):
        shown = repr(types) if len(repr(types)) < 200 else repr(types)[:200] + "…"
        raise ModelFormatError(
            path, f"layer_types must list num_hidden_layers = {n_layers} of {sorted(kinds)}, got {shown}"
        )
    return [t == "full_attention" for t in types]


# --- safetensors files ---------------------------------------------------------------------------------


@dataclass
class SafetensorsFile:
    """One ``.safetensors`` file: its parsed header; tensors are views of one read-only memory map."""

    path: Path
    entries: dict[str, dict[str, Any]]  # name -> {"dtype", "shape", "data_offsets"}
    data_start: int  # 8 + header length
    _map: np.memmap | None = field(default=None, repr=False)

    def tensor(self, name: str, gguf_name: str | None = None) -> WeightTensor:
        """The named tensor as a zero-copy WeightTensor (bf16 as uint16 bits, QType.BF16)."""
        e = self.entries[name]
        if e["dtype"] not in DTYPES:
            raise ModelFormatError(
                self.path, f"tensor {name}: dtype {e['dtype']} is not supported (F32, F16, BF16)"
            )
        qtype, np_dtype = DTYPES[e["dtype"]]
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = e["data_offsets"]
        shape = tuple(e["shape"])
        data = self._map[self.data_start + begin : self.data_start + end].view(np_dtype).reshape(shape)
        return WeightTensor(gguf_name or name, qtype, shape, data, str(self.path))


def read_safetensors_header(path: str | Path) -> SafetensorsFile:
    """Parse and check a safetensors header: sizes, JSON, every tensor's offsets inside the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFormatError(path, f"corrupt safetensors header: the file has only {size} bytes")
            n = int.from_bytes(head, "little")
            if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
                raise ModelFormatError(
                    path, f"corrupt safetensors header: header length {n} for a file of {size} bytes"
                )
            header = json.loads(f.read(n).decode("utf-8"))
    except OSError as e:
        raise ModelFormatError(path, f"cannot read: {e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(path, f"corrupt safetensors header: not JSON ({e})") from e
    if not isinstance(header, dict):
        raise ModelFormatError(path, "corrupt safetensors header: not a JSON object")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    for name, e in header.items():
        check_entry(path, name, e, data_bytes)
    return SafetensorsFile(path, header, 8 + n)


def check_entry(path: Path, name: str, e: Any, data_bytes: int) -> None:
    try:
        dtype, shape, (begin, end) = e["dtype"], [int(d) for d in e["shape"]], e["data_offsets"]
        itemsize = DTYPE_BYTES[dtype]
    except (TypeError, KeyError, ValueError) as err:
        raise ModelFormatError(path, f"corrupt safetensors header: bad entry for {name}: {e!r}") from err
    expected = math.prod(shape) * itemsize
    if not (0 <= begin <= end <= data_bytes) or end - begin != expected:
        raise ModelFormatError(
            path,
            f"corrupt safetensors header: {name} {dtype}{shape} has data_offsets "
            f"[{begin}, {end}] ({expected} bytes expected, {data_bytes} of data)",
        )


def open_safetensors_files(directory: Path) -> list[SafetensorsFile]:
    """The checkpoint's files: those ``model.safetensors.index.json`` names, else every ``*.safetensors``."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelFormatError(index, f"cannot parse the index (needs a weight_map object): {e}") from e
        for name in names:
            if not (directory / name).is_file():
                raise ModelFormatError(index, f"names shard {name}, which is missing")
        paths = [directory / name for name in names]
    else:
        paths = sorted(directory.glob("*.safetensors"))
        if not paths:
            raise ModelFormatError(directory, "no *.safetensors files")
    return [read_safetensors_header(p) for p in paths]


# --- names, shapes, fix-ups ------------------------------------------------------------------------------


def text_prefix(raw: dict[str, SafetensorsFile], directory: Path) -> str:
    for prefix in TEXT_PREFIXES:
        if f"{prefix}embed_tokens.weight" in raw:
            return prefix
    tried = ", ".join(f"{p}embed_tokens.weight" for p in TEXT_PREFIXES)
    raise ModelFormatError(where(directory), f"missing tensor: no embedding table (looked for {tried})")


def hf_names(config: ModelConfig, prefix: str) -> dict[str, str]:
    """GGUF name -> HF name of every tensor the text model needs (``output.weight`` not included)."""
    names = {
        "token_embd.weight": f"{prefix}embed_tokens.weight",
        "output_norm.weight": f"{prefix}norm.weight",
    }
    for i in range(config.n_layers):
        for hf, gg in LAYER_NAMES.items():
            names[f"blk.{i}.{gg}.weight"] = f"{prefix}layers.{i}.{hf}.weight"
    return names


def canonical_tensors(
    raw: dict[str, SafetensorsFile], config: ModelConfig, directory: Path
) -> dict[str, WeightTensor]:
    """The text model's tensors under GGUF names, shape-checked; vision and unknown tensors are ignored."""
    prefix = text_prefix(raw, directory)
    key = config.source_keys.get("n_layers", "num_hidden_layers")
    check_layer_count(where(directory), key, config.n_layers, layer_indices(raw, f"{prefix}layers."))
    names = hf_names(config, prefix)
    head = next((n for n in LM_HEAD_NAMES if n in raw), None)
    if head is not None and not config.tied_embeddings:
        names["output.weight"] = head
    elif not config.tied_embeddings:
        raise ModelFormatError(where(directory), "missing tensor lm_head.weight (tie_word_embeddings false)")
    missing = [hf for hf in names.values() if hf not in raw]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFormatError(where(directory), f"missing tensors: {', '.join(missing[:3])}{more}")
    tensors = {}
    for gg, hf in names.items():
        t = raw[hf].tensor(hf, gg)
        problem = shape_problem(config, gg, t.shape, config.source_keys, hf, " in config.json")
        if problem:
            raise ModelFormatError(t.source, problem)
        tensors[gg] = t
    return tensors


def sanitize(tensors: dict[str, WeightTensor], config: ModelConfig) -> dict[str, WeightTensor]:
    """HF -> GGUF conventions: norm weights become ``1 + w`` in float32; a tied output head is dropped."""
    out = {}
    for name, t in tensors.items():
        kind = name.split(".")[-2]
        if kind in NORM_NAMES or name == "output_norm.weight":
            w = np.asarray(as_float32(t) + np.float32(1.0), dtype=np.float32)
            t = WeightTensor(name, QType.F32, t.shape, w, t.source)
        elif name == "output.weight" and config.tied_embeddings:
            continue
        out[name] = t
    return out


def as_float32(t: WeightTensor) -> np.ndarray:
    """A new float32 array of a plain (F32/F16/BF16) tensor; bf16 bits are the top half of a float32."""
    if t.qtype == QType.BF16:
        return (t.data.astype(np.uint32) << 16).view(np.float32)
    return t.data.astype(np.float32)


def where(directory: Path) -> Path:
    """The file to name in an error about the checkpoint's tensors as a whole."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return index
    files = sorted(directory.glob("*.safetensors"))
    return files[0] if len(files) == 1 else directory
