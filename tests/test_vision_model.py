"""The tiny Gemma 3 VLM end to end on the numpy backend, against transformers' Gemma3ForConditionalGeneration
(tests/fixtures/hf_tiny_vlm_reference.npz, made by tests/fixtures/make_hf_vlm_reference.py).

The model is loaded as the daemon loads it (hmad.composition.load_model: text tower, vision tower, projector);
each prompt is computed in chunks that the engine's rule allows (never ending inside an image), the soft
tokens taken from our own encoder, the image rows seeing their whole image (engine/images.py). Logits of
every position must match transformers' with the image mask (``logits_{p}``) within 1e-4 of their scale
(float32 throughout; the fixture's run is float32 eager attention), and must differ from its plain causal
run (``logits_{p}_causal``), so the bidirectional rule is what is checked.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hf_tiny import BOI, EOI, IMAGE_TOKEN, make_tiny_hf_checkpoint

from hmad.composition import load_model
from hmad.core.batch import SeqSlice, StepBatch
from hmad.engine import images
from hmad.engine.images import ImageSpan
from hmad.engine.kvcache import KVCacheManager, KVLayout

REF = np.load(Path(__file__).parent / "fixtures" / "hf_tiny_vlm_reference.npz")
TOL = 1e-4


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    d = make_tiny_hf_checkpoint(
        tmp_path_factory.mktemp("vlm"), seed=int(REF["seed"]), multimodal=True, vision="real"
    )
    return load_model(d, "cpu", numerics="f32")  # (llama.cpp's roundings off: transformers' float32)


def spans_of(prompt: list[int], features: np.ndarray) -> list[ImageSpan]:
    """The image spans of a prompt whose soft tokens are already in place, each with its features."""
    starts = [i + 1 for i, t in enumerate(prompt) if t == BOI]
    out = []
    for k, s in enumerate(starts):
        n = prompt.index(EOI, s) - s
        assert all(t == IMAGE_TOKEN for t in prompt[s : s + n])
        out.append(ImageSpan(s, n, f"{k:064x}", features=features[k]))
    return out


def logits_in_chunks(model, prompt: list[int], spans: list[ImageSpan], chunk: int) -> np.ndarray:
    """Logits (T, V) of every position, the prompt fed in chunks of at most ``chunk`` cut by the engine's
    rule (images.chunk_end)."""
    n = len(prompt)
    layout = KVLayout.plan(model.config, max_tokens=n, max_seqs=1, max_chunk=n)
    model.backend.alloc_kv(layout)
    blocks = KVCacheManager(layout).reserve(0, n)
    out, pos = np.full((n, model.config.vocab_size), np.nan, np.float32), 0
    while pos < n:
        m = images.chunk_end(spans, pos, min(chunk, n - pos))
        assert m > 0
        s = SeqSlice(0, 0, m, pos, blocks.global_table, blocks.local_table)
        s.visible, s.embeds = images.visible(spans, pos, m), images.embeds(spans, pos, m)
        batch = StepBatch.build([(s, prompt[pos : pos + m], True)], layout.block_size)
        batch.logit_rows = np.arange(m, dtype=np.int32)
        out[pos : pos + m] = model.forward(batch)
        pos += m
    return out


def test_the_encoder_gives_transformers_soft_tokens(vlm):
    for k in (0, 1):
        ours = vlm.encode_images(REF[f"pixels_{k}"])
        ref = REF[f"features_{k}"]
        assert np.abs(ours - ref).max() <= TOL * np.abs(ref).max()


@pytest.mark.parametrize("name, chunk", [("a", 64), ("a", 7), ("b", 64), ("b", 9), ("b", 4)])
def test_text_and_image_logits_match_transformers(vlm, name, chunk):
    prompt = REF[f"prompt_{name}"].tolist()
    pixels = REF["pixels_0"][:1] if name == "a" else REF["pixels_1"]
    spans = spans_of(prompt, vlm.encode_images(pixels))
    ours = logits_in_chunks(vlm, prompt, spans, chunk)
    ref, causal = REF[f"logits_{name}"], REF[f"logits_{name}_causal"]
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= TOL * scale, f"chunk {chunk}"
    assert np.abs(causal - ref).max() > 100 * TOL * scale  # the image mask matters in this prompt


def test_a_text_only_checkpoint_has_no_vision_tower(tmp_path):
    model = load_model(make_tiny_hf_checkpoint(tmp_path / "t"), "cpu")
    assert model.vision is None
    with pytest.raises(ValueError, match="no vision tower"):
        model.encode_images(np.zeros((1, 3, 16, 16), np.float32))


def test_waiting_images_are_bounded_and_encoded_when_admitted(vlm):
    """Images are encoded when their request is admitted (so only running requests hold features); the
    pixels of waiting ones are bounded (engine/images.py, ``vision.max_waiting_image_bytes``)."""
    from hmad.engine.request import Request
    from hmad.engine.sampling import SamplingParams
    from hmad.engine.scheduler import QueueFull, Scheduler, SchedulerConfig

    sched = Scheduler(vlm, SchedulerConfig(max_seqs=1, kv_tokens=256))
    prompt = REF["prompt_a"].tolist()

    def request(i: int) -> Request:
        r = Request(i, prompt, SamplingParams(max_tokens=2, temperature=0))
        r.images = spans_of(prompt, np.zeros((1, 4, 64), np.float32))
        r.images[0].features, r.images[0].pixels = None, REF["pixels_0"][0] + i  # (3, 16, 16)
        r.images[0].digest = f"{i:064x}"
        return r

    sched.images.waiting_bytes = REF["pixels_0"][0].nbytes  # one image's pixels
    first = request(1)
    sched.submit(first)
    with pytest.raises(QueueFull, match="max_waiting_image_bytes"):
        sched.submit(request(2))
    assert first.images[0].features is None  # waiting: not encoded
    sched.step()  # admitted, encoded, prefilled
    assert first.images[0].pixels is None and first.images[0].features.shape == (4, 64)
    np.testing.assert_allclose(
        first.images[0].features, vlm.encode_images(REF["pixels_0"][:1] + 1)[0], rtol=1e-6
    )
    sched.submit(request(3))  # the pixels waiting are gone with the first's encoding
    while sched.has_work():
        sched.step()
