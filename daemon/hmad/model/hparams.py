"""Hyper-parameter checks: one set of rules for GGUF metadata and HF config.json, run before anything is
sized by them.

A loader gathers what its file states as ``{ModelConfig field: (the file's key, the value)}`` and calls
:func:`check_hparams` *before* it builds the :class:`ModelConfig` (whose ``layer_is_global`` list, the tensor
name lists and the KV pools are all sized by these numbers). Once the tensors are listed,
:func:`check_layer_count` and :func:`shape_problem` hold the config against them: the layer count must be the
number of layer groups present, and every tensor's shape must be the one the numbers imply. So a value that
passes is both within sane bounds and agrees with the weights that are really in the file.

Every failure is a :class:`ModelFormatError` naming the file, the key and the value. Never a traceback,
never a model that loads and then fails every request.

The bounds (:data:`INT_BOUNDS`, :data:`FLOAT_BOUNDS`) are far above any released model (Gemma 3 27B:
62 layers, d_model 5376, 32 heads of 128, FFN 21504, vocab 262144, context 131072; Llama 3 405B: 126
layers, d_model 16384, 128 heads, FFN 53248), and low enough that nothing sized by them can run away
before the tensors are checked. README ("Model files") lists them for users.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from hmad.core.errors import ModelFormatError

#: field -> (least, greatest) allowed integer
INT_BOUNDS: dict[str, tuple[int, int]] = {
    "n_layers": (1, 1024),
    "d_model": (1, 1 << 16),
    "n_heads": (1, 1024),
    "n_kv_heads": (1, 1024),
    "head_dim": (2, 1024),  # RoPE rotates pairs of values
    "d_ff": (1, 1 << 18),
    "vocab_size": (1, 1 << 24),  # the GGUF reader's array-length limit
    "context_length": (16, 1 << 24),  # room for <bos>, a short prompt and an answer; the daemon's own limit
    "sliding_window": (1, 1 << 24),
    "sliding_window_pattern": (1, 1024),
}
#: field -> (greatest value refused at the low end, greatest allowed): finite, lo < x <= hi
FLOAT_BOUNDS: dict[str, tuple[float, float]] = {
    "rms_eps": (0.0, 1.0),
    "rope_base_global": (1.0, math.inf),  # frequencies base^(-2i/Dh) must fall with i
    "rope_base_local": (1.0, math.inf),
    "rope_scale_global": (0.0, math.inf),  # positions are divided by it
    "query_pre_attn_scalar": (0.0, math.inf),  # attention scale 1/sqrt(it)
}
TOKEN_FIELDS = ("bos_id", "eos_ids")  # ids that must be in the vocabulary

Stated = dict[str, tuple[str, Any]]  # ModelConfig field -> (the file's key, its value)


def check_hparams(path: str | Path, stated: Stated) -> dict[str, Any]:
    """The stated values, type- and bounds-checked, then checked against each other.

    Returns ``{field: value}`` (ints as ``int``, floats as ``float``, ``eos_ids`` as a list of ints) ready
    for ModelConfig; raises ModelFormatError naming the key and the value.
    """
    out = {field: _checked(path, field, key, value) for field, (key, value) in stated.items()}
    for check in RELATIONS:
        check(path, stated, out)
    return out


def _checked(path: str | Path, field: str, key: str, value: Any) -> Any:
    if field in INT_BOUNDS:
        return _checked_int(path, key, value, *INT_BOUNDS[field])
    if field in FLOAT_BOUNDS:
        return _checked_float(path, key, value, *FLOAT_BOUNDS[field])
    if field == "eos_ids":
        values = value if isinstance(value, list | tuple | np.ndarray) else [value]
        if not 1 <= len(values) <= 64:
            raise ModelFormatError(path, f"{key} = {value!r}: expected one to 64 token ids")
        return [_checked_int(path, key, v, 0, (1 << 31) - 1) for v in values]
    if field == "bos_id":
        return _checked_int(path, key, value, 0, (1 << 31) - 1)
    if field == "v_head_dim":
        return _checked_int(path, key, value, *INT_BOUNDS["head_dim"])
    raise AssertionError(f"no rule for hyper-parameter {field!r}")


def _checked_int(path: str | Path, key: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, np.integer):
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelFormatError(path, f"{key} = {value!r} is not an integer")
    if not lo <= value <= hi:
        raise ModelFormatError(path, f"{key} = {value} is out of range: must be {lo}..{hi}")
    return value


def _checked_float(path: str | Path, key: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, np.integer | np.floating):
        value = value.item()
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ModelFormatError(path, f"{key} = {value!r} is not a number")
    x = float(value)
    if not (math.isfinite(x) and lo < x <= hi):
        bound = f"more than {lo:g}" + ("" if hi == math.inf else f" and at most {hi:g}")
        raise ModelFormatError(path, f"{key} = {value!r} is out of range: must be finite and {bound}")
    return x


# --- relations between values ------------------------------------------------------------------------


def _say(stated: Stated, field: str, value: Any) -> str:
    return f"{stated[field][0]} = {value}"


def heads_share_kv_heads(path: str | Path, stated: Stated, v: dict[str, Any]) -> None:
    """Grouped-query attention: every KV head serves the same number of query heads."""
    if "n_heads" in v and "n_kv_heads" in v and v["n_heads"] % v["n_kv_heads"]:
        raise ModelFormatError(
            path,
            f"{_say(stated, 'n_kv_heads', v['n_kv_heads'])} does not divide "
            f"{_say(stated, 'n_heads', v['n_heads'])}",
        )


def window_fits_context(path: str | Path, stated: Stated, v: dict[str, Any]) -> None:
    """A sliding window longer than the context means nothing (and would size the local KV ring)."""
    if "sliding_window" in v and "context_length" in v and v["sliding_window"] > v["context_length"]:
        raise ModelFormatError(
            path,
            f"{_say(stated, 'sliding_window', v['sliding_window'])} is longer than the context "
            f"({_say(stated, 'context_length', v['context_length'])})",
        )


def value_heads_match(path: str | Path, stated: Stated, v: dict[str, Any]) -> None:
    """Values have the keys' head size (the forward pass has one head_dim)."""
    if "v_head_dim" in v and "head_dim" in v and v["v_head_dim"] != v["head_dim"]:
        raise ModelFormatError(
            path,
            f"{_say(stated, 'v_head_dim', v['v_head_dim'])} differs from "
            f"{_say(stated, 'head_dim', v['head_dim'])}; only equal key and value head sizes are supported",
        )


def token_ids_in_vocab(path: str | Path, stated: Stated, v: dict[str, Any]) -> None:
    """BOS and EOS are tokens of the vocabulary."""
    n = v.get("vocab_size")
    if n is None:
        return
    for field in TOKEN_FIELDS:
        ids = v.get(field)
        for tid in [] if ids is None else ids if isinstance(ids, list) else [ids]:
            if tid >= n:
                raise ModelFormatError(
                    path, f"{_say(stated, field, tid)} is not a token id: {_say(stated, 'vocab_size', n)}"
                )


RELATIONS = (heads_share_kv_heads, window_fits_context, value_heads_match, token_ids_in_vocab)


# --- against the tensors -----------------------------------------------------------------------------


def check_layer_count(path: str | Path, key: str, n_layers: int, indices: Iterable[str]) -> None:
    """The layer groups present (``indices``: the N of each ``blk.N.`` / ``layers.N.`` name) are exactly
    0 .. n_layers-1."""
    present = {int(i) for i in indices if i.isdigit()}
    if present != set(range(n_layers)):
        shown = _ranges(sorted(present)) or "none"
        raise ModelFormatError(path, f"{key} = {n_layers}, but the file holds tensors of layers {shown}")


def layer_indices(names: Iterable[str], stem: str) -> set[str]:
    """The layer numbers of tensor names starting with ``stem`` (``blk.``, ``model.layers.``)."""
    pattern = re.compile(re.escape(stem) + r"(\d+)\.")
    return {m.group(1) for m in map(pattern.match, names) if m}


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts: list[tuple[int, int]] = []
    for x in xs:
        if parts and parts[-1][1] == x - 1:
            parts[-1] = (parts[-1][0], x)
        else:
            parts.append((x, x))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


#: tensor kind (GGUF name without ``blk.N.`` and ``.weight``) -> the fields its shape is made of
SHAPE_FIELDS: dict[str, tuple[str, ...]] = {
    "attn_norm": ("d_model",),
    "post_attention_norm": ("d_model",),
    "ffn_norm": ("d_model",),
    "post_ffw_norm": ("d_model",),
    "output_norm": ("d_model",),
    "attn_q": ("n_heads", "head_dim", "d_model"),
    "attn_k": ("n_kv_heads", "head_dim", "d_model"),
    "attn_v": ("n_kv_heads", "head_dim", "d_model"),
    "attn_output": ("d_model", "n_heads", "head_dim"),
    "attn_q_norm": ("head_dim",),
    "attn_k_norm": ("head_dim",),
    "ffn_gate": ("d_ff", "d_model"),
    "ffn_up": ("d_ff", "d_model"),
    "ffn_down": ("d_model", "d_ff"),
    "token_embd": ("vocab_size", "d_model"),
    "output": ("vocab_size", "d_model"),
}


def expected_shapes(c: Any) -> dict[str, tuple[int, ...]]:
    """Tensor kind -> numpy shape (out, in) that the config ``c`` (a ModelConfig) implies."""
    D, F = c.d_model, c.d_ff
    return {
        "attn_norm": (D,),
        "post_attention_norm": (D,),
        "ffn_norm": (D,),
        "post_ffw_norm": (D,),
        "attn_q": (c.q_dim, D),
        "attn_k": (c.kv_dim, D),
        "attn_v": (c.kv_dim, D),
        "attn_q_norm": (c.head_dim,),
        "attn_k_norm": (c.head_dim,),
        "attn_output": (D, c.q_dim),
        "ffn_gate": (F, D),
        "ffn_up": (F, D),
        "ffn_down": (D, F),
        "token_embd": (c.vocab_size, D),
        "output_norm": (D,),
        "output": (c.vocab_size, D),
    }


def tensor_kind(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``attn_q``; ``token_embd.weight`` -> ``token_embd``."""
    return name.removesuffix(".weight").split(".")[-1]


def shape_problem(
    c: Any, name: str, shape: tuple[int, ...], keys: dict[str, str], shown: str | None = None, where: str = ""
) -> str | None:
    """Why tensor ``name`` (GGUF naming; ``shown`` in the message, default ``name``) of ``shape`` disagrees
    with the config ``c``, naming the keys (stated ``where``) whose values imply the expected shape; None
    when it agrees (or the tensor is not one the model uses)."""
    kind = tensor_kind(name)
    want = expected_shapes(c).get(kind)
    if want is None or tuple(shape) == want:
        return None
    implied = ", ".join(f"{keys.get(f, f)} = {getattr(c, f)}" for f in SHAPE_FIELDS[kind])
    return f"tensor {shown or name} has shape {list(shape)}, but {implied}{where} imply {list(want)}"
