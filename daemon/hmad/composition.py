"""Composition: a model file put on a backend. The one floor that knows both the model and every backend.

model = load_model("default", "vulkan")       # or a GGUF path, an HF directory; backend auto/cpu/npu
drafter = attach_draft(scheduler, "default")  # a draft model for speculation, on a backend of its own
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hmad.backends.base import Backend
from hmad.core.errors import ModelFormatError
from hmad.engine.speculation.draft_model import DraftModelDrafter, check_vocabulary
from hmad.model.loader import Model, check_tensors, read_model_files, resolve_model_path
from hmad.model.registry import get_architecture
from hmad.model.siglip import VisionTower
from hmad.model.vision import read_hf_vision, read_json, read_mmproj, vision_config_from_hf
from hmad.model.vision_prompt import image_ids
from hmad.store.resolve import is_store_ref, resolve_model_ref

log = logging.getLogger("hmad.model")


def resolve_backend_name(name: str, npu: dict[str, Any] | None = None) -> str:
    """``auto`` -> ``vulkan`` when a Vulkan GPU is present (not a CPU driver: lavapipe), else ``npu`` when
    an NPU and the kernels for ``npu`` (config section npu) are installed, else ``cpu``."""
    if name != "auto":
        return name
    try:
        from hmad.backends.vulkan.device import Device

        with Device() as dev:
            if not dev.info.is_cpu:
                return "vulkan"
            log.info("backend auto: the Vulkan device is a CPU driver (%s)", dev.info.name)
    except Exception as e:  # no loader, no driver, no suitable device: the CPU backend serves
        log.info("backend auto: no usable Vulkan GPU (%s)", e)
    from hmad.backends.npu.status import probe

    usable, reason = probe(npu)
    if usable or (npu or {}).get("enabled") is True:  # true: the npu backend fails loudly if it cannot
        return "npu"
    log.info("backend auto: no usable NPU (%s); using cpu", reason)
    return "cpu"


def make_backend(name: str, **opts) -> Backend:
    """A backend by name: ``cpu``, ``vulkan``, ``npu``, or ``auto`` (see :func:`resolve_backend_name`)."""
    name = resolve_backend_name(name, opts if name == "auto" else None)
    if name == "cpu":
        from hmad.backends.cpu import CpuBackend

        return CpuBackend(**opts)
    if name == "vulkan":
        from hmad.backends.vulkan.backend import VulkanBackend

        return VulkanBackend(**opts)
    if name == "npu":
        from hmad.backends.npu.backend import NpuBackend

        return NpuBackend(**opts)
    raise ValueError(f"backend {name!r} is not available (allowed: cpu, vulkan, npu, auto)")


#: progress(message, done_bytes=None, total_bytes=None): what a load is doing; the byte counts while
#: weights are uploaded (a backend that can tell)
Progress = Callable[..., None]


def load_vision(path: Path, mmproj: str | Path | None, model: Model) -> VisionTower | None:
    """The vision tower of ``path`` (an HF checkpoint with one) or ``mmproj``, on ``model``'s backend; None
    for a text-only model. ModelFormatError when it does not fit the text model or its tokenizer."""
    if mmproj is not None:
        cfg, tensors = read_mmproj(Path(mmproj))
        origin = Path(mmproj)
    elif path.is_dir() and vision_config_from_hf(read_json(path / "config.json", required=True)) is not None:
        cfg, tensors = read_hf_vision(path)
        origin = path
    else:
        return None
    if cfg.text_hidden != model.config.d_model:
        raise ModelFormatError(
            origin,
            f"its projector gives {cfg.text_hidden}-wide soft tokens; the model's are {model.config.d_model}",
        )
    try:
        image_ids(model.tokenizer)
    except ValueError as e:
        raise ModelFormatError(origin, f"a vision tower needs image tokens: {e}") from None
    tower = VisionTower(cfg, tensors, model.backend.vision_ops())
    tower.ops.prepare(tower)
    return tower


def load_model(
    spec: str | Path,
    backend: str | Backend = "cpu",
    progress: Progress | None = None,
    background: bool = False,
    mmproj: str | Path | None = None,
    **backend_opts,
) -> Model:
    """Load a model and make its weights resident on ``backend``.

    ``spec`` is ``default``, a GGUF file, an HF checkpoint directory, or a model of the store
    (``hf:REPO[:QUANT]``, pulled first if absent, or a pulled model's name: hmad.store; its projector is
    the vision tower unless ``mmproj`` is given). Corrupt files raise ``ModelFormatError`` naming the file
    and the problem. ``model.info["load_phases_s"]`` says where the
    time went (read, device, upload: what ``hmactl status`` shows). ``background``: return while a GPU
    backend still uploads (the daemon records its steps meanwhile); ``backend.wait_resident()`` waits.
    The vision tower (image input) comes from an HF checkpoint that has one, or from ``mmproj``, llama.cpp's
    projector GGUF; a model without either is text only (``model.vision`` None).
    """
    if is_store_ref(spec):  # hf:REPO[:QUANT] (pulled on first use) or a pulled model's name
        spec, pulled_mmproj = resolve_model_ref(str(spec), progress)
        mmproj = pulled_mmproj if mmproj is None else mmproj
    t0 = time.perf_counter()
    phases: dict[str, float] = {}
    path = resolve_model_path(spec)
    note = progress or (lambda msg, *_: log.info("%s", msg))
    note(f"reading {path}")
    files = read_model_files(path)
    check_tensors(files)
    phases["read_s"] = time.perf_counter() - t0
    ops = backend if isinstance(backend, Backend) else make_backend(backend, **backend_opts)
    problem = ops.unsupported(files.config)
    if problem:
        if ops is not backend:
            ops.close()
        raise ModelFormatError(path, f"the {ops.name} backend cannot run this model: {problem}")
    phases["device_s"] = time.perf_counter() - t0 - sum(phases.values())
    note(f"uploading {len(files.tensors)} tensors to {ops.name}")
    weights = ops.load_weights(files.tensors, progress=note, background=background)
    net = get_architecture(files.config.arch).model_cls(files.config, weights, ops)
    phases["allocate_s" if background else "upload_s"] = time.perf_counter() - t0 - sum(phases.values())
    model = Model(str(path), files.config, files.tokenizer, ops, net, time.perf_counter() - t0)
    model.vision = load_vision(path, mmproj, model)
    model.info["load_phases_s"] = {k: round(v, 3) for k, v in phases.items()}
    if not background:
        note(f"model resident in {model.load_seconds:.1f} s")
    return model


def load_draft(spec: str | Path, target, **backend_opts):
    """The draft model ``spec`` resident on a new backend of ``target``'s kind (its own device handle, KV
    pools and recordings), its vocabulary checked against ``target``'s; closed again if it does not fit."""
    draft = load_model(spec, backend=target.backend.name, **backend_opts)
    try:
        check_vocabulary(target, draft)
    except BaseException:
        draft.backend.close()
        raise
    return draft


def attach_draft(scheduler, spec: str | Path, progress=None, **backend_opts) -> DraftModelDrafter:
    """The draft model ``spec`` loaded (``load_draft``), made ``scheduler``'s drafter, its steps made ready
    (recorded on a GPU) as the target's are (``Scheduler.prepare``)."""
    (progress or log.info)(f"loading the draft model {spec}")
    draft = load_draft(spec, scheduler.model, **backend_opts)
    try:
        drafter = DraftModelDrafter.attach(scheduler, draft)
        draft.backend.prepare(draft.net, scheduler.cfg.step_tokens, scheduler.cfg.max_seqs)
    except BaseException:
        draft.backend.close()
        raise
    return drafter
