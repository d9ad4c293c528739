"""AsyncClient and Client against a real ``hmad`` process on a real ipc:// socket (daemon_harness.py), on a
tiny random Gemma 3 GGUF (tiny_gguf.py): routing, streaming, cancellation on early exit, timeouts, close(),
busy and error replies, lost and regained connections; and the paths where no daemon is there at all.

The tiny model is degenerate but deterministic, which is what these tests use: given a raw prompt it
repeats the prompt's last token ("x b" -> " b b b ..."), whatever the temperature, so each prompt has its
own known answer; ``max_tokens=100000`` makes a generation that runs for seconds (it ends at the context,
4096 tokens), long enough to break out of, time out on or kill the daemon under.

Most tests share one daemon per module (``hmad``); after each test it must be idle again (nothing running,
queued or in flight), which also checks that every cancel the test caused reached the daemon.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time

import pytest
from daemon_harness import Daemon
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import (
    AsyncClient,
    Client,
    ConnectionLost,
    DaemonUnreachable,
    HmadTimeout,
    Piece,
    ProtocolError,
    RequestCancelled,
    RequestError,
)
from hmaclient import protocol as P

LONG = 100000  # max_tokens of a generation that runs until cancelled (seconds at least)
TOO_LONG = "x " * 5000  # raw: 5000+ tokens, over the tiny model's context of 4096

SETTINGS = (
    "engine.max_seqs=8",
    "engine.max_queue=32",
    "service.drain_grace_s=2",
    "service.heartbeat_ivl_s=0.5",
    "service.heartbeat_timeout_s=1.5",
)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5, types=MIXED)


@pytest.fixture(scope="module")
def shared_daemon(tiny_path, tmp_path_factory):
    d = Daemon(tiny_path, tmp_path_factory.mktemp("hmad"), *SETTINGS).wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


@pytest.fixture
def hmad(shared_daemon):
    """The module's daemon; idle again after the test (what the test started has ended or was cancelled)."""
    yield shared_daemon
    assert shared_daemon.proc.poll() is None, shared_daemon.log_text()
    with Client(shared_daemon.socket) as c:
        wait_idle(c)


@pytest.fixture(scope="module")
def busy_daemon(tiny_path, tmp_path_factory):
    """One running slot and one queue place: a third request in flight is refused with ``busy``."""
    d = Daemon(tiny_path, tmp_path_factory.mktemp("busy"), "engine.max_seqs=1", "engine.max_queue=1")
    yield d.wait_ready()
    assert d.stop() == 0, d.log_text()


@pytest.fixture
def sock_path():
    d = tempfile.mkdtemp(prefix="hma")  # short: a Unix socket path holds 107 bytes
    yield os.path.join(d, "hmad.sock")
    shutil.rmtree(d, ignore_errors=True)


def wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.02)


def load(c: Client) -> tuple[int, int, int]:
    """(running, queued, in_flight) as the daemon reports them."""
    st = c.status()
    return st["running"], st["queued"], st["in_flight"]


def wait_idle(c: Client, timeout: float = 5.0) -> None:
    """Until nothing runs, waits or is in flight. A generation of LONG tokens that was not cancelled
    keeps going for seconds, past this timeout."""
    end = time.monotonic() + timeout
    while (now := load(c)) != (0, 0, 0):
        assert time.monotonic() < end, f"daemon not idle: (running, queued, in_flight) = {now}"
        time.sleep(0.02)


async def async_wait_idle(c: AsyncClient, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while True:
        st = await c.status()
        if (st["running"], st["queued"], st["in_flight"]) == (0, 0, 0):
            return
        assert time.monotonic() < end, f"daemon not idle: {st}"
        await asyncio.sleep(0.02)


# -- no daemon there ---------------------------------------------------------------------------------------


def test_missing_socket_is_unreachable(sock_path):
    with Client(sock_path) as c, pytest.raises(DaemonUnreachable) as info:
        c.generate("hi")
    msg = str(info.value)
    assert f"hmad is not running at {sock_path}" in msg
    assert "`systemctl start hmad`" in msg and "`hmad --foreground`" in msg
    assert isinstance(info.value, ConnectionError)


def test_stale_socket_is_unreachable(tiny_path, tmp_path):
    """A daemon killed with SIGKILL leaves its socket file behind, with nobody listening on it."""
    d = Daemon(tiny_path, tmp_path).wait_ready()
    d.proc.kill()
    assert d.stop() == -9
    assert os.path.exists(d.socket)
    t0 = time.monotonic()
    with Client(d.socket, connect_timeout=0.3) as c, pytest.raises(DaemonUnreachable) as info:
        c.status()
    assert time.monotonic() - t0 < 2
    msg = str(info.value)
    assert f"hmad is not running at {d.socket}" in msg and "no answer to ping within 0.3 s" in msg


def test_async_unreachable(sock_path):
    async def main():
        async with AsyncClient(sock_path) as c:
            with pytest.raises(DaemonUnreachable, match="not running"):
                async for _ in c.stream("x"):
                    pass
            with pytest.raises(DaemonUnreachable):
                await c.ping()

    asyncio.run(main())


def test_bad_parameters_raise_before_connecting(sock_path):
    with Client(sock_path) as c:
        with pytest.raises(ProtocolError, match="temperature"):
            c.generate("hi", temperature=-1)
        with pytest.raises(ProtocolError, match="top_p"):
            c.stream("hi", top_p=0)
        with pytest.raises(ValueError, match="unknown field"):
            c.generate("hi", temprature=1)


PNG = b"\x89PNG\r\n\x1a\n" + bytes(32)  # a PNG's signature: what the wire checks (the daemon decodes it)


def test_images_are_read_from_paths_and_sent_as_bytes(sock_path, tmp_path):
    png = tmp_path / "a.png"
    png.write_bytes(PNG)
    jpeg = tmp_path / "b.jpg"
    jpeg.write_bytes(b"\xff\xd8\xff\xe0" + bytes(8))
    with Client(sock_path) as c:  # nothing is sent until the stream is read: its message is inspected
        msg = c._async.stream("what is this?", images=[str(png), jpeg, bytearray(PNG)])._msg
        assert msg["images"] == [PNG, jpeg.read_bytes(), PNG] and msg["v"] == 4
        parts = [{"type": "image", "image": png}, {"type": "text", "text": "and?"}]
        messages = [{"role": "user", "content": parts}]
        msg = c._async.stream(messages=messages)._msg
        assert msg["messages"][0]["content"] == [
            {"type": "image", "image": PNG},
            {"type": "text", "text": "and?"},
        ]
        assert messages[0]["content"][0]["image"] == png  # the caller's messages are left as they were
        assert c._async.stream("no images")._msg["v"] == 1  # an older daemon still serves the rest


def test_image_files_refused_before_anything_is_sent(sock_path, tmp_path):
    (tmp_path / "notes.txt").write_text("not an image")
    big = tmp_path / "big.png"
    with open(big, "wb") as f:
        f.write(PNG)
        f.truncate(P.MAX_FRAME_BYTES + 1)  # sparse: over the wire's limit, stat'ed before it is read
    cases = [
        (
            [tmp_path / "missing.png"],
            P.BAD_REQUEST,
            r"images\[0\]: cannot read image .*missing.png.*No such file",
        ),
        ([PNG, tmp_path], P.BAD_REQUEST, "images\\[1\\]: cannot read image .*: Is a directory"),
        ([tmp_path / "notes.txt"], P.BAD_REQUEST, "notes.txt' is not an image file \\(PNG/JPEG"),
        ([big], P.TOO_LARGE, f"big.png' is {P.MAX_FRAME_BYTES + 1} bytes, over a request's limit"),
        ([b"GIF8"], P.BAD_REQUEST, "images\\[0\\] is not an image file"),
        ([PNG] * (P.MAX_IMAGES + 1), P.TOO_LARGE, "images is over the limit of 16"),
    ]
    with Client(sock_path) as c:  # no daemon there: each is refused before connecting
        for images, code, match in cases:
            with pytest.raises(ProtocolError, match=match) as info:
                c.generate("x", images=images)
            assert info.value.code == code, info.value
        with pytest.raises(ProtocolError, match="images need the chat template"):
            c.generate("x", images=[PNG], raw=True)
        parts = [{"type": "image", "image": str(tmp_path / "gone.webp")}]
        with pytest.raises(ProtocolError, match=r"messages\[0\]\.content\[0\]\.image: cannot read image"):
            c.stream(messages=[{"role": "user", "content": parts}])
        with pytest.raises(ProtocolError, match="only a user message may hold images"):
            c.generate(messages=[{"role": "assistant", "content": [{"type": "image", "image": PNG}]}])


def test_async_client_reads_image_paths_too(sock_path, tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)

    async def main():
        async with AsyncClient(sock_path) as c:
            assert c.stream("x", images=[tmp_path / "a.png"])._msg["images"] == [PNG]
            with pytest.raises(ProtocolError, match="cannot read image"):
                await c.generate("x", images=[tmp_path / "b.png"])

    asyncio.run(main())


def test_socket_path_too_long():
    with pytest.raises(ValueError, match="107"):
        AsyncClient("/tmp/" + "x" * 200)


# -- against the daemon ------------------------------------------------------------------------------------
#
# Dropped from the fake-daemon version: asserting on the request exactly as the server decoded it (its
# stream flag, max_tokens, temperature, stop list, seed). The real daemon does not expose what it
# received; the tests below check the parameters by their effect instead (max_tokens -> the token count
# and "length", stop -> the cut and "stop", raw -> prompt_tokens and the answer).


def test_generate_status_ping(hmad, tiny_path):
    with Client(hmad.socket) as c:
        r = c.generate("x b", raw=True, max_tokens=3, temperature=0, stop="END")
        assert (r.text, r.finish_reason, r.generated_tokens) == (" b b b", "length", 3)
        assert len(r.token_ids) == 3 and len(set(r.token_ids)) == 1
        assert r.prompt_tokens > 0 and r.rid >= 1 and r.id is not None
        assert set(r.timings) == {"ttft_s", "tokens_per_s", "total_s"} and r.total_s > 0
        # The stop string (a str, sent as a list) cuts the answer at its first occurrence.
        r = c.generate("x b", raw=True, max_tokens=10, temperature=0, stop="b b")
        assert (r.text, r.finish_reason) == (" ", "stop")
        # raw=False wraps the prompt in the chat template: more prompt tokens.
        templated = c.generate("x b", max_tokens=1).prompt_tokens
        assert templated > c.generate("x b", raw=True, max_tokens=1).prompt_tokens
        st = c.status()
        assert st["model"] == str(tiny_path) and st["model_name"] == "tiny-gemma3-seed5"
        assert st["context_length"] == 4096
        assert abs(c.ping() - time.time()) < 5


def test_stream_pieces_and_result(hmad):
    async def main():
        async with AsyncClient(hmad.socket) as c:
            s = c.stream("x w", raw=True, max_tokens=3, seed=5)
            pieces = [p async for p in s]
            assert [p.text for p in pieces] == [" w"] * 3
            assert all(isinstance(p, Piece) and len(p.token_ids) == 1 for p in pieces)
            r = s.result
            assert (r.text, r.finish_reason, r.generated_tokens) == (" w w w", "length", 3)
            assert r.token_ids == [i for p in pieces for i in p.token_ids] and r.rid == s.rid
            # The same request without streaming gives the same answer in one piece.
            whole = await c.generate("x w", raw=True, max_tokens=3, seed=5)
            assert (whole.text, whole.token_ids) == (r.text, r.token_ids)
            assert whole.prompt_tokens == r.prompt_tokens

    asyncio.run(main())


def test_concurrent_streams_are_routed_by_id(hmad):
    """Eight streams at once on one client, each with its own prompt and length: every piece and every
    final result reaches the stream that asked for it."""
    letters = "abcdefgh"

    async def main():
        async with AsyncClient(hmad.socket) as c:
            alone = [await c.generate(f"x {ch}", raw=True, max_tokens=1) for ch in letters]
            assert len({r.token_ids[0] for r in alone}) == len(letters)  # the answers tell the streams apart

            async def collect(i, ch):
                s = c.stream(f"x {ch}", raw=True, max_tokens=4 + 2 * i, temperature=0)
                pieces = [p async for p in s]
                return pieces, s.result

            got = await asyncio.gather(*(collect(i, ch) for i, ch in enumerate(letters)))
            for i, (ch, (pieces, result)) in enumerate(zip(letters, got, strict=True)):
                n = 4 + 2 * i
                assert [p.text for p in pieces] == [f" {ch}"] * n
                assert [p.token_ids for p in pieces] == [alone[i].token_ids] * n
                assert (result.generated_tokens, result.finish_reason) == (n, "length")
                assert result.prompt_tokens == alone[i].prompt_tokens
            st = await c.status()
            assert max(st["recent_batch_sizes"]) > 1, st  # they really ran together

    asyncio.run(main())


def test_two_clients_may_use_the_same_ids(hmad):
    """Ids are per connection: while client a's request "same" runs, client b may use "same" too."""
    with Client(hmad.socket) as a, Client(hmad.socket) as b:
        it = a.stream("x a", raw=True, max_tokens=LONG, id="same")
        assert next(it).text == " a"
        rb = b.generate("x b", raw=True, max_tokens=2, id="same")
        assert (rb.text, rb.id) == (" b b", "same")
        assert next(it).text == " a"
        it.close()


def test_error_reply_raises_request_error(hmad):
    with Client(hmad.socket) as c:
        with pytest.raises(RequestError) as info:
            c.generate(TOO_LONG, raw=True, id="big")
        assert (info.value.code, info.value.id) == (P.PROMPT_TOO_LONG, "big")
        assert "4096" in info.value.message
        with pytest.raises(RequestError, match=P.PROMPT_TOO_LONG):
            list(c.stream(TOO_LONG, raw=True))
        assert c.generate("x f", raw=True, max_tokens=2).text == " f f"  # the client carries on


def test_break_out_of_sync_stream_cancels(hmad):
    with Client(hmad.socket) as c:
        for piece in c.stream("x a", raw=True, max_tokens=LONG, id="brk"):
            assert piece.text == " a"
            break
        wait_idle(c)  # the cancel reached the daemon (this client is still connected)
        assert c.generate("x n", raw=True, max_tokens=1).text == " n"


def test_reusing_an_id_right_after_leaving_its_stream(hmad):
    """The id of a left stream stays taken until its terminal reply: reuse is refused locally until then,
    and afterwards the new request never sees the old one's replies."""
    with Client(hmad.socket) as c:
        for i in range(20):
            it = c.stream("x a", raw=True, max_tokens=LONG, id="same")
            next(it)
            it.close()
            time.sleep(0.0005 * i)
            while True:
                try:
                    r = c.generate("x c", raw=True, max_tokens=2, id="same")
                    break
                except ValueError as e:
                    assert "being cancelled" in str(e)
                    time.sleep(0.005)
            assert (r.text, r.finish_reason) == (" c c", "length")


def test_leaving_async_for_cancels(hmad):
    async def main():
        async with AsyncClient(hmad.socket) as c:
            async for _ in c.stream("x a", raw=True, max_tokens=LONG, id=1):
                break
            await async_wait_idle(c)
            async with c.stream("x a", raw=True, max_tokens=LONG, id=2) as s:
                await s.__anext__()
            await async_wait_idle(c)
            s3 = c.stream("x a", raw=True, max_tokens=LONG, id=3)
            await s3.__anext__()
            await s3.aclose()
            await async_wait_idle(c)

    asyncio.run(main())


def test_cancel_by_id_ends_generate_with_request_cancelled(hmad):
    async def main():
        async with AsyncClient(hmad.socket) as c:
            task = asyncio.ensure_future(c.generate("x a", raw=True, max_tokens=LONG, id="g"))
            while (await c.status())["running"] == 0:
                await asyncio.sleep(0.02)
            await c.cancel("g")
            with pytest.raises(RequestCancelled) as info:
                await task
            assert info.value.id == "g" and info.value.generated_tokens >= 1

    asyncio.run(main())


def test_generate_timeout_cancels_and_raises(hmad):
    with Client(hmad.socket) as c:
        t0 = time.monotonic()
        with pytest.raises(HmadTimeout) as info:
            c.generate("x a", raw=True, max_tokens=LONG, timeout=0.3, id="slow")
        assert isinstance(info.value, TimeoutError) and time.monotonic() - t0 < 1.5
        wait_idle(c)  # the running generation was cancelled


def test_close_cancels_running_generations(hmad):
    c = Client(hmad.socket)
    it = c.stream("x a", raw=True, max_tokens=LONG, id="left")
    assert next(it).text == " a"  # in flight, suspended: nobody is waiting on it
    c.close()
    with Client(hmad.socket) as other:
        # Nothing left running. (The daemon also cancels the requests of a peer that disconnects, so this
        # checks what close() leaves behind, not which of the two ended the generation.)
        wait_idle(other)
    it.close()  # after the client: nothing more to do, no error
    with pytest.raises(RuntimeError, match="closed"):
        c.ping()


def test_close_ends_a_task_a_ctrl_c_left_behind(hmad):
    """A Ctrl-C can land in Client._run after its task was scheduled and before it could be cancelled:
    close() still ends that orphan before the loop closes (no "Task was destroyed but it is pending")."""
    c = Client(hmad.socket)
    astream = c._async.stream("x a", raw=True, max_tokens=LONG, id="orphan")
    orphan = asyncio.run_coroutine_threadsafe(_drain(astream), c._loop)  # what an interrupted _run leaves
    while c.status()["running"] == 0:
        time.sleep(0.02)
    c._run(astream.aclose())  # what the interrupted stream's cleanup then does: the request is abandoned
    while c._async._pending:  # until the daemon's "cancelled" ends it: nothing will wake the orphan now
        time.sleep(0.02)
    c.close()
    assert orphan.cancelled(), orphan.exception()
    with Client(hmad.socket) as other:
        wait_idle(other)


async def _drain(astream):
    async for _ in astream:
        pass


def test_duplicate_id_in_flight_is_refused_locally(hmad):
    async def main():
        async with AsyncClient(hmad.socket) as c, c.stream("x a", raw=True, max_tokens=LONG, id="dup") as s:
            await s.__anext__()
            with pytest.raises(ValueError, match="already in flight"):
                await c.generate("x", id="dup")

    asyncio.run(main())


# -- a full daemon ---------------------------------------------------------------------------------------


def test_busy_daemon_refuses_with_request_error(busy_daemon):
    async def main():
        async with AsyncClient(busy_daemon.socket) as c:
            async with c.stream("x a", raw=True, max_tokens=LONG) as running:
                await running.__anext__()
                queued = c.stream("x b", raw=True, max_tokens=LONG, id="q")
                waiting = asyncio.ensure_future(queued.__anext__())
                while (await c.status())["queued"] == 0:
                    await asyncio.sleep(0.02)
                with pytest.raises(RequestError) as info:
                    await c.generate("x c", raw=True, max_tokens=1)
                assert info.value.code == P.BUSY
                waiting.cancel()  # leaving the queued stream cancels it
                await asyncio.gather(waiting, return_exceptions=True)
            await async_wait_idle(c)

    asyncio.run(main())


def test_timeouts_while_queued_raise_and_cancel(busy_daemon):
    """No reply within the timeout (the request waits behind the one running): HmadTimeout, and the
    queued request is cancelled."""
    with Client(busy_daemon.socket) as holder, Client(busy_daemon.socket) as c:
        hold = holder.stream("x a", raw=True, max_tokens=LONG)
        assert next(hold).text == " a"
        t0 = time.monotonic()
        with pytest.raises(HmadTimeout):
            c.generate("x b", raw=True, max_tokens=3, timeout=0.3)
        assert time.monotonic() - t0 < 1.5
        wait_for(lambda: load(c) == (1, 0, 1))
        with pytest.raises(HmadTimeout):
            next(iter(c.stream("x b", raw=True, max_tokens=3, timeout=0.2)))  # bounds each wait
        wait_for(lambda: load(c) == (1, 0, 1))
        hold.close()
        wait_idle(c)


# -- the daemon goes away ------------------------------------------------------------------------------------


def test_connection_lost_fails_requests_and_restart_is_found(tiny_path, tmp_path):
    d = Daemon(tiny_path, tmp_path, *SETTINGS).wait_ready()
    c = Client(d.socket, timeout=10)  # a regression fails with HmadTimeout instead of hanging
    try:
        it = c.stream("x a", raw=True, max_tokens=LONG)
        assert next(it).text == " a"
        d.proc.kill()  # SIGKILL mid-stream: no terminal reply will ever come
        assert d.stop() == -9
        with pytest.raises(ConnectionLost, match="lost the connection") as info:
            list(it)
        assert isinstance(info.value, DaemonUnreachable)
        # Later requests check again and find it gone.
        with pytest.raises(DaemonUnreachable):
            Client(d.socket, connect_timeout=0.2).ping()
        # A restarted daemon on the same socket path is found again by the same client.
        d = Daemon(tiny_path, tmp_path, *SETTINGS).wait_ready()
        wait_for(lambda: _answers(c))
        assert c.generate("x z", raw=True, max_tokens=2).text == " z z"
    finally:
        c.close()
        d.stop()
    assert d.proc.returncode == 0, d.log_text()


def _answers(c: Client) -> bool:
    try:
        return c.generate("x y", raw=True, max_tokens=1, timeout=1).text == " y"
    except (DaemonUnreachable, HmadTimeout):
        return False
