"""Model files -> what a model is before it is resident (``ModelFiles``), and the resident ``Model``.

Putting a model on a backend (choosing the backend, uploading) is composition, one floor up:
``hmad.composition.load_model``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hmad.backends.base import Backend
from hmad.core.batch import StepBatch
from hmad.core.errors import ModelFormatError, ModelNotFoundError
from hmad.core.model_config import ModelConfig
from hmad.core.tensors import WeightTensor
from hmad.model import chat_template
from hmad.model.default import DEFAULT_NAME, resolve_default
from hmad.model.hf_tokenizer import HFTokenizer
from hmad.model.hparams import check_layer_count, layer_indices, shape_problem
from hmad.model.registry import get_architecture
from hmad.model.tokenizer import SpmTokenizer, Tokenizer

log = logging.getLogger("hmad.model")


@dataclass
class ModelFiles:
    """What a model file or directory holds, before anything is resident."""

    path: str
    config: ModelConfig
    tensors: dict[str, WeightTensor]
    tokenizer: Tokenizer


@dataclass
class Model:
    """A model resident on a backend: config, tokenizer, the architecture's forward pass."""

    path: str
    config: ModelConfig
    tokenizer: Tokenizer
    backend: Backend
    net: Any  # the architecture object (e.g. Gemma3) with forward(batch) -> logits
    load_seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    vision: Any = None  # the vision tower (model/siglip.py), None for a text-only model

    def encode_images(self, pixels: np.ndarray) -> np.ndarray:
        """(n, 3, S, S) preprocessed images -> their soft tokens' embeddings (n, N, D) float32."""
        if self.vision is None:
            raise ValueError(f"this model ({self.path}) has no vision tower")
        return self.vision.ops.run(self.vision, pixels)

    def forward(self, batch: StepBatch) -> np.ndarray:
        """Logits (S_out, V) float32 for ``batch.logit_rows``."""
        return self.backend.to_numpy(self.backend.run(self.net, batch))

    def forward_argmax(self, batch: StepBatch) -> np.ndarray:
        """Greedy token id (S_out,) for ``batch.logit_rows``; on a GPU backend only the ids come back."""
        return self.backend.greedy(self.backend.run(self.net, batch))

    def launch_argmax(self, batch: StepBatch):
        """``forward_argmax`` started, not waited for: a handle for ``backend.collect`` (backends that are
        ``pipelined``)."""
        return self.backend.launch_greedy(self.backend.run(self.net, batch))

    def launch_sampled(self, batch: StepBatch):
        """As ``launch_argmax``, each row's token drawn on the device with ``batch.sampling`` (backends that
        ``sample_on_device``)."""
        return self.backend.launch_sampled(self.backend.run(self.net, batch))

    def forward_topk(self, batch: StepBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(ids, values) of the best ``backend.topk_max`` logits of each of ``batch.logit_rows``, each
        row's log-sum-exp and its logit of its ``batch.targets`` token (NaN: none), reduced on the device
        (only those come back: ``Backend.topk``, ``topk_targets``); backends with ``topk_max`` > 0."""
        x = self.backend.run(self.net, batch)
        return (*self.backend.topk(x), self.backend.topk_targets(x))


def resolve_model_path(spec: str | Path) -> Path:
    """``default`` -> the embedded model; otherwise an existing .gguf file or HF checkpoint directory."""
    if str(spec) == DEFAULT_NAME:
        return resolve_default()
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {str(spec)!r} not found (give 'default', a .gguf file or a "
            "checkpoint directory with config.json)"
        )
    return path


def read_model_files(path: Path) -> ModelFiles:
    """Parse a GGUF file or an HF checkpoint directory (memory-mapped; nothing copied)."""
    if path.is_dir():
        from hmad.model.safetensors import read_hf_checkpoint

        ck = read_hf_checkpoint(path)
        tok = _tokenizer(ck.tokenizer_path, lambda: HFTokenizer.from_file(ck.tokenizer_path))
        _attach_template(
            ck.tokenizer_path,
            tok,
            lambda: chat_template.from_hf_directory(Path(ck.tokenizer_path).parent, tok),
        )
        return ModelFiles(str(path), ck.config, ck.tensors, tok)
    from hmad.model.gguf import read_gguf

    gf = read_gguf(path)
    arch_name = gf.metadata.get("general.architecture")
    if not isinstance(arch_name, str):
        raise ModelFormatError(path, "missing metadata key 'general.architecture'")
    config = get_architecture(arch_name).config_from_gguf(gf.metadata, str(path))
    tok = _tokenizer(path, lambda: SpmTokenizer.from_gguf_metadata(gf.metadata))
    _attach_template(path, tok, lambda: chat_template.from_gguf_metadata(gf.metadata, tok))
    return ModelFiles(str(path), config, gf.tensors, tok)


def _tokenizer(path: Path | str, make: Callable[[], Tokenizer]) -> Tokenizer:
    """``make()``, with any failure to build the tokenizer from the file as a ModelFormatError."""
    try:
        return make()
    except ModelFormatError:
        raise
    except Exception as e:  # the tokenizer's own checks (a wrong tokenizer.ggml.model, a missing list...)
        raise ModelFormatError(path, f"cannot build the tokenizer: {type(e).__name__}: {e}") from e


def _attach_template(path: Path | str, tok: Tokenizer, read: Callable[[], Any]) -> None:
    """The file's own chat template (or None) on ``tok``; one that does not compile is a ModelFormatError."""
    try:
        tok.chat_template = read()
    except ModelFormatError:
        raise
    except Exception as e:  # ChatTemplateError: the template's own message names the key or file
        raise ModelFormatError(path, str(e)) from e


def check_tensors(files: ModelFiles) -> None:
    """The model's numbers agree with what the file holds: the layer groups present are exactly the stated
    layer count, every tensor the architecture needs is there with the shape the config implies, and the
    tokenizer's ids fit the embedding table. (HF checkpoints were checked the same way when they were read.)
    """
    cfg, keys = files.config, files.config.source_keys
    arch = get_architecture(cfg.arch)
    if not Path(files.path).is_dir():
        indices = layer_indices(files.tensors, "blk.")
        check_layer_count(files.path, keys.get("n_layers", "n_layers"), cfg.n_layers, indices)
    missing = [n for n in arch.tensor_names(cfg) if n not in files.tensors]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelFormatError(files.path, f"missing tensors: {', '.join(missing[:5])}{more}")
    for name in [*arch.tensor_names(cfg), "output.weight"]:
        t = files.tensors.get(name)
        problem = t is not None and shape_problem(cfg, name, t.shape, keys)
        if problem:
            raise ModelFormatError(files.path, problem)
    n_tok = files.tokenizer.vocab_size
    if n_tok > cfg.vocab_size:
        raise ModelFormatError(
            files.path,
            f"the tokenizer has {n_tok} tokens, more than the embedding's "
            f"{keys.get('vocab_size', 'vocab_size')} = {cfg.vocab_size}",
        )
