"""The HTTP APIs' ``model`` field honoured (hmad_openai.gateway.Gateway.model_for), through the ``openai``
package against a real gateway in front of a real hmad: a name hmad does not have is answered by the
loaded model as before; a model of hmad's store switches hmad to it, and the answer equals hmaclient's
for that model; Ollama's spelling (``hf.co/...``) of the loaded model switches nothing; with
models.allow_switch false the request is refused (400, switch_refused, naming the loaded model)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
from daemon_harness import Daemon
from fake_hub import FakeHub, FakeRepo
from gateway_harness import CLEAN_EXIT, Gateway
from gguf import GGMLQuantizationType as Q
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client

REPO = "tiny-org/tiny-gemma3-GGUF"
NAME = f"{REPO}:Q8_0"
ASK = [{"role": "user", "content": "the cat and the dog"}]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[Path, Path]:
    """A local model, and a store holding NAME (pulled by an hmad from the stand-in hub)."""
    root = tmp_path_factory.mktemp("switch-gw")
    local = make_tiny_gguf(root / "local.gguf", seed=1)
    pulled = make_tiny_gguf(root / "pulled.gguf", seed=5, types={k: Q.Q8_0 for k in MIXED}).read_bytes()
    models = root / "models"
    with FakeHub() as hub:
        hub.repos[REPO] = FakeRepo({"tiny-gemma3-Q8_0.gguf": pulled})
        (root / "puller").mkdir()
        d = Daemon(local, root / "puller", env={"HF_ENDPOINT": hub.url, "HMAD_MODELS_DIR": str(models)})
        try:
            with Client(d.wait_ready(60).socket, timeout=30) as c:
                pid = c.model_request("pull", NAME)["pull_id"]
                deadline = time.monotonic() + 30
                while c.status().get("pulls", {}).get(pid, {}).get("state") != "done":
                    assert time.monotonic() < deadline, c.status()
                    time.sleep(0.1)
        finally:
            assert d.stop() == 0, d.log_text()
    return local, models


def serve(tmp: Path, store, *sets: str) -> tuple[Daemon, Gateway]:
    local, models = store
    (tmp / "d").mkdir()
    d = Daemon(local, tmp / "d", *sets, "sampling.max_tokens=4", env={"HMAD_MODELS_DIR": str(models)})
    d.wait_ready(60)
    return d, Gateway(d.socket, tmp, "--api-key-file", str(_key(tmp)))


def _key(tmp: Path) -> Path:
    (tmp / "key").write_text("sk-switch\n")
    return tmp / "key"


def chat(g: Gateway, model: str):
    client = openai.OpenAI(base_url=g.url + "/v1", api_key="sk-switch", max_retries=0, timeout=60)
    return client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=4)


def test_the_model_field_switches_to_a_model_on_disk(tmp_path, store):
    d, g = serve(tmp_path, store)
    try:
        with Client(d.socket, timeout=60) as c:
            local_text = c.generate(messages=ASK, temperature=0, max_tokens=4).text
            r = chat(g, "gpt-4o")  # not hmad's: the loaded model answers, as before
            assert r.choices[0].message.content == local_text
            assert c.status()["model"] == str(store[0])
            r = chat(g, NAME)  # a model of hmad's store: hmad switches to it
            assert r.model == NAME
            st = c.status()
            assert st["switch"]["model"] == NAME and st["model"].endswith("tiny-gemma3-Q8_0.gguf")
            assert r.choices[0].message.content == c.generate(messages=ASK, temperature=0, max_tokens=4).text
            ollama = httpx.post(
                g.url + "/api/chat",
                json={"model": f"hf.co/{NAME.lower()}", "messages": ASK, "stream": False},
                headers={"Authorization": "Bearer sk-switch"},
                timeout=60,
            )
            assert ollama.status_code == 200, ollama.text
            assert c.status()["switch"]["id"] == st["switch"]["id"]  # already loaded: no switch
    finally:
        assert g.stop() in CLEAN_EXIT, g.log_path.read_text()
        assert d.stop() == 0, d.log_text()


def test_a_daemon_that_does_not_switch_refuses(tmp_path, store):
    d, g = serve(tmp_path, store, "models.allow_switch=false")
    try:
        with pytest.raises(openai.BadRequestError) as info:
            chat(g, NAME)
        assert info.value.code == "switch_refused" and str(store[0]) in info.value.message
        assert chat(g, "anything-else").choices[0].message.content is not None
    finally:
        assert g.stop() in CLEAN_EXIT, g.log_path.read_text()
        assert d.stop() == 0, d.log_text()
