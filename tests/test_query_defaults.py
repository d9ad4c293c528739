"""hmactl's defaults fit the model (hmaclient.cli.fit): a base model (no chat template, status
``chat_template: false``) is prompted raw and hmactl says so on stderr, in query and chat; ``--raw`` and
``--chat-template`` force either way; without --max-tokens a model on a CPU answers at most
sampling.CPU_MAX_TOKENS tokens. An answer to --json-schema that is not a whole JSON value exits 1 and says so.

Against real hmad processes (daemon_harness.py) on two tiny GGUFs (tiny_gguf.py): one without a chat
template, one whose metadata holds Gemma 3's (tests/fixtures/chat_templates/gemma3_it.jinja). How a prompt
was sent is read from its prompt token count, against the same request sent directly.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_harness import Daemon
from gguf import GGUFValueType
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client, cli, sampling

TEMPLATE = (Path(__file__).parent / "fixtures" / "chat_templates" / "gemma3_it.jinja").read_text()
NOTE = "has no chat template (a base model)"


def _daemon(tmp_path_factory, name: str, **metadata) -> Daemon:
    path = make_tiny_gguf(tmp_path_factory.mktemp("model") / f"{name}.gguf", seed=5, types=MIXED, **metadata)
    return Daemon(path, tmp_path_factory.mktemp("hmad")).wait_ready()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = _daemon(tmp_path_factory, "base")
    yield d
    assert d.stop() == 0, d.log_text()


@pytest.fixture(scope="module")
def instruct(tmp_path_factory):
    d = _daemon(
        tmp_path_factory, "instruct", metadata={"tokenizer.chat_template": (TEMPLATE, GGUFValueType.STRING)}
    )
    yield d
    assert d.stop() == 0, d.log_text()


def hmactl(d: Daemon, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hmaclient.cli", "--socket", d.socket, *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120)


def query_json(d: Daemon, *args: str) -> tuple[dict, str]:
    p = hmactl(d, "query", "--json", "--temperature", "0", *args)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout), p.stderr


def prompt_tokens(d: Daemon, **request) -> int:
    with Client(d.socket) as c:
        return c.generate(max_tokens=1, **request).prompt_tokens


def test_status_says_whether_the_model_has_a_chat_template(base, instruct):
    with Client(base.socket) as c:
        assert c.status()["chat_template"] is False
    with Client(instruct.socket) as c:
        assert c.status()["chat_template"] is True


def test_a_base_model_is_queried_raw_and_briefly_on_a_cpu(base):
    """No flags: the prompt goes raw (as many tokens as "x b" alone), one line on stderr says so, and the
    answer stops at CPU_MAX_TOKENS (the tiny model never ends by itself: it repeats " b")."""
    obj, err = query_json(base, "x b")
    assert obj["prompt_tokens"] == prompt_tokens(base, prompt="x b", raw=True)
    assert obj["prompt_tokens"] < prompt_tokens(base, prompt="x b")
    assert (obj["generated_tokens"], obj["finish_reason"]) == (sampling.CPU_MAX_TOKENS, "length")
    [line] = err.splitlines()
    assert NOTE in line and "tiny-gemma3-seed5" in line and "--chat-template" in line
    obj, err = query_json(base, "--chat-template", "--max-tokens", "2", "x b")  # forced: the Gemma turns
    assert obj["prompt_tokens"] == prompt_tokens(base, prompt="x b") and err == ""
    assert obj["generated_tokens"] == 2
    obj, err = query_json(base, "--raw", "x b")  # raw by choice: nothing to say
    assert obj["prompt_tokens"] == prompt_tokens(base, prompt="x b", raw=True) and err == ""


def test_a_model_with_a_template_is_queried_through_it(instruct):
    obj, err = query_json(instruct, "--max-tokens", "2", "x b")
    assert obj["prompt_tokens"] == prompt_tokens(instruct, prompt="x b") and err == ""
    assert obj["prompt_tokens"] > prompt_tokens(instruct, prompt="x b", raw=True)
    obj, err = query_json(instruct, "--raw", "--max-tokens", "2", "x b")
    assert obj["prompt_tokens"] == prompt_tokens(instruct, prompt="x b", raw=True) and err == ""


def test_chat_takes_the_same_rule(base, instruct):
    """hmactl chat: the base model's conversation goes as plain text (with the note); the instruct model's
    as messages through its template (no note)."""
    p = hmactl(base, "chat", "--max-tokens", "2", stdin="x b\n")
    assert p.returncode == 0 and NOTE in p.stderr and "plain text" in p.stderr
    p = hmactl(instruct, "chat", "--max-tokens", "2", stdin="x b\n")
    assert p.returncode == 0 and NOTE not in p.stderr
    sent = instruct.log_text().splitlines()[-1]
    want = prompt_tokens(instruct, messages=[{"role": "user", "content": "x b"}])
    assert f", {want} prompt tokens)" in sent, sent


def test_an_image_takes_the_chat_template(base, tmp_path):
    """--image needs the template, so a base model's query with one is not made raw (the tiny model then
    refuses the image: it has no vision tower)."""
    (tmp_path / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(32))
    p = hmactl(base, "query", "--image", str(tmp_path / "a.png"), "what?")
    assert p.returncode == 1 and NOTE not in p.stderr and "vision" in p.stderr.lower()


def _args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(argv)


@pytest.mark.parametrize(
    ("info", "max_tokens"),
    [
        ({"backend": "cpu", "device": "numpy on 2 CPU cores"}, sampling.CPU_MAX_TOKENS),
        ({"backend": "vulkan", "device": "llvmpipe (LLVM 15.0.7, 256 bits)"}, sampling.CPU_MAX_TOKENS),
        ({"backend": "vulkan", "device": "AMD Radeon Graphics (RADV GFX1151)"}, None),  # the daemon's
        ({"backend": "npu", "device": "numpy on 16 CPU cores + NPU RyzenAI-npu5 (aie2p)"}, None),
        ({"state": "loading"}, None),
    ],
)
def test_max_tokens_by_where_the_model_runs(info, max_tokens):
    assert cli.fit(info, _args("query", "x"))[1] == max_tokens
    assert cli.fit(info, _args("query", "--max-tokens", "7", "x"))[1] == 7  # a flag wins


def test_the_template_rule():
    base, instruct, loading = {"chat_template": False, "model_name": "m"}, {"chat_template": True}, {}
    assert cli.fit(base, _args("query", "x"))[0] is True and NOTE in cli.fit(base, _args("query", "x"))[2]
    assert cli.fit(base, _args("query", "--chat-template", "x"))[:1] == (False,)
    assert cli.fit(base, _args("query", "--image", "a.png", "x"), images=True)[0] is False
    assert cli.fit(instruct, _args("query", "x"))[:1] == (False,)
    assert cli.fit(instruct, _args("chat", "--raw")) == (True, None, "")  # (no backend: not a CPU)
    assert cli.fit(loading, _args("query", "x"))[0] is False  # unknown: the template, as before
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["query", "--raw", "--chat-template", "x"])


def test_help_shows_the_cpu_default():
    query = cli.build_parser()._subparsers._group_actions[0].choices["query"]
    text = " ".join(query.format_help().split())
    want = f"--max-tokens N most tokens to generate ({sampling.CPU_MAX_TOKENS} when the model runs on a CPU);"
    assert f"{want} an integer from 1 to 1000000 (default: 512)" in text


@pytest.mark.parametrize("as_json", [False, True])
def test_json_schema_cut_by_max_tokens_exits_1(base, as_json):
    """The answer is printed as far as it got, then stderr says it is not a whole JSON value; a schema the
    answer finishes within max_tokens exits 0."""
    schema = '{"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}'
    q = ["query", "--raw", "--temperature", "0", "--json-schema", schema, *(["--json"] if as_json else [])]
    p = hmactl(base, *q, "--max-tokens", "3", "x")
    assert p.returncode == 1
    assert "not a whole JSON value for the schema: max_tokens ran out after 3 tokens" in p.stderr
    text = json.loads(p.stdout)["text"] if as_json else p.stdout
    assert text.startswith("{") and not text.rstrip().endswith("}")
    if as_json:
        assert json.loads(p.stdout)["schema_complete"] is False
    p = hmactl(base, *q, "--max-tokens", "40", "x")
    assert p.returncode == 0 and p.stderr == ""
    text = json.loads(p.stdout)["text"] if as_json else p.stdout
    assert isinstance(json.loads(text)["a"], bool)
