"""hmactl chat against a real hmad on a real socket (daemon_harness.py), on a tiny random GGUF without a chat
template (a base model: tiny_gguf.py) and the tiny Gemma 3 VLM (hf_tiny.py) for /image.

What reaches the daemon is read from its log ("request N (id I, P prompt tokens) from uid U pid X"): each
message's prompt must be as many tokens as the conversation the test writes out itself (the turns so far,
the system prompt, the transcript of a base model) gives when sent directly. The chat runs as a subprocess
(its own pid in the log) with stdin a pipe: the non-terminal mode, one turn a line.
"""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from daemon_harness import Daemon
from hf_tiny import make_tiny_hf_checkpoint
from PIL import Image
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client, chat

SAMPLING = ["--temperature", "0"]


@pytest.fixture(scope="module")
def hmad(tmp_path_factory):
    path = make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5, types=MIXED)
    d = Daemon(path, tmp_path_factory.mktemp("hmad"), "engine.max_seqs=8").wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


def hmactl_chat(d: Daemon, *args: str, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hmaclient.cli", "--socket", d.socket, "chat", *args]
    return subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def converse(d: Daemon, text: str, *args: str) -> tuple[subprocess.CompletedProcess, list[int]]:
    """hmactl chat with ``text`` on stdin; (the finished process, its requests' prompt token counts)."""
    with hmactl_chat(d, *args) as p:
        out, err = p.communicate(text, timeout=120)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err), prompt_tokens(d, p.pid)


def prompt_tokens(d: Daemon, pid: int) -> list[int]:
    """The prompt token counts of the requests process ``pid`` made, in order, from the daemon's log."""
    found = re.findall(rf"request \d+ \(id \S+, (\d+) prompt tokens\) from uid \d+ pid {pid}\b", d.log_text())
    return [int(n) for n in found]


def sent_as(d: Daemon, **request) -> int:
    """The prompt tokens of one request sent directly."""
    with Client(d.socket) as c:
        return c.generate(max_tokens=1, **request).prompt_tokens


def greedy(d: Daemon, messages: list[dict], max_tokens: int) -> str:
    with Client(d.socket) as c:
        return c.generate(messages=messages, max_tokens=max_tokens, temperature=0).text


def test_turns_system_clear_and_save_through_a_pipe(hmad, tmp_path):
    """Several turns with the chat template; /system heads the conversation; /clear forgets the turns and
    keeps the system prompt; multi-line messages; /save writes the conversation as JSON; end of input
    leaves with 0."""
    first, last = tmp_path / "a.json", tmp_path / "b.json"
    script = (
        f"x b\n/system be brief\nx c\n/save {first}\n/clear\nx d\n"
        f'"""\nline one\nline two\n"""\nnext \\\nline\n/save {last}\n'
    )
    p, sent = converse(hmad, script, "--chat-template", "--max-tokens", "4", *SAMPLING)
    assert p.returncode == 0, p.stderr
    a = json.loads(first.read_text())
    assert a["model"] == "tiny-gemma3-seed5" and a["chat_template"] is True
    a = a["messages"]
    assert [(m["role"], m["content"]) for m in a if m["role"] != "assistant"] == [
        ("system", "be brief"),
        ("user", "x b"),
        ("user", "x c"),
    ]
    assert [m["role"] for m in a] == ["system", "user", "assistant", "user", "assistant"]
    # the answers kept are the greedy answers to the conversation before them
    assert a[2]["content"] == greedy(hmad, a[1:2], 4) and a[4]["content"] == greedy(hmad, a[:4], 4)
    b = json.loads(last.read_text())["messages"]
    assert [(m["role"], m["content"]) for m in b if m["role"] != "assistant"] == [
        ("system", "be brief"),
        ("user", "x d"),
        ("user", "line one\nline two"),
        ("user", "next \nline"),
    ]
    assert sent == [sent_as(hmad, messages=m) for m in (a[1:2], a[:4], b[:2], b[:4], b[:6])]
    shown = [m["content"] for m in [*a, *b] if m["role"] == "assistant"]
    assert p.stdout == "".join(t if t.endswith("\n") else t + "\n" for t in shown)  # each on its own line
    assert "system prompt set" in p.stderr and "conversation cleared" in p.stderr


def test_a_base_model_chats_in_plain_text_and_says_so(hmad, tmp_path):
    """Without a chat template the conversation goes as a "User:" / "Assistant:" transcript, raw, the answer
    kept without its leading space; one line on stderr says so."""
    saved = tmp_path / "raw.json"
    p, sent = converse(hmad, f"/system You are terse.\nx b\nx c\n/save {saved}\n", "--max-tokens", "3")
    assert p.returncode == 0, p.stderr
    notes = [line for line in p.stderr.splitlines() if "no chat template" in line]
    assert len(notes) == 1 and "tiny-gemma3-seed5" in notes[0] and "plain text" in notes[0]
    obj = json.loads(saved.read_text())
    assert obj["chat_template"] is False
    first = obj["messages"][2]["content"]
    assert [m["role"] for m in obj["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert p.stdout.splitlines()[0] == first and not first.startswith(" ")
    transcripts = [
        "You are terse.\n\nUser: x b\nAssistant:",
        f"You are terse.\n\nUser: x b\nAssistant: {first}\nUser: x c\nAssistant:",
    ]
    assert sent == [sent_as(hmad, prompt=t, raw=True) for t in transcripts]
    req = chat.Conversation(raw=True).request("hi", {"stop": ["X"]})
    assert (
        req["stop"] == ["X", "\nUser:"] and req["raw"] is True
    )  # the answer ends where the user's line starts


def test_commands_that_fail_leave_the_session_running(hmad, tmp_path):
    """/image on a base model, an unknown command, /save to a folder that is not there: a note each; the
    session goes on, and a message after them is answered ("//" sends a message that starts with "/")."""
    nowhere, saved = tmp_path / "no" / "x.json", tmp_path / "s.json"
    script = (
        f"/image {tmp_path / 'a.png'}\n/frobnicate\n/save {nowhere}\n/help\n//x b\n/save {saved}\n/bye\nx c\n"
    )
    p, sent = converse(hmad, script, "--max-tokens", "2")
    assert p.returncode == 0, p.stderr
    for says in [
        "images need the chat template",
        "unknown command /frobnicate",
        "cannot write",
        "/system TEXT",
    ]:
        assert says in p.stderr, p.stderr
    assert len(sent) == 1  # /x b; /bye left before x c
    assert json.loads(saved.read_text())["messages"][0] == {"role": "user", "content": "/x b"}


def test_a_failed_message_is_reported_dropped_and_exits_1(hmad, tmp_path):
    """A message the daemon refuses (over the context) gets its error on stderr and is not kept; the next one
    is answered without it; the exit status says a turn failed."""
    saved = tmp_path / "s.json"
    p, sent = converse(hmad, f"{'x ' * 5000}\nx b\n/save {saved}\n", "--max-tokens", "2")
    assert p.returncode == 1
    assert "error: prompt_too_long" in p.stderr and "/clear starts over" in p.stderr
    assert [m["content"] for m in json.loads(saved.read_text())["messages"]][:1] == ["x b"]


def _default_sigint() -> None:
    """SIGINT at its default, as a terminal starts hmactl (see test_hmactl's)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cancelled(d: Daemon) -> int:
    with Client(d.socket) as c:
        [fam] = [f for f in c.metrics() if f["name"] == "requests"]
    return sum(s["value"] for s in fam["samples"] if s["labels"]["outcome"] == "cancelled")


def test_sigint_cancels_the_answer_not_the_session(hmad, tmp_path):
    """SIGINT while an answer streams: the daemon cancels that request, the exchange is not kept, the next
    message is answered and end of input leaves with 0."""
    before, saved = _cancelled(hmad), tmp_path / "after.json"
    with hmactl_chat(hmad, "--max-tokens", "100000", preexec_fn=_default_sigint) as p:
        p.stdin.write("x b\n")
        p.stdin.flush()
        assert p.stdout.read(4) == "::::"  # streaming has begun (the tiny model repeats the ":" it ends on)
        p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        while _cancelled(hmad) == before:
            assert time.monotonic() < deadline, hmad.log_text()[-2000:]
            time.sleep(0.05)
        p.stdin.write(f"/save {saved}\n")
        p.stdin.close()
        assert p.wait(timeout=20) == 0
        err = p.stderr.read()
    assert "cancelled: the message and its partial answer are not kept" in err and "Traceback" not in err
    assert json.loads(saved.read_text())["messages"] == []
    with Client(hmad.socket) as c:
        st = c.status()
    assert (st["running"], st["queued"]) == (0, 0)


def test_sigint_while_waiting_for_piped_input_leaves_130(hmad):
    with hmactl_chat(hmad, preexec_fn=_default_sigint) as p:
        time.sleep(1.0)  # reading stdin by now (the pipe stays open)
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=20) == 130


@pytest.mark.parametrize(
    ("text", "turns"),
    [
        ("a\nb\n", ["a", "b"]),
        ("one \\\ntwo\\\nthree\nfour\n", ["one \ntwo\nthree", "four"]),
        ('"""\nfirst\n\n  second\n"""\nafter\n', ["first\n\n  second", "after"]),
        ('"""one line"""\n', ["one line"]),
        ('  """start\nend"""\n', ["start\nend"]),
        ('"""\nnever closed\n', ["never closed"]),  # end of input ends the block
        ("dangling \\\n", ["dangling "]),
        ("crlf\r\n", ["crlf"]),
    ],
)
def test_multi_line_input(text, turns):
    lines, got = chat.pipe_lines(io.StringIO(text)), []
    with pytest.raises(EOFError):
        while True:
            got.append(chat.read_turn(lines))
    assert got == turns


def test_history_path_follows_xdg_state_home(tmp_path, monkeypatch):
    assert chat.history_path({"XDG_STATE_HOME": str(tmp_path)}) == tmp_path / "hmad" / "chat_history"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert chat.history_path({"XDG_STATE_HOME": "relative"}) == tmp_path / ".local/state/hmad/chat_history"


def test_the_terminal_ui_through_prompt_toolkit(hmad, tmp_path):
    """The prompt_toolkit session on a pipe input: a message, Alt-Enter's new line inside one, Ctrl-C at
    the prompt clearing a line that is never sent, /save, Ctrl-D leaving; the lines go to the history file."""
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    out, err, saved, history = io.StringIO(), io.StringIO(), tmp_path / "t.json", tmp_path / "state" / "h"
    with create_pipe_input() as keys, Client(hmad.socket) as c:
        session = chat.terminal_session(history, input=keys, output=DummyOutput())
        talk = chat.Chat(
            c, chat.Conversation(raw=False), {"max_tokens": 2, "temperature": 0}, "tiny", out, err, True
        )
        keys.send_text(f"x b\rtwo\x1b\rlines\rnot sent\x03/save {saved}\r\x04")
        assert talk.run(chat.session_lines(session)) == 0
    users = [m["content"] for m in json.loads(saved.read_text())["messages"] if m["role"] == "user"]
    assert users == ["x b", "two\nlines"]
    assert "not sent" not in history.read_text() and "two\n+lines" in history.read_text()


def png(path, seed: int) -> str:
    px = np.random.default_rng(seed).integers(0, 256, (20, 24, 3), dtype=np.uint8)
    Image.fromarray(px).save(path, format="PNG")
    return str(path)


def test_image_goes_with_the_next_message_and_stays_in_the_conversation(tmp_path_factory, tmp_path):
    """The tiny VLM (no chat template of its own: --chat-template): /image puts the image first in the next
    user message, which keeps it (as the path) for the turns after; a file that is no image is refused."""
    vlm = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("vlm"), multimodal=True, vision="real")
    d = Daemon(vlm, tmp_path_factory.mktemp("hmad")).wait_ready()
    try:
        image, saved = png(tmp_path / "a.png", 1), tmp_path / "v.json"
        (tmp_path / "notes.txt").write_text("text")
        script = f"/image {tmp_path / 'notes.txt'}\n/image {image}\nwhat?\nand?\n/save {saved}\n"
        p, sent = converse(d, script, "--chat-template", "--max-tokens", "3", *SAMPLING)
        assert p.returncode == 0, p.stderr
        assert "is not an image file" in p.stderr
        messages = json.loads(saved.read_text())["messages"]
        parts = [{"type": "image", "image": image}, {"type": "text", "text": "what?"}]
        assert messages[0] == {"role": "user", "content": parts}
        assert sent == [sent_as(d, messages=messages[:1]), sent_as(d, messages=messages[:3])]
        assert sent[0] > sent_as(d, messages=[{"role": "user", "content": "what?"}])  # the soft tokens
    finally:
        assert d.stop() == 0, d.log_text()
