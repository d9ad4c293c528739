"""Gemma 3's vision tower (SigLIP) + multimodal projector: config and weights, from HF or from an mmproj GGUF.

Two sources, one result ``(VisionConfig, {canonical name: float32 array})``:

- ``read_hf_vision(directory)``: a Gemma3ForConditionalGeneration checkpoint (``config.json``'s
  ``vision_config`` + ``mm_tokens_per_image``, the vision tensors of its safetensors files, image mean/std
  from ``preprocessor_config.json`` when there is one);
- ``read_mmproj(path)``: llama.cpp's projector GGUF (``clip.*`` keys, ``clip.projector_type`` "gemma3").

Canonical names are llama.cpp's mmproj names (gguf-py constants ``MODEL_TENSOR.V_*``)::

    v.patch_embd.weight (D, 3, p, p)   v.patch_embd.bias (D,)   v.position_embd.weight (P, D)
    v.blk.{i}.ln1.weight/bias (D,)     v.blk.{i}.attn_{q,k,v,out}.weight (D, D), .bias (D,)
    v.blk.{i}.ln2.weight/bias (D,)     v.blk.{i}.ffn_up.weight (F, D), .bias (F,)
    v.blk.{i}.ffn_down.weight (D, F), .bias (D,)                v.post_ln.weight/bias (D,)
    mm.soft_emb_norm.weight (D,)       mm.input_projection.weight (D, E)

Shapes are numpy order (a GGUF's ``ne`` reversed), so both sources hold the same arrays: llama.cpp's
converter transposes nothing (the projection stays (D, E); its graph transposes it at run time). One value
differs between the sources and is made equal here: HF's ``mm_soft_emb_norm.weight`` is Gemma's RMSNorm
``w`` (the model multiplies by ``1 + w``); the converter stores ``1 + w``, and so does ``read_hf_vision``.
The converter's dtypes: patch and position embeddings F32, the projection F16, 1-D tensors F32, the other
matrices in the file type (F16/BF16/Q8_0/F32); every one is decoded to float32 here.

Every config value is checked (type, range, divisibility) before anything is sized by it, and every tensor's
shape is checked against the config before its data is read. Problems raise ``ModelFormatError`` naming
the file, and the tensor or key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hmad.core.errors import ModelFormatError
from hmad.model.gguf import read_gguf
from hmad.model.safetensors import TEXT_DEFAULTS, SafetensorsFile, as_float32, open_safetensors_files, where

#: SiglipVisionConfig's defaults (transformers), for keys a ``vision_config`` leaves out
SIGLIP_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
MM_TOKENS_DEFAULT = 256  # Gemma3Config.mm_tokens_per_image
GEMMA3_MEAN_STD = (0.5, 0.5, 0.5)  # Gemma3ImageProcessor's image_mean and image_std
GGUF_SCALE_DEFAULT = (
    4  # clip.cpp's pooling kernel for gemma3 when clip.vision.projector.scale_factor is absent
)

#: bounds far above any real vision tower (Gemma 3: 896 px, patch 14, width 1152, 27 layers, FFN 4304)
LIMITS = {
    "image_size": 8192,
    "patch_size": 1024,
    "hidden": 1 << 15,
    "n_layers": 1024,
    "n_heads": 1024,
    "ffn": 1 << 17,
    "mm_tokens_per_image": 1 << 16,
    "text_hidden": 1 << 16,
}

#: HF name (after the vision_tower / projector prefix) -> canonical name, per encoder layer ({i})
HF_LAYER = {
    "layer_norm1": "ln1",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_out",
    "layer_norm2": "ln2",
    "mlp.fc1": "ffn_up",
    "mlp.fc2": "ffn_down",
}
#: HF prefixes of the tower and the projector: the Hub's exports, then transformers 5's save_pretrained
HF_PREFIXES = ("", "model.")


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower and projector's hyperparameters; checked on construction (ValueError)."""

    image_size: int  # S: square input side, pixels
    patch_size: int  # p: conv kernel and stride
    hidden: int  # D: vision width
    n_layers: int
    n_heads: int
    ffn: int  # F: MLP width
    eps: float  # LayerNorm eps of the tower, and the projector's RMSNorm eps
    mm_tokens_per_image: int  # T: soft tokens per image (a square)
    text_hidden: int  # E: the language model's width
    image_mean: tuple[float, float, float] = GEMMA3_MEAN_STD
    image_std: tuple[float, float, float] = GEMMA3_MEAN_STD

    def __post_init__(self) -> None:
        for name, bound in LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= bound:
                raise ValueError(f"{name} = {value!r} must be an integer in [1, {bound}]")
        if not (isinstance(self.eps, float) and math.isfinite(self.eps) and 0 < self.eps < 1):
            raise ValueError(f"eps = {self.eps!r} must be a float in (0, 1)")
        for name in ("image_mean", "image_std"):
            v = getattr(self, name)
            if len(v) != 3 or not all(isinstance(x, float) and math.isfinite(x) for x in v):
                raise ValueError(f"{name} = {v!r} must be 3 finite floats")
        if min(self.image_std) <= 0:
            raise ValueError(f"image_std = {self.image_std!r} must be positive")
        self._check_geometry()

    def _check_geometry(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}"
            )
        if self.hidden % self.n_heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of n_heads {self.n_heads}")
        t = math.isqrt(self.mm_tokens_per_image)
        if t * t != self.mm_tokens_per_image:
            raise ValueError(f"mm_tokens_per_image {self.mm_tokens_per_image} is not a square")
        if self.patches_per_side % t:
            raise ValueError(
                f"mm_tokens_per_image {self.mm_tokens_per_image} ({t} per side) does not divide the "
                f"{self.patches_per_side} x {self.patches_per_side} patch grid"
            )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.patches_per_side**2

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)

    @property
    def pool(self) -> int:
        """The average-pooling kernel (and stride) over the patch grid."""
        return self.patches_per_side // self.tokens_per_side

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads


# --- canonical names and shapes ---------------------------------------------------------------------------


def expected_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> numpy shape of every tensor the tower and projector need."""
    D, F, p = cfg.hidden, cfg.ffn, cfg.patch_size
    shapes: dict[str, tuple[int, ...]] = {
        "v.patch_embd.weight": (D, 3, p, p),
        "v.patch_embd.bias": (D,),
        "v.position_embd.weight": (cfg.n_patches, D),
    }
    per_layer = {
        "ln1.weight": (D,),
        "ln1.bias": (D,),
        "ln2.weight": (D,),
        "ln2.bias": (D,),
        "ffn_up.weight": (F, D),
        "ffn_up.bias": (F,),
        "ffn_down.weight": (D, F),
        "ffn_down.bias": (D,),
    }
    for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
        per_layer[f"{proj}.weight"] = (D, D)
        per_layer[f"{proj}.bias"] = (D,)
    for i in range(cfg.n_layers):
        shapes.update({f"v.blk.{i}.{k}": s for k, s in per_layer.items()})
    shapes["v.post_ln.weight"] = (D,)
    shapes["v.post_ln.bias"] = (D,)
    shapes["mm.soft_emb_norm.weight"] = (D,)
    shapes["mm.input_projection.weight"] = (D, cfg.text_hidden)
    return shapes


def hf_names(n_layers: int, prefix: str = "") -> dict[str, str]:
    """Canonical name -> HF tensor name (``prefix`` "" for the Hub's exports, "model." for newer ones)."""
    tower = f"{prefix}vision_tower.vision_model."
    proj = f"{prefix}multi_modal_projector."
    names = {
        "v.patch_embd.weight": f"{tower}embeddings.patch_embedding.weight",
        "v.patch_embd.bias": f"{tower}embeddings.patch_embedding.bias",
        "v.position_embd.weight": f"{tower}embeddings.position_embedding.weight",
    }
    for i in range(n_layers):
        for hf, canon in HF_LAYER.items():
            for kind in ("weight", "bias"):
                names[f"v.blk.{i}.{canon}.{kind}"] = f"{tower}encoder.layers.{i}.{hf}.{kind}"
    names["v.post_ln.weight"] = f"{tower}post_layernorm.weight"
    names["v.post_ln.bias"] = f"{tower}post_layernorm.bias"
    names["mm.soft_emb_norm.weight"] = f"{proj}mm_soft_emb_norm.weight"
    names["mm.input_projection.weight"] = f"{proj}mm_input_projection_weight"
    return names


def shape_problem(
    name: str, shape: tuple[int, ...], cfg: VisionConfig, shown: str | None = None
) -> str | None:
    """None if ``shape`` is what ``cfg`` wants for canonical ``name``; else the message."""
    want = expected_shapes(cfg)[name]
    if tuple(shape) == want:
        return None
    label = name if shown is None else f"{shown} ({name})"
    return f"tensor {label} has shape {list(shape)}, expected {list(want)} from the vision config"


# --- HF config.json ---------------------------------------------------------------------------------------


def vision_config_from_hf(
    config: dict[str, Any], preprocessor: dict[str, Any] | None = None, path: str | Path = "config.json"
) -> VisionConfig | None:
    """A ``config.json`` dict -> VisionConfig; None for a text-only config (no ``vision_config`` object).

    Absent vision keys take SiglipVisionConfig's defaults, an absent ``mm_tokens_per_image`` Gemma3Config's
    (256). ``preprocessor`` (``preprocessor_config.json``) gives image_mean/std, else Gemma 3's 0.5s.
    Raises ModelFormatError naming ``path`` and the key for a value that is unsupported or inconsistent.
    """
    vc = config.get("vision_config") if isinstance(config, dict) else None
    if vc is None:
        return None
    if not isinstance(vc, dict):
        raise ModelFormatError(path, f"vision_config is {type(vc).__name__}, expected an object")
    if config.get("model_type") not in (None, "gemma3"):
        raise ModelFormatError(path, f"model_type {config.get('model_type')!r} is not gemma3")
    v = {**SIGLIP_DEFAULTS, **{k: x for k, x in vc.items() if x is not None}}
    if v["hidden_act"] != "gelu_pytorch_tanh":
        raise ModelFormatError(path, f"vision_config.hidden_act {v['hidden_act']!r} is not gelu_pytorch_tanh")
    if v["num_channels"] != 3:
        raise ModelFormatError(path, f"vision_config.num_channels {v['num_channels']!r} is not 3")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    mean, std = _mean_std(preprocessor or {}, path)
    return _make(
        path,
        image_size=_side(v["image_size"], "vision_config.image_size", path),
        patch_size=_side(v["patch_size"], "vision_config.patch_size", path),
        hidden=v["hidden_size"],
        n_layers=v["num_hidden_layers"],
        n_heads=v["num_attention_heads"],
        ffn=v["intermediate_size"],
        eps=_float(v["layer_norm_eps"], "vision_config.layer_norm_eps", path),
        mm_tokens_per_image=_or(config.get("mm_tokens_per_image"), MM_TOKENS_DEFAULT),
        text_hidden=_or(text.get("hidden_size"), TEXT_DEFAULTS["hidden_size"]),
        image_mean=mean,
        image_std=std,
    )


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _side(value: Any, key: str, path: str | Path) -> Any:
    """A square size stated as an int or as [n, n]."""
    if isinstance(value, list | tuple):
        if len(value) != 2 or value[0] != value[1]:
            raise ModelFormatError(path, f"{key} = {value!r}: only square images are supported")
        return value[0]
    return value


def _float(value: Any, key: str, path: str | Path) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelFormatError(path, f"{key} = {value!r} is not a number")
    return float(value)


def _mean_std(pre: dict[str, Any], path: str | Path) -> tuple[tuple[float, ...], tuple[float, ...]]:
    out = []
    for key in ("image_mean", "image_std"):
        v = pre.get(key, GEMMA3_MEAN_STD)
        if not isinstance(v, list | tuple | np.ndarray) or len(v) != 3:
            raise ModelFormatError(path, f"{key} = {v!r} is not 3 numbers")
        out.append(tuple(_float(x.item() if isinstance(x, np.generic) else x, key, path) for x in v))
    return out[0], out[1]


def _make(path: str | Path, **values: Any) -> VisionConfig:
    try:
        return VisionConfig(**values)
    except (ValueError, TypeError) as e:
        raise ModelFormatError(path, f"bad vision config: {e}") from e


# --- mmproj GGUF metadata ---------------------------------------------------------------------------------

#: VisionConfig field -> clip.* key
GGUF_KEYS = {
    "image_size": "clip.vision.image_size",
    "patch_size": "clip.vision.patch_size",
    "hidden": "clip.vision.embedding_length",
    "n_layers": "clip.vision.block_count",
    "n_heads": "clip.vision.attention.head_count",
    "ffn": "clip.vision.feed_forward_length",
    "text_hidden": "clip.vision.projection_dim",
}
EPS_KEY = "clip.vision.attention.layer_norm_epsilon"
SCALE_KEY = "clip.vision.projector.scale_factor"


def vision_config_from_gguf(meta: dict[str, Any], path: str | Path = "mmproj.gguf") -> VisionConfig:
    """An mmproj GGUF's metadata -> VisionConfig; ModelFormatError (naming ``path`` and the key) for a file
    that is not a gemma3 projector or states an inconsistent geometry.

    The soft-token count is not stored: clip.cpp pools the patch grid with a kernel of
    ``clip.vision.projector.scale_factor`` (4 when absent), so ``mm_tokens_per_image`` is
    ``(patches_per_side // scale) ** 2``.
    """
    kind = meta.get("clip.projector_type", meta.get("clip.vision.projector_type"))
    if kind != "gemma3":
        raise ModelFormatError(path, f"clip.projector_type is {kind!r}, not 'gemma3' (not a Gemma 3 mmproj)")
    if meta.get("clip.has_vision_encoder") is False:
        raise ModelFormatError(path, "clip.has_vision_encoder is false")
    v = {field: _gguf_int(meta, key, path) for field, key in GGUF_KEYS.items()}
    if EPS_KEY not in meta:
        raise ModelFormatError(path, f"missing metadata key {EPS_KEY!r}")
    scale = _gguf_int(meta, SCALE_KEY, path) if SCALE_KEY in meta else GGUF_SCALE_DEFAULT
    side = v["image_size"] // v["patch_size"] if v["patch_size"] > 0 else 0
    if scale < 1 or side < 1 or side % scale:
        raise ModelFormatError(
            path, f"{SCALE_KEY} = {scale} does not divide the {side}-patch side (image_size / patch_size)"
        )
    mean, std = _mean_std(
        {k: meta[f"clip.vision.{k}"] for k in ("image_mean", "image_std") if f"clip.vision.{k}" in meta}, path
    )
    return _make(
        path,
        **v,
        eps=_float(meta[EPS_KEY], EPS_KEY, path),
        mm_tokens_per_image=(side // scale) ** 2,
        image_mean=mean,
        image_std=std,
    )


def _gguf_int(meta: dict[str, Any], key: str, path: str | Path) -> int:
    if key not in meta:
        raise ModelFormatError(path, f"missing metadata key {key!r}")
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFormatError(path, f"metadata {key!r} = {value!r} is not an integer")
    return value


# --- readers ----------------------------------------------------------------------------------------------


def read_hf_vision(directory: str | Path) -> tuple[VisionConfig, dict[str, np.ndarray]]:
    """The vision tower and projector of an HF Gemma3ForConditionalGeneration checkpoint, float32.

    ModelFormatError for a text-only checkpoint, a missing tensor (its HF name), a tensor of the wrong shape
    or an unsupported dtype (the file and the tensor).
    """
    directory = Path(directory)
    path = directory / "config.json"
    cfg = vision_config_from_hf(
        read_json(path, required=True), read_json(directory / "preprocessor_config.json"), path
    )
    if cfg is None:
        raise ModelFormatError(path, "no vision_config: a text-only checkpoint has no vision tower")
    files = open_safetensors_files(directory)
    raw = {name: f for f in files for name in f.entries}
    names = hf_names(cfg.n_layers, _hf_prefix(raw))
    _check_hf_tensors(raw, names, cfg, directory)
    tensors = {canon: as_float32(raw[hf].tensor(hf, canon)) for canon, hf in names.items()}
    tensors["mm.soft_emb_norm.weight"] = tensors["mm.soft_emb_norm.weight"] + np.float32(1.0)
    return cfg, tensors


def read_json(path: Path, required: bool = False) -> dict[str, Any] | None:
    """A checkpoint's JSON object (config.json, preprocessor_config.json); None when absent and not
    ``required``; ModelFormatError naming the file otherwise."""
    if not path.is_file():
        if required:
            raise ModelFormatError(path, "missing (not an HF checkpoint directory?)")
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(path, f"cannot parse: {e}") from e
    if not isinstance(value, dict):
        raise ModelFormatError(path, "not a JSON object")
    return value


def _hf_prefix(raw: dict[str, SafetensorsFile]) -> str:
    for prefix in HF_PREFIXES:
        if f"{prefix}vision_tower.vision_model.embeddings.patch_embedding.weight" in raw:
            return prefix
    return HF_PREFIXES[0]  # reported as missing by the caller


def _check_hf_tensors(
    raw: dict[str, SafetensorsFile], names: dict[str, str], cfg: VisionConfig, directory: Path
) -> None:
    """Every tensor present, of the right shape (from the header, before any data is read), no extra layer."""
    missing = [hf for hf in names.values() if hf not in raw]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFormatError(where(directory), f"missing vision tensors: {', '.join(missing[:3])}{more}")
    for canon, hf in names.items():
        problem = shape_problem(canon, tuple(raw[hf].entries[hf]["shape"]), cfg, hf)
        if problem:
            raise ModelFormatError(raw[hf].path, problem + " (config.json's vision_config)")
    layer = f"{_hf_prefix(raw)}vision_tower.vision_model.encoder.layers.{cfg.n_layers}."
    extra = next((hf for hf in raw if hf.startswith(layer)), None)
    if extra is not None:
        raise ModelFormatError(
            raw[extra].path,
            f"has {extra}: more encoder layers than vision_config.num_hidden_layers = {cfg.n_layers}",
        )


def read_mmproj(path: str | Path) -> tuple[VisionConfig, dict[str, np.ndarray]]:
    """A llama.cpp mmproj GGUF (projector_type gemma3) -> (VisionConfig, canonical float32 tensors).

    Read with hmad's validating GGUF reader (``hmad.model.gguf``: bounded header, mmap'd data); tensors of
    any type it decodes (F32, F16, BF16, Q8_0, ...) become float32. ModelFormatError naming the file and
    the tensor for a missing one, a wrong shape or an undecodable one.
    """
    g = read_gguf(path)
    cfg = vision_config_from_gguf(g.metadata, g.path)
    shapes = expected_shapes(cfg)
    missing = [n for n in shapes if n not in g.tensors]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFormatError(g.path, f"missing tensors: {', '.join(missing[:3])}{more}")
    if f"v.blk.{cfg.n_layers}.ln1.weight" in g.tensors:
        raise ModelFormatError(
            g.path, f"has v.blk.{cfg.n_layers}.*: more layers than clip.vision.block_count"
        )
    out = {}
    for name in shapes:
        t = g.tensors[name]
        problem = shape_problem(name, t.shape, cfg)
        if problem:
            raise ModelFormatError(g.path, problem + " (the clip.vision.* metadata)")
        out[name] = np.ascontiguousarray(t.dequantize(), dtype=np.float32)
    return cfg, out
