"""Images through a real hmad on a real socket: the tiny Gemma 3 VLM (an HF checkpoint with a real vision
tower, tests/hf_tiny.py) on the numpy backend.

- a question about an image gets the tokens the offline path gives (hmad.preparation + engine.generate on
  the same model files), and a different image changes the answer's distribution;
- resending the same image encodes nothing new (the feature cache) and reuses the prompt's KV blocks,
  image tokens included (the prefix cache); another image with the same text reuses nothing past the text
  before it;
- bad images, too many images and an image for a text-only model get one error each, naming the problem,
  and the daemon answers the next request.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from daemon_harness import Daemon
from hf_tiny import make_tiny_hf_checkpoint
from PIL import Image
from tiny_gguf import make_tiny_gguf

from hmaclient import Client, RequestError
from hmaclient import protocol as P
from hmad.composition import load_model
from hmad.engine.generate import generate
from hmad.engine.sampling import SamplingParams
from hmad.preparation import prepare

RNG = np.random.default_rng()
TEXT = "what is the answer? the quick brown fox jumps over the lazy dog"


def png(seed: int, size=(20, 24)) -> bytes:
    """A random RGB PNG."""
    px = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(px).save(out, format="PNG")
    return out.getvalue()


def ask(image: bytes, **kw) -> dict:
    content = [{"type": "image", "image": image}, {"type": "text", "text": TEXT}]
    return dict(messages=[{"role": "user", "content": content}], **kw)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("vlm"), multimodal=True, vision="real")


@pytest.fixture(scope="module")
def daemon(vlm_dir, tmp_path_factory):
    d = Daemon(vlm_dir, tmp_path_factory.mktemp("hmad"), "vision.max_images_per_request=3").wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


def offline(vlm_dir, image: bytes, max_tokens: int, backend: str = "cpu") -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of the same request, prepared and generated in this process."""
    model = load_model(vlm_dir, backend)
    try:
        req = P.validate_request(P.generate_request(None, **ask(image, max_tokens=max_tokens, temperature=0)))
        prepared = prepare(req, SamplingParams(), model, model.config.context_length)
        res = generate(model, [prepared.ids], prepared.params, images=[prepared.images])[0]
    finally:
        model.backend.close()
    return prepared.ids, res.token_ids


def test_an_image_question_is_answered_as_offline(daemon, vlm_dir):
    image = png(1)
    ids, want = offline(vlm_dir, image, 8)
    with Client(daemon.socket) as c:
        got = c.generate(**ask(image, max_tokens=8, temperature=0))
    assert got.token_ids == want
    assert got.prompt_tokens == len(ids) and ids.count(509) == 4  # the tiny tower's 4 soft tokens


def test_another_image_changes_the_distribution(daemon):
    with Client(daemon.socket) as c:
        a, b = (c.generate(**ask(png(seed), max_tokens=1, temperature=0, logprobs=3)) for seed in (2, 3))
    assert [t[1] for t in a.logprobs[0].top] != [t[1] for t in b.logprobs[0].top]


def test_a_resent_image_is_neither_encoded_nor_prefilled_again(daemon):
    image, other = png(4), png(5)
    with Client(daemon.socket) as c:
        first = c.generate(**ask(image, max_tokens=2, temperature=0))
        before = _images_status(c.status())
        again = c.generate(**ask(image, max_tokens=2, temperature=0))
        after = _images_status(c.status())
        swapped = c.generate(**ask(other, max_tokens=2, temperature=0))
        metrics = {f["name"]: f["samples"][0]["value"] for f in c.metrics() if f["name"].startswith("image")}
    assert after["encoded"] == before["encoded"] and after["hits"] == before["hits"] + 1
    assert metrics["images_encoded"] == after["encoded"] + 1 and metrics["image_cache_hits"] == after["hits"]
    assert first.extra.get("cached_tokens", 0) == 0
    block = 16
    assert again.extra["cached_tokens"] == (first.prompt_tokens - 1) // block * block > 0
    assert again.token_ids == first.token_ids
    assert swapped.extra["cached_tokens"] < block  # only blocks before the image: none here


def _images_status(status: dict) -> dict:
    """The engine's ``images`` entry of a status reply, wherever the daemon nests it."""
    stack = [status]
    while stack:
        d = stack.pop()
        if "images" in d and isinstance(d["images"], dict) and "encoded" in d["images"]:
            return d["images"]
        stack += [v for v in d.values() if isinstance(v, dict)]
    raise AssertionError(f"no images entry in {status}")


@pytest.mark.parametrize(
    "data, words",
    [
        (b"\x89PNG\r\n\x1a\n" + bytes(40), "image 1"),  # a truncated PNG
        (png(6)[:-30], "image 1"),
    ],
)
def test_a_bad_image_is_refused_and_the_daemon_goes_on(daemon, data, words):
    with Client(daemon.socket) as c:
        with pytest.raises(RequestError) as e:
            c.generate(**ask(data, max_tokens=2))
        assert e.value.code == P.BAD_REQUEST and words in e.value.message
        assert c.generate(**ask(png(7), max_tokens=2)).generated_tokens >= 1


def test_more_images_than_the_config_allows_are_refused(daemon):
    content = [{"type": "image", "image": png(8 + k)} for k in range(4)] + [{"type": "text", "text": "hi"}]
    with Client(daemon.socket) as c, pytest.raises(RequestError) as e:
        c.generate(messages=[{"role": "user", "content": content}], max_tokens=2)
    assert e.value.code == P.BAD_REQUEST and "4 images" in e.value.message


def test_an_image_for_a_text_only_model_is_unsupported(tmp_path):
    path = make_tiny_gguf(tmp_path / "tiny.gguf", seed=3)
    d = Daemon(path, tmp_path).wait_ready()
    try:
        with Client(d.socket) as c:
            with pytest.raises(RequestError) as e:
                c.generate(**ask(png(1), max_tokens=2))
            assert e.value.code == P.UNSUPPORTED and "vision" in e.value.message
            assert c.generate("hello", raw=True, max_tokens=2).generated_tokens >= 1
    finally:
        assert d.stop() == 0, d.log_text()


@pytest.mark.gpu
def test_on_vulkan_images_are_encoded_and_answered_on_the_device(vlm_dir, tmp_path):
    """The tiny VLM on the Vulkan backend (lavapipe in CI): the encoder is the device's, and two requests
    with different images at once get the tokens each gets offline on the same backend."""
    from vk_harness import require_vulkan

    require_vulkan()
    images = [png(20), png(21)]
    want = [offline(vlm_dir, im, 6, backend="vulkan")[1] for im in images]
    d = Daemon(vlm_dir, tmp_path, backend="vulkan").wait_ready()
    try:
        with Client(d.socket) as c:
            streams = [c.stream(**ask(im, max_tokens=6, temperature=0)) for im in images]
            got = [[t for piece in st for t in piece.token_ids] for st in streams]
            vision = c.status()["vision"]
    finally:
        assert d.stop() == 0, d.log_text()
    assert got == want
    assert vision["encoder"] == "VulkanVisionOps" and vision["images"]["encoded"] == 2
