"""hmactl: usage errors (2), hmad unreachable (3), and query/status/ping against a real ``hmad`` process
on a tiny random GGUF (daemon_harness.py, tiny_gguf.py), including Ctrl-C cancelling a running query (130).

The tiny model repeats a raw prompt's last token ("x b" -> " b b b ..."); ``--max-tokens 100000`` makes a
query that runs for seconds.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from daemon_harness import Daemon
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client, cli


@pytest.fixture
def sock_path():
    d = tempfile.mkdtemp(prefix="hma")
    yield os.path.join(d, "hmad.sock")
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5, types=MIXED)


@pytest.fixture(scope="module")
def shared_daemon(tiny_path, tmp_path_factory):
    d = Daemon(tiny_path, tmp_path_factory.mktemp("hmad"), "engine.max_seqs=8").wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


@pytest.fixture
def hmad(shared_daemon):
    """The module's daemon; after the test nothing of it may still run (queries ended or were cancelled)."""
    yield shared_daemon
    assert shared_daemon.proc.poll() is None, shared_daemon.log_text()
    wait_idle(shared_daemon.socket)


def wait_idle(path: str, timeout: float = 5.0) -> None:
    with Client(path) as c:
        _wait(lambda: _load(c) == (0, 0, 0), timeout)


def _load(c: Client) -> tuple[int, int, int]:
    st = c.status()
    return st["running"], st["queued"], st["in_flight"]


def _wait(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.02)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["query"],
        ["query", "--temperature", "hot", "hi"],
        ["query", "--max-tokens", "1.5", "hi"],
        ["status", "--verbose"],
        ["--timeout", "soon", "status"],
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert "usage: hmactl" in capsys.readouterr().err


def test_out_of_range_values_exit_2_before_connecting(sock_path, capsys):
    """A sampling flag out of its range (hmaclient.sampling) is a usage error naming field and range."""
    for flag, value, says in [
        ("--temperature", "-1", "temperature must be a number in [0, 100], got -1.0"),
        ("--top-p", "0", "top_p must be a number in (0, 1], got 0.0"),
        ("--max-tokens", "0", "max_tokens must be an integer from 1 to 1000000, got 0"),
        ("--stop", "", "a stop string has 1 to 256 characters"),
    ]:
        with pytest.raises(SystemExit) as info:
            cli.main(["--socket", sock_path, "query", flag, value, "--json", "hi"])
        assert info.value.code == 2 and says in capsys.readouterr().err
    assert cli.main(["--socket", sock_path, "query", *["--stop", "s"] * 17, "hi"]) == 2  # the wire's check
    assert "stop must be a list of at most 16 strings" in capsys.readouterr().err
    assert cli.main(["--socket", "/tmp/" + "x" * 200, "status"]) == 2


PNG = b"\x89PNG\r\n\x1a\n" + bytes(32)  # a PNG's signature: what the wire checks


def test_image_flags_parse_in_order_and_raw_is_refused(tmp_path, capsys):
    args = cli.build_parser().parse_args(["query", "--image", "a.png", "--image", "b.jpg", "what?"])
    assert (args.images, args.prompt) == (["a.png", "b.jpg"], "what?")
    assert cli.build_parser().parse_args(["query", "x"]).images is None
    with pytest.raises(SystemExit) as info:
        cli.main(["query", "--raw", "--image", "a.png", "x"])
    assert info.value.code == 2
    assert "--image needs the chat template: leave out --raw" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["query", "--image"])  # a path is required
    assert "expected one argument" in capsys.readouterr().err


def test_image_files_are_read_by_hmactl_before_connecting(sock_path, tmp_path, capsys, monkeypatch):
    (tmp_path / "notes.txt").write_text("text")
    q = ["--socket", sock_path, "query", "--image"]
    assert cli.main([*q, str(tmp_path / "gone.png"), "x"]) == 2
    assert "images[0]: cannot read image" in capsys.readouterr().err
    assert cli.main([*q, str(tmp_path / "notes.txt"), "x"]) == 2
    assert "is not an image file" in capsys.readouterr().err
    (tmp_path / "a.png").write_bytes(PNG)
    sent = []

    def stream(self, prompt, **kw):  # what hmactl asks of the client (the client's own test reads the files)
        sent.append((prompt, kw))
        return (piece for piece in ())

    monkeypatch.setattr(cli.Client, "stream", stream)
    # (--max-tokens: with --image and it given, hmactl needs nothing of the daemon's status)
    assert cli.main(["--socket", sock_path, "query", "--max-tokens", "8", "--image", str(tmp_path / "a.png"),
                     "--image", str(tmp_path / "a.png"), "what?"]) == 0  # fmt: skip
    assert (
        sent[0][0] == "what?" and sent[0][1]["images"] == [str(tmp_path / "a.png")] * 2
    )  # the client reads them


def test_query_with_an_image_on_a_model_without_vision_exits_1(hmad, tmp_path, capsys):
    """The tiny model has no vision tower: hmad refuses the image (``unsupported``), naming it."""
    (tmp_path / "a.png").write_bytes(PNG)
    assert cli.main(["--socket", hmad.socket, "query", "--image", str(tmp_path / "a.png"), "what?"]) == 1
    err = capsys.readouterr().err
    assert "error: " in err and ("image" in err.lower() or "vision" in err.lower()), err


def test_query_flags_are_the_sampling_fields():
    """hmactl query and hmad generate build their flags from the one table, with its ranges and defaults."""
    from hmaclient import sampling
    from hmad.__main__ import build_parser

    query = cli.build_parser().parse_args(["query", "x"])
    offline = build_parser().parse_args(["generate", "x"])
    for f in sampling.FIELDS:
        assert getattr(query, f.name) is None and getattr(offline, f.name) is None  # not given: the default
    text = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["query"].format_help().split())
    assert "a number in (0, 1] (default: 0.95)" in text and "(default: 512)" in text


@pytest.mark.parametrize("argv", [["status"], ["status", "--json"], ["ping"], ["query", "hi"]])
def test_unreachable_exit_3(argv, sock_path, capsys):
    assert cli.main(["--socket", sock_path, *argv]) == 3
    err = capsys.readouterr().err
    assert f"hmad is not running at {sock_path}" in err and "systemctl start hmad" in err


def test_unreachable_via_env_and_console_script(sock_path):
    env = {**os.environ, "HMAD_SOCKET": sock_path}
    hmactl = shutil.which("hmactl")
    cmd = [hmactl] if hmactl else [sys.executable, "-m", "hmaclient.cli"]
    p = subprocess.run([*cmd, "status"], env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 3, p.stderr
    assert sock_path in p.stderr


# Dropped from the fake-daemon version: asserting on the request exactly as the server decoded it (raw,
# stream, seed, max_tokens, stop). The real daemon does not expose it; the options are checked by their
# effect on the answer instead (the streamed text, its length, where --stop cuts it, prompt_tokens).


def test_query_streams(hmad, capsys):
    q = ["--socket", hmad.socket, "query"]
    assert cli.main([*q, "--raw", "--max-tokens", "4", "--stop", "X", "x b"]) == 0
    assert capsys.readouterr().out == " b b b b\n"  # the newline hmactl adds after an answer without one
    assert cli.main([*q, "--raw", "--max-tokens", "9", "--stop", "b b", "x b"]) == 0
    assert capsys.readouterr().out == " \n"  # cut before the stop string
    assert cli.main([*q, "--chat-template", "--max-tokens", "3", "--temperature", "0", "x b"]) == 0
    assert capsys.readouterr().out == "\n\n\n"  # chat template: the answer repeats its final newline


def test_query_stdin_raw_json(hmad, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin"))
    argv = ["--socket", hmad.socket, "query", "--raw", "--json", "--seed", "3", "--temperature", "0"]
    assert cli.main([*argv, "--max-tokens", "4", "-"]) == 0
    obj = json.loads(capsys.readouterr().out)
    with Client(hmad.socket) as c:
        r = c.generate("from stdin", raw=True, max_tokens=4, temperature=0)
        templated = c.generate("from stdin", max_tokens=1).prompt_tokens
    assert (obj["text"], obj["token_ids"], obj["prompt_tokens"]) == (r.text, r.token_ids, r.prompt_tokens)
    assert obj["prompt_tokens"] < templated  # --raw reached the daemon
    assert (obj["finish_reason"], obj["generated_tokens"], len(obj["token_ids"])) == ("length", 4, 4)
    assert set(obj["timings"]) == {"ttft_s", "tokens_per_s", "total_s"}


def test_query_error_exit_1(hmad, capsys):
    assert cli.main(["--socket", hmad.socket, "query", "--raw", "x " * 5000]) == 1
    assert "prompt_too_long" in capsys.readouterr().err
    t0 = time.monotonic()
    argv = ["--socket", hmad.socket, "--timeout", "0.3", "query", "--json", "--max-tokens", "100000", "x a"]
    assert cli.main(argv) == 1
    assert time.monotonic() - t0 < 5
    assert "error: no reply from hmad within" in capsys.readouterr().err
    # (the hmad fixture then checks the timed-out generation was cancelled)


def test_status(hmad, tiny_path, capsys):
    assert cli.main(["--socket", hmad.socket, "status"]) == 0
    out = capsys.readouterr().out
    assert f"hmad at {hmad.socket}" in out
    assert str(tiny_path) in out and "tiny-gemma3-seed5" in out and "MiB" in out  # memory as sizes
    assert cli.main(["--socket", hmad.socket, "status", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    with Client(hmad.socket) as c:
        assert set(info) == set(c.status())
    assert info["model"] == str(tiny_path) and info["context_length"] == 4096
    assert info["memory"] and all(isinstance(v, int) for v in info["memory"].values())
    assert cli.main(["--socket", hmad.socket, "ping"]) == 0
    assert capsys.readouterr().out == f"hmad is running at {hmad.socket}\n"


def _requests_done(families) -> int:
    [fam] = [f for f in families if f["name"] == "requests"]
    return sum(s["value"] for s in fam["samples"] if s["labels"]["outcome"] == "done")


def test_metrics(hmad, capsys):
    from prometheus_client.parser import text_string_to_metric_families

    argv = ["--socket", hmad.socket, "metrics"]
    with Client(hmad.socket) as c:
        before = c.metrics()
        c.generate("x b", raw=True, max_tokens=3, temperature=0)
    assert cli.main([*argv, "--json"]) == 0
    families = json.loads(capsys.readouterr().out)
    names = {f["name"] for f in families}
    assert {
        "requests",
        "prompt_tokens",
        "generated_tokens",
        "time_to_first_token_seconds",
        "batch_size",
    } <= names
    assert {
        "step_duration_seconds",
        "running",
        "queued",
        "kv_blocks",
        "memory_bytes",
        "tokens_per_second",
    } <= names
    assert _requests_done(families) == _requests_done(before) + 1  # the counters move
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"hmad at {hmad.socket}" in out
    for expected in ["outcome=done reason=length", "time to first token seconds", "observed, mean", "MiB"]:
        assert expected in out, out
    assert cli.main([*argv, "--prometheus"]) == 0
    parsed = {f.name: f for f in text_string_to_metric_families(capsys.readouterr().out)}
    assert parsed["hmad_requests"].type == "counter" and parsed["hmad_batch_size"].type == "histogram"
    done = [s.value for s in parsed["hmad_requests"].samples if s.labels.get("outcome") == "done"]
    assert sum(done) == _requests_done(families)
    with pytest.raises(SystemExit):
        cli.main([*argv, "--json", "--prometheus"])  # one format at a time


def test_format_metrics_histogram_quantiles():
    families = [
        {"name": "running", "type": "gauge", "help": "", "samples": [{"labels": {}, "value": 2}]},
        {
            "name": "ttft_seconds",
            "type": "histogram",
            "help": "",
            "samples": [
                {"labels": {}, "bounds": [0.01, 0.1, 1.0], "buckets": [1, 9, 9], "count": 10, "sum": 3.5}
            ],
        },
        {
            "name": "memory_bytes",
            "type": "gauge",
            "help": "",
            "samples": [{"labels": {"use": "kv"}, "value": 2048}],
        },
    ]
    text = "\n".join(cli.format_metrics(families))
    assert "10 observed, mean 350 ms, p50 <= 100 ms, p90 <= 100 ms, p99 > 1 s" in text
    assert "use=kv" in text and "2.0 KiB" in text and "running" in text


def test_format_status_shows_every_key():
    info = {
        "model": "gemma-3-4b",
        "uptime_s": 3725.2,
        "tokens_per_s": 41.26,
        "memory": {"heaps": [{"name": "vram", "used_bytes": 1536}, {"name": "gtt", "used_bytes": 0}]},
        "batch_sizes": [1, 4, 4],
        "draining": False,
        "kv_cache": {"used_blocks": 3, "total_blocks": 100},
        "extra": None,
    }
    text = "\n".join(cli.format_status(info))
    for expected in [
        "gemma-3-4b",
        "1h 02m 05s",
        "41.3 tok/s",
        "vram",
        "1.5 KiB",
        "1, 4, 4",
        "no",
        "used blocks",
    ]:
        assert expected in text


def _default_sigint() -> None:
    """hmactl as a terminal starts it: SIGINT at its default, so Python turns it into KeyboardInterrupt. (A
    suite launched in the background by a non-interactive shell inherits SIGINT ignored, and so would
    hmactl: it would never see the Ctrl-C this test sends.)"""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("json_mode", [False, True])
def test_ctrl_c_cancels_and_exits_130(hmad, json_mode):
    cmd = [sys.executable, "-m", "hmaclient.cli", "--socket", hmad.socket, "query", "--raw"]
    cmd += ["--max-tokens", "100000", *(["--json"] if json_mode else []), "x b"]
    with (
        Client(hmad.socket) as c,
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint
        ) as p,
    ):
        if json_mode:
            _wait(lambda: _load(c)[0] == 1)  # the generation runs
        else:
            assert p.stdout.read(4) == " b b"  # streaming has begun
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=10) == 130
        assert "Traceback" not in p.stderr.read()
        # Nothing left running. (The daemon also cancels the requests of a peer that disconnects, so this
        # checks what the interrupted hmactl leaves behind, not which of the two ended the generation.)
        _wait(lambda: _load(c) == (0, 0, 0))


def test_query_logprobs(hmad, capsys):
    """--logprobs / --prompt-logprobs: after the streamed answer one line a token (logprob, text, top),
    or with --json the lists hmaclient gets; out of range is a usage error naming the field."""
    q = ["--socket", hmad.socket, "query", "--raw", "--max-tokens", "3", "--temperature", "0"]
    with Client(hmad.socket) as c:
        ref = c.generate("x b", raw=True, max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=1)
    assert cli.main([*q, "--logprobs", "2", "--prompt-logprobs", "1", "x b"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ref.text
    p = lines.index("prompt logprobs:")
    g = lines.index("logprobs:")
    assert g - p - 1 == len(ref.prompt_logprobs) == ref.prompt_tokens
    assert "(the first token: no logprob)" in lines[p + 1]
    assert len(lines) - g - 1 == len(ref.logprobs) == 3
    for line, e in zip(lines[g + 1 :], ref.logprobs, strict=True):
        assert line.split()[0] == f"{e.logprob:.4f}" and json.dumps(e.text) in line
        assert f"top: {json.dumps(e.top[0][2])} {e.top[0][1]:.4f}" in line
    assert cli.main([*q, "--json", "--logprobs", "2", "--prompt-logprobs", "1", "x b"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert [e["token_id"] for e in obj["logprobs"]] == ref.token_ids
    assert [len(e["top"]) for e in obj["logprobs"]] == [2, 2, 2]
    assert obj["prompt_logprobs"][0] is None and len(obj["prompt_logprobs"]) == ref.prompt_tokens
    assert [e["logprob"] for e in obj["logprobs"]] == [e.logprob for e in ref.logprobs]
    with pytest.raises(SystemExit) as info:
        cli.main([*q, "--logprobs", "21", "x b"])
    assert info.value.code == 2 and "logprobs must be an integer from 0 to 20" in capsys.readouterr().err
