"""The gateway with no key, by default: only loopback (or --allowed-host) Host names, JSON POST bodies only,
slow request heads and bodies cut off, JSON errors for unknown paths. A real hmad and a real gateway
process, spoken to over real HTTP (httpx) and raw sockets; refused requests never reach hmad."""

from __future__ import annotations

import json
import select
import shutil
import socket
import subprocess
import time
from urllib.parse import urlsplit

import httpx
import pytest
from daemon_harness import Daemon
from test_openai_gateway import CLEAN_EXIT, Gateway
from tiny_gguf import make_tiny_gguf

from hmaclient import Client
from hmad_openai import cli as gateway_cli
from hmad_openai.guards import host_allowed

HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 1.0, 1.5
COMPLETION = {"model": "any", "prompt": "x b", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hmad")
    d = Daemon(make_tiny_gguf(tmp / "tiny.gguf", seed=5), tmp)
    yield d.wait_ready()
    assert d.stop() == 0, d.log_text()


@pytest.fixture(scope="module")
def gateway(daemon, tmp_path_factory):
    timeouts = ["--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S)]
    g = Gateway(daemon.socket, tmp_path_factory.mktemp("gateway"), "--allowed-host", "hmad.lan", *timeouts)
    yield g
    assert g.stop() in CLEAN_EXIT, g.log_path.read_text()


def _generations(daemon: Daemon) -> int:
    """How many generate requests hmad has seen, whatever their outcome."""
    with Client(daemon.socket) as c:
        [fam] = [f for f in c.metrics() if f["name"] == "requests"]
    return sum(s["value"] for s in fam["samples"])


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status and r.headers["content-type"] == "application/json", (r, r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == code, err
    return err["message"]


# -- Host ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("127.0.0.1:8080", True),
        ("127.3.2.1", True),
        ("localhost", True),
        ("LocalHost.:80", True),
        ("[::1]:8080", True),
        ("::1", True),
        ("[::ffff:127.0.0.1]", True),
        ("hmad.lan:1234", True),  # --allowed-host
        ("evil.example", False),
        ("evil.example:8080", False),
        ("localhost.evil.example", False),
        ("127.0.0.1.evil.example", False),
        ("hmad.lan.evil.example", False),
        ("10.0.0.1", False),
        ("[::2]:8080", False),
        ("", False),
        (None, False),
    ],
)
def test_host_rule(host, ok):
    assert host_allowed(host, frozenset({"hmad.lan"})) is ok
    assert host_allowed(host, frozenset({"*"}))


@pytest.mark.parametrize(
    ("argv", "allowed"),
    [
        ([], ("127.0.0.1",)),  # the default --host
        (["--host", "0.0.0.0"], ()),  # a wildcard: the names clients use are unknown, give them
        (["--host", "::", "--allowed-host", "a.lan"], ("a.lan",)),
        (["--host", "192.168.7.2", "--allowed-host", "a.lan"], ("a.lan", "192.168.7.2")),
    ],
)
def test_allowed_hosts_are_the_flags_and_a_specific_listen_address(argv, allowed):
    assert gateway_cli.allowed_hosts(gateway_cli.build_parser().parse_args(argv)) == allowed


def test_loopback_and_allowed_hosts_are_served(gateway, daemon):
    port = urlsplit(gateway.url).port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "hmad.lan"):
        r = httpx.post(gateway.url + "/v1/completions", json=COMPLETION, headers={"Host": host}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " b b", (host, r.text)


@pytest.mark.parametrize("host", ["rebind.evil.example:{port}", "192.0.2.7:{port}", "localhost.evil.example"])
def test_other_hosts_are_refused_before_hmad_sees_anything(gateway, daemon, host):
    """DNS rebinding: a page on a name the attacker controls, resolved to 127.0.0.1, sends its own name."""
    host = host.format(port=urlsplit(gateway.url).port)
    before = _generations(daemon)
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/health")):
        r = httpx.request(method, gateway.url + path, json=COMPLETION, headers={"Host": host}, timeout=60)
        assert host in _error(r, 400, "invalid_host")
    assert _generations(daemon) == before


def test_request_without_host_is_refused(gateway):
    """HTTP/1.0 allows leaving Host out; the gateway does not."""
    with socket.create_connection(_address(gateway)) as s:
        s.sendall(b"GET /v1/models HTTP/1.0\r\n\r\n")
        head = _read_all(s)
    assert head.startswith(b"HTTP/1.1 400") and b'"invalid_host"' in head


# -- Content-Type ------------------------------------------------------------------------------------------


NOT_JSON = ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None]


@pytest.mark.parametrize("origin", ["http://evil.test", "null"])
@pytest.mark.parametrize("content_type", NOT_JSON)
def test_a_web_pages_post_must_be_json(gateway, daemon, content_type, origin):
    """A page may POST text/plain (or a form) to any origin without a CORS preflight, and the browser sends
    its Origin (``null`` from a sandboxed frame): refused with 415."""
    before = _generations(daemon)
    headers = {"Origin": origin, **({} if content_type is None else {"Content-Type": content_type})}
    body = httpx.Request("POST", "http://x", json=COMPLETION).content
    r = httpx.post(gateway.url + "/v1/completions", content=body, headers=headers, timeout=60)
    message = _error(r, 415, "unsupported_media_type")
    assert "application/json" in message and (content_type is None or repr(content_type) in message)
    assert _generations(daemon) == before


@pytest.mark.parametrize("content_type", NOT_JSON)
def test_a_post_without_origin_is_read_as_json_whatever_its_type(gateway, content_type):
    """curl -d '{...}' sends application/x-www-form-urlencoded, Ollama's and others' examples rely on it: a
    request with no Origin comes from no web page, so its body is read as JSON."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    body = httpx.Request("POST", "http://x", json=COMPLETION).content
    r = httpx.post(gateway.url + "/v1/completions", content=body, headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " b b", r.text
    ollama = {"model": "any", "prompt": "x b", "raw": True, "stream": False, "options": {"num_predict": 2}}
    body = httpx.Request("POST", "http://x", json=ollama).content
    r = httpx.post(gateway.url + "/api/generate", content=body, headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["response"] == " b b", r.text
    r = httpx.post(gateway.url + "/v1/completions", content=b"prompt=x+b", headers=headers, timeout=60)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_curl_without_a_content_type_flag(gateway):
    """The very command of Ollama's docs, through a real curl (skipped where there is none)."""
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl on this machine")
    body = '{"model": "any", "prompt": "x b", "raw": true, "stream": false, "options": {"num_predict": 2}}'
    out = subprocess.run([curl, "-s", gateway.url + "/api/generate", "-d", body], capture_output=True,
                         text=True, timeout=60, check=True).stdout  # fmt: skip
    assert json.loads(out)["response"] == " b b", out


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
def test_json_with_parameters_or_any_case_is_served(gateway, content_type):
    body = httpx.Request("POST", "http://x", json=COMPLETION).content
    r = httpx.post(gateway.url + "/v1/completions", content=body, headers={"Content-Type": content_type})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " b b", r.text


# -- unknown paths -------------------------------------------------------------------------------------------


def test_unknown_path_and_method_are_json_errors(gateway):
    assert "GET /v1/nothing" in _error(httpx.get(gateway.url + "/v1/nothing"), 404, "not_found")
    r = httpx.get(gateway.url + "/v1/completions")
    assert "GET /v1/completions" in _error(r, 405, "method_not_allowed") and r.headers["allow"] == "POST"


# -- slow clients --------------------------------------------------------------------------------------------


def _address(gateway: Gateway) -> tuple[str, int]:
    u = urlsplit(gateway.url)
    return u.hostname, u.port


def _read_all(s: socket.socket) -> bytes:
    s.settimeout(10)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _trickle(s: socket.socket, data: bytes, every_s: float = 0.05, limit_s: float = 10.0) -> float:
    """Send ``data`` a byte at a time; the seconds until the server closed the connection (it must)."""
    t0 = time.monotonic()
    for byte in data:
        try:
            s.send(bytes([byte]))
        except OSError:  # reset: closed
            return time.monotonic() - t0
        if select.select([s], [], [], every_s)[0]:
            try:
                if s.recv(65536) == b"":
                    return time.monotonic() - t0
            except OSError:
                return time.monotonic() - t0
        assert time.monotonic() - t0 < limit_s, "the connection was never closed"
    raise AssertionError("the whole request was sent before the connection was closed")


SLOW_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Pad: " + b"a" * 400 + b"\r\n\r\n"


def test_head_sent_a_byte_at_a_time_is_cut_off(gateway):
    with socket.create_connection(_address(gateway)) as s:
        took = _trickle(s, SLOW_HEAD)
    assert HEADER_TIMEOUT_S * 0.9 <= took <= HEADER_TIMEOUT_S + 2.0, took


def test_silent_connection_is_cut_off_and_logged(gateway):
    with socket.create_connection(_address(gateway)) as s:
        t0 = time.monotonic()
        assert _read_all(s) == b""
        assert time.monotonic() - t0 <= HEADER_TIMEOUT_S + 2.0
        port = s.getsockname()[1]
    said = f":{port}: its request head took over {HEADER_TIMEOUT_S:g} s"
    deadline = time.monotonic() + 5
    while said not in gateway.log_path.read_text():
        assert time.monotonic() < deadline, gateway.log_path.read_text()[-2000:]
        time.sleep(0.05)


def test_body_sent_a_byte_at_a_time_is_cut_off_and_never_reaches_hmad(gateway, daemon):
    before = _generations(daemon)
    body = httpx.Request("POST", "http://x", json=COMPLETION).content
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body) + 1000}\r\n\r\n"
    ).encode()
    with socket.create_connection(_address(gateway)) as s:
        s.sendall(head)
        took = _trickle(s, body + b" " * 1000)
    assert BODY_TIMEOUT_S * 0.9 <= took <= BODY_TIMEOUT_S + 2.0, took
    assert _generations(daemon) == before
    assert httpx.post(gateway.url + "/v1/completions", json=COMPLETION, timeout=60).status_code == 200


def test_keep_alive_connection_gets_the_head_deadline_again(gateway):
    """After a response, the next request's head is under the deadline too (not only the first one's)."""
    with socket.create_connection(_address(gateway)) as s:
        s.sendall(b"GET /v1/nothing HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        s.settimeout(10)
        assert s.recv(65536).startswith(b"HTTP/1.1 404")
        took = _trickle(s, SLOW_HEAD)
    assert took <= HEADER_TIMEOUT_S + 2.0, took
