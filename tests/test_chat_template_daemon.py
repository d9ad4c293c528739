"""The `chat_template` setting through a real daemon: auto (the file's own), builtin (the Gemma turns), a
Jinja file; and a file that does not compile stops the start, naming it."""

from __future__ import annotations

from daemon_harness import Daemon
from test_chat_template import TEMPLATES, tiny_gguf_with

from hmaclient import Client
from hmad.model.chat import render_chat
from hmad.model.chat_template import ChatTemplate
from hmad.model.loader import read_model_files


def test_setting_picks_the_template(tmp_path):
    path = tiny_gguf_with(tmp_path / "probe.gguf", TEMPLATES["probe"])
    tok = read_model_files(path).tokenizer
    messages = [{"role": "user", "content": "hello  world "}]
    gemma = ChatTemplate(TEMPLATES["gemma3_it"], tok, "g")
    (tmp_path / "g.jinja").write_text(TEMPLATES["gemma3_it"])
    want = {
        "auto": len(tok.encode(render_chat(messages, template=tok.chat_template))),
        "builtin": len(tok.encode(render_chat(messages))),
        str(tmp_path / "g.jinja"): len(tok.encode(render_chat(messages, template=gemma))),
    }
    assert len(set(want.values())) == 3
    for setting, n in want.items():
        d = Daemon(path, tmp_path, f"chat_template={setting}").wait_ready()
        try:
            with Client(d.socket) as c:
                assert c.generate(messages=messages, max_tokens=1).prompt_tokens == n
        finally:
            assert d.stop() == 0, d.log_text()


def test_a_broken_template_file_fails_the_start(tmp_path):
    path = tiny_gguf_with(tmp_path / "probe.gguf", TEMPLATES["probe"])
    (tmp_path / "bad.jinja").write_text("{% if %}")
    d = Daemon(path, tmp_path, f"chat_template={tmp_path / 'bad.jinja'}")
    assert d.proc.wait(60) != 0
    assert "bad.jinja" in d.log_text() and "does not compile" in d.log_text()
