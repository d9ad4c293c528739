"""hmaclient against a fake daemon (a ZeroMQ ROUTER in the test on a real ipc:// socket) that answers a
generate with a reply breaking the protocol: the call fails at once with a ProtocolError naming the bad
field, not at its timeout, and the client goes on serving other requests."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time

import msgpack
import pytest
import zmq

from hmaclient import AsyncClient, Client
from hmaclient import protocol as P

DONE = {"finish_reason": "stop", "prompt_tokens": 2, "generated_tokens": 1, "ttft_s": 0.1,
        "tokens_per_s": 0.0, "total_s": 0.1, "text": "b", "token_ids": [7]}  # fmt: skip
BROKEN = {  # prompt -> the fields that break a good done, and the field the error must name
    "generated_tokens": ({"generated_tokens": "1"}, "generated_tokens"),
    "token_ids": ({"token_ids": 5}, "token_ids"),
    "text": ({"text": 5}, "text"),
    "logprobs": ({"logprobs": [{"token_id": "x"}]}, "logprobs"),
    # an OverflowError inside the parse (int(inf)): once it killed the client's reader
    "done reply": (
        {"logprobs": [{"token_id": float("inf"), "text": "b", "logprob": 0.0, "top": []}]},
        "done",
    ),
}
TIMEOUT = 20.0  # the calls' timeout: an error must come long before it


class FakeDaemon:
    """Answers ping with pong; a generate of prompt p with accepted, a token piece when p ends with
    "+token", then a done broken as BROKEN[p] says ("ok": a good done)."""

    def __init__(self, path: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(f"ipc://{path}")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _send(self, ident: bytes, **msg) -> None:
        self.sock.send_multipart([ident, msgpack.packb({"v": 1, **msg})])

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, frame = self.sock.recv_multipart()
            msg = msgpack.unpackb(frame)
            mid = msg.get("id")
            if msg["type"] == "ping":
                self._send(ident, type="pong", id=mid, time=time.time(), state="ready")
            elif msg["type"] == "cancel":
                self._send(ident, type="error", id=mid, code="not_found", message="not in flight")
            elif msg["type"] == "generate":
                self._send(ident, type="accepted", id=mid, rid=1)
                prompt = msg["prompt"]
                if prompt.endswith("+token"):
                    prompt = prompt.removesuffix("+token")
                    self._send(ident, type="token", id=mid, text="b", token_ids=[7])
                broken = BROKEN[prompt][0] if prompt in BROKEN else {}
                self._send(ident, type="done", id=mid, **{**DONE, **broken})

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def fake():
    d = tempfile.mkdtemp(prefix="hma")
    path = os.path.join(d, "hmad.sock")
    f = FakeDaemon(path)
    yield path
    f.close()
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_generate_fails_at_once_naming_the_field(fake, broken):
    with Client(fake, timeout=TIMEOUT) as c:
        t0 = time.monotonic()
        with pytest.raises(P.ProtocolError) as info:
            c.generate(broken)
        assert time.monotonic() - t0 < 3.0
        assert BROKEN[broken][1] in info.value.message and "malformed reply" in info.value.message
        assert c.generate("ok").text == "b"  # the client still serves, its reader alive


def test_stream_fails_after_its_pieces(fake):
    with Client(fake, timeout=TIMEOUT) as c:
        pieces = []
        t0 = time.monotonic()
        with pytest.raises(P.ProtocolError) as info:
            for piece in c.stream("generated_tokens+token"):
                pieces.append(piece.text)
        assert pieces == ["b"] and time.monotonic() - t0 < 3.0
        assert "generated_tokens" in info.value.message
        assert c.generate("ok").token_ids == [7]


def test_async_generate_fails_at_once(fake):
    async def main() -> None:
        async with AsyncClient(fake, timeout=TIMEOUT) as c:
            t0 = time.monotonic()
            with pytest.raises(P.ProtocolError, match="token_ids"):
                await c.generate("token_ids")
            assert time.monotonic() - t0 < 3.0
            assert (await c.generate("ok")).text == "b"

    asyncio.run(main())


def test_parse_reply_raises_only_protocol_errors():
    """A reply whose fields hold what no check foresaw still fails as a ProtocolError with its id."""
    frame = msgpack.packb({"v": 1, "type": "done", "id": 3, **DONE, **BROKEN["done reply"][0]})
    with pytest.raises(P.ProtocolError) as info:
        P.parse_reply(frame)
    assert info.value.id == 3
