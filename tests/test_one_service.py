"""One service: a real hmad with ``http.enabled: true`` serves the HTTP API from its own child process
(hmad.gateway_child), restarts the child when it dies while the socket keeps answering, and stops it on
SIGTERM; ``hmad-openai`` without its extra says what to install instead of a traceback.

The daemons run the tiny random GGUF (tests/tiny_gguf.py) on the CPU backend, on a free loopback port.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest
from daemon_harness import Daemon
from tiny_gguf import MIXED, make_tiny_gguf

from hmad import gateway_child
from hmad.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
KEY = "sk-one-service-0123"
TINY_NAME = "tiny-gemma3-seed5"
STARTED = re.compile(r"HTTP gateway started \(pid (\d+)\)")
# The extra's modules made unimportable, honestly: sys.modules[name] = None makes `import name` raise
# ModuleNotFoundError, as on a machine without the package (a sitecustomize runs in every process started
# with this directory on PYTHONPATH, hmad's child included)
BLOCK_THE_OPENAI_EXTRA = "import sys\nfor name in ('uvicorn', 'starlette'):\n    sys.modules[name] = None\n"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5, types=MIXED)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_hmad(model: Path, tmp: Path, env: dict[str, str] | None = None) -> tuple[Daemon, str]:
    """hmad with http.enabled on a free port and an API key file; (the daemon, its /v1 URL)."""
    (tmp / "key").write_text(KEY + "\n")
    port = free_port()
    sets = ("http.enabled=true", f"http.port={port}", f"http.api_key_file={tmp / 'key'}", "engine.max_seqs=2")
    return Daemon(model, tmp, *sets, env=env).wait_ready(), f"http://127.0.0.1:{port}/v1"


def children(d: Daemon, timeout: float = 30.0, after: int = 0) -> int:
    """The pid of the gateway child hmad started last, once it was started more than ``after`` times."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = STARTED.findall(d.log_text())
        if len(pids) > after:
            return int(pids[-1])
        assert d.proc.poll() is None, d.log_text()
        time.sleep(0.05)
    raise TimeoutError(f"no gateway child started:\n{d.log_text()}")


def models(url: str, timeout: float = 30.0) -> httpx.Response:
    """GET /v1/models with the key, once the child listens."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


# -- a real hmad with http.enabled -------------------------------------------------------------------------


def test_serves_http_from_its_child_and_sigterm_stops_both(model, tmp_path):
    d, url = start_hmad(model, tmp_path)
    try:
        child = children(d)
        assert parent_of(child) == d.proc.pid and os.getsid(child) == child  # its child, its own session
        r = models(url)
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [TINY_NAME]
        assert httpx.get(f"{url}/models", timeout=5).status_code == 401  # http.api_key_file reached it
        chat = httpx.post(
            f"{url}/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": TINY_NAME, "messages": [{"role": "user", "content": "x b"}], "max_tokens": 3},
            timeout=30,
        )
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] >= 1
    finally:
        code = d.stop(signal.SIGTERM)
    log = d.log_text()
    assert code == 0, log
    assert gone(child), f"the gateway (pid {child}) outlived hmad"
    assert f"HTTP gateway (pid {child}) stopped" in log and "starting it again" not in log
    assert log.index("SIGTERM: draining") < log.index("stopped cleanly")


def test_a_killed_child_is_started_again_while_the_socket_answers(model, tmp_path):
    d, url = start_hmad(model, tmp_path)
    try:
        first = children(d)
        assert models(url).status_code == 200
        os.kill(first, signal.SIGKILL)
        assert d.ping(2.0)  # the socket answers while no gateway runs (the restart waits a second) …
        assert len(STARTED.findall(d.log_text())) == 1  # … before the next one is started
        second = children(d, after=1)
        assert second != first and parent_of(second) == d.proc.pid
        assert models(url).status_code == 200
        assert d.ping(2.0) and d.proc.poll() is None
        said = rf"HTTP gateway \(pid {first}\) exited \(signal SIGKILL\) after .* s: starting it again in 1 s"
        assert re.search(said, d.log_text())
    finally:
        assert d.stop() == 0, d.log_text()
    assert gone(second)


def test_a_killed_hmad_takes_its_child_along(model, tmp_path):
    """hmad gone without stopping the child (SIGKILL, a crash): the child ends too (PR_SET_PDEATHSIG), so
    no gateway is left holding the port."""
    d, url = start_hmad(model, tmp_path)
    child = children(d)
    assert models(url).status_code == 200
    assert d.stop(signal.SIGKILL) == -signal.SIGKILL
    assert gone(child), f"the gateway (pid {child}) outlived a killed hmad"


def test_without_the_extra_hmad_serves_its_socket_and_says_what_to_install(model, tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCK_THE_OPENAI_EXTRA)
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")]))
    d, _url = start_hmad(model, tmp_path, env={"PYTHONPATH": pythonpath})
    try:
        assert d.ping()
        log = d.log_text()
        assert "http.enabled is true, but uvicorn is not installed" in log and "hmad[openai]" in log
        assert "HTTP gateway started" not in log
    finally:
        assert d.stop() == 0, d.log_text()


# -- the supervisor alone ----------------------------------------------------------------------------------


def test_restarts_back_off_and_a_stop_ends_them(monkeypatch, caplog):
    """A child that exits at once is started again after FIRST_DELAY_S, then twice that, …; close() ends
    the restarts and returns promptly."""
    monkeypatch.setattr(gateway_child, "POLL_S", 0.01)
    monkeypatch.setattr(gateway_child, "FIRST_DELAY_S", 0.1)
    caplog.set_level(logging.INFO, logger="hmad.gateway")
    child = gateway_child.GatewayChild([sys.executable, "-c", "raise SystemExit(3)"], lambda: True, "url")
    child.start()
    try:
        deadline = time.monotonic() + 30
        while child.starts < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        t0 = time.monotonic()
        child.close()
    assert child.starts >= 4 and time.monotonic() - t0 < 5
    said = re.findall(r"exited \(status 3\) after [\d.]+ s: starting it again in ([\d.]+) s", caplog.text)
    assert [float(s) for s in said[:3]] == [0.1, 0.2, 0.4]
    assert signal.getsignal(signal.SIGTERM) is not child._on_stop_signal  # hmad's own handler back


def test_a_process_that_may_not_open_tcp_sockets_says_so_and_starts_no_child(monkeypatch, caplog):
    """Under socket-only.conf (RestrictAddressFamilies=AF_UNIX) socket(AF_INET) fails with EAFNOSUPPORT:
    one error line instead of a child restarted forever. The refusal is played by a stand-in socket()."""

    def refused(*_args):
        raise OSError(errno.EAFNOSUPPORT, os.strerror(errno.EAFNOSUPPORT))

    monkeypatch.setattr(gateway_child.socket, "socket", refused)
    cfg = load_config(overrides={"http.enabled": True}, env={})
    with gateway_child.supervised(cfg, serving=lambda: True) as child:
        assert child is None
    assert "http.enabled is true, but this process may not listen on 127.0.0.1" in caplog.text
    assert "Address family not supported" in caplog.text


def test_nothing_runs_while_http_is_off():
    with gateway_child.supervised(load_config(env={}), serving=lambda: True) as child:
        assert child is None


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("http.port", 0, "an integer from 1 to 65535"),
        ("http.enabled", "yes", "true or false"),
        ("http.api_key_file", "key.txt", "the absolute path of a file whose first line is the bearer token"),
        ("http.allowed_hosts", "example.org", "a list of Host names"),
        ("http.cors_origins", ["*", "*"], "repeated"),
    ],
)
def test_http_keys_are_checked(key, value, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_config(overrides={key: value}, env={})


def test_the_child_gets_the_http_section_as_flags(tmp_path):
    cfg = load_config(
        overrides={
            "http.host": "::1",
            "http.port": 8181,
            "http.allowed_hosts": ["box.lan"],
            "socket.path": "/s",
        },
        env={},
    )
    argv = gateway_child.gateway_argv(cfg)
    assert argv[1:4] == ["-m", "hmad.gateway_child", str(os.getpid())]
    flags = " ".join(argv[4:])
    assert "--socket /s --host ::1 --port 8181" in flags and "--allowed-host box.lan" in flags
    assert "--api-key-file" not in flags


# -- hmad-openai without its extra -------------------------------------------------------------------------


def test_hmad_openai_without_its_extra_prints_one_hint_and_exits_2():
    code = BLOCK_THE_OPENAI_EXTRA + "import runpy\nrunpy.run_module('hmad_openai', run_name='__main__')\n"
    res = subprocess.run(
        [sys.executable, "-c", code, "--port", "0"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [
        "hmad-openai: uvicorn is not installed: pip install 'hmad[openai]' "
        "(for the service: /opt/hmad/venv/bin/pip install 'hmad[openai]')"
    ]
    assert "Traceback" not in res.stderr and res.stdout == ""


def test_the_console_script_goes_through_the_hint():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["hmad-openai"] == "hmad_openai.__main__:main"
