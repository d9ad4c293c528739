"""test_gateway_images.py's image tests again with a model that sees: the tiny Gemma 3 VLM (tests/hf_tiny.py,
a real vision tower) behind hmad and the gateway. hmad answers every image request here, so each API's
answer through the official client is a 200 whose text equals hmaclient's for the same images.
"""

from __future__ import annotations

import gateway_harness as harness
import pytest
from daemon_harness import Daemon
from hf_tiny import make_tiny_hf_checkpoint
from test_gateway_images import (  # noqa: F401 - the fixtures the imported tests take
    GREEDY,
    HMAD_MESSAGES,
    PNG,
    PNG2,
    _ref,
    claude,
    http,
    oai,
    olla,
    test_anthropic_image_block_equals_hmaclient,
    test_ollama_chat_and_generate_images_equal_hmaclient,
    test_openai_chat_image_url_equals_hmaclient,
    test_responses_input_image_equals_hmaclient,
)

gateway, hmad = harness.gateway, harness.hmad  # the module's fixtures, on this module's daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    vlm = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("vlm"), multimodal=True, vision="real")
    d = Daemon(vlm, tmp_path_factory.mktemp("hmad"), "engine.max_seqs=2", "sampling.max_tokens=8")
    yield d.wait_ready()
    assert d.stop() == 0, d.log_text()


@pytest.mark.parametrize(
    "request_",
    [
        {"messages": HMAD_MESSAGES},
        {"prompt": "what?", "images": [PNG, PNG2]},
    ],
    ids=["parts", "prompt+images"],
)
def test_the_vlm_answers_what_the_gateway_tests_ask(hmad, request_):
    """So the imported tests compare answers, not refusals."""
    ref = _ref(hmad.socket, **request_, **GREEDY)
    assert isinstance(ref, str), ref
