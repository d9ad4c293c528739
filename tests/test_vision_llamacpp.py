"""Images against llama.cpp's multimodal path (mtmd): the embedded Gemma 3 270M with a small synthetic
projector GGUF (tests/synthetic_mmproj.py, the fixture's seed), the fixture made by
tests/fixtures/make_llamacpp_vision_reference.py (llama-cpp-python 0.3.36).

- The soft tokens: ours (the numpy encoder on our preprocessing of the same PNG, as big as the tower's input)
  against llama.cpp's (its clip encoder, float16 weights and activations rounded to float16 in its
  matmuls): within 0.2 % of their largest magnitude (seen: 0.04 %).
- Teacher-forced, as fidelity is judged here: fed llama.cpp's prompt (its own layout: ``<start_of_image>``,
  the soft tokens, ``<end_of_image>``) and its greedy tokens, our argmax equals its token wherever its own
  top-2 margin is >= 0.5, on the numpy backend with llama.cpp's roundings (numerics ggml).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from synthetic_mmproj import write_mmproj
from test_vision_model import logits_in_chunks

from hmad.engine.images import ImageSpan
from hmad.model.images import ImageLimits, prepare_image

REF = np.load(Path(__file__).parent / "fixtures" / "llamacpp_vision.npz")
TOWER = dict(image_size=224, patch_size=14, hidden=64, n_layers=2, n_heads=4, ffn=128)
MARGIN = 0.5


@pytest.fixture(scope="module")
def vlm(embedded_model_path, tmp_path_factory):
    from hmad.composition import load_model

    mmproj = write_mmproj(tmp_path_factory.mktemp("mmproj") / "mmproj.gguf", 640, int(REF["seed"]), TOWER)
    return load_model(embedded_model_path, "cpu", mmproj=mmproj)


def features(vlm) -> np.ndarray:
    cfg = vlm.vision.cfg
    png = REF["image_png"].tobytes()
    im = prepare_image(png, cfg.image_size, cfg.image_mean, cfg.image_std, ImageLimits())
    return vlm.encode_images(im.pixels[None])[0]  # (N, 640)


def prompt_of(layout: np.ndarray, soft: np.ndarray) -> tuple[list[int], list[ImageSpan]]:
    """llama.cpp's chunks as our ids (a placeholder 0 for each soft token) and spans holding ``soft``."""
    ids, spans, k = [], [], 0
    for t in layout.tolist():
        if t >= 0:
            ids.append(t)
            continue
        spans.append(ImageSpan(len(ids), -t, f"{len(spans):064x}", features=soft[k : k - t]))
        ids += [0] * -t
        k -= t
    return ids, spans


@pytest.mark.parametrize("name", ["one", "two"])
def test_soft_tokens_match_llamacpp(vlm, name):
    ours, ref = features(vlm), REF[f"soft_{name}"]
    n = ours.shape[0]
    for k in range(ref.shape[0] // n):
        err = np.abs(ours - ref[k * n : (k + 1) * n]).max()
        assert err <= 2e-3 * np.abs(ref).max(), f"image {k}: {err}"


@pytest.mark.parametrize("name", ["one", "two"])
def test_teacher_forced_tokens_match_llamacpp(vlm, name):
    soft = np.concatenate([features(vlm)] * (-REF[f"layout_{name}"][REF[f"layout_{name}"] < 0]).size)
    ids, spans = prompt_of(REF[f"layout_{name}"], soft)
    want, margins = REF[f"tokens_{name}"].tolist(), REF[f"margins_{name}"]
    logits = logits_in_chunks(vlm, ids + want[:-1], spans, 512)[len(ids) - 1 :]
    ours = logits.argmax(-1).tolist()
    sure = margins >= MARGIN
    assert sure.sum() >= len(want) // 2, "too few confident positions to judge"
    bad = [(i, ours[i], want[i], float(margins[i])) for i in np.flatnonzero(sure) if ours[i] != want[i]]
    assert not bad, f"(position, ours, llama.cpp's, its margin): {bad}"


def test_a_gguf_whose_image_tokens_are_user_defined_places_images_as_the_processor_does(vlm):
    """Gemma 3's GGUFs mark <start_of_image> user-defined, not control: the chat's image still becomes
    \\n\\n<start_of_image>, its soft tokens, <end_of_image>\\n\\n, as transformers' processor writes it."""
    from hmaclient import protocol as P
    from hmad.engine.sampling import SamplingParams
    from hmad.preparation import prepare

    image = {"type": "image", "image": REF["image_png"].tobytes()}
    content = [image, {"type": "text", "text": "What is it?"}]
    req = P.validate_request(P.generate_request(None, messages=[{"role": "user", "content": content}]))
    prepared = prepare(req, SamplingParams(), vlm, 1024)
    tok, ids, n = vlm.tokenizer, prepared.ids, vlm.vision.cfg.mm_tokens_per_image
    boi, eoi = tok.token_id("<start_of_image>"), tok.token_id("<end_of_image>")
    (span,) = prepared.images
    assert ids[span.start - 1] == boi and ids[span.end] == eoi and span.n == n
    assert ids.count(boi) == ids.count(eoi) == 1
    before, after = tok.decode(ids[: span.start - 1]), tok.decode(ids[span.end + 1 :])
    assert before.endswith("user\n\n\n") and after.startswith("\n\nWhat is it?"), (before, after)
