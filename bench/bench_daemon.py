"""Aggregate throughput of a running hmad at 1, 4, 16, 32 concurrent clients, and what one streamed token
costs in the daemon's socket loop and in IPC, measured in one run beside the decode step it rides on.

    python3 bench/bench_daemon.py [--model default] [--backend cpu] [--tokens 32] [--json out.json]

It starts hmad itself (socket in a temp dir), runs each concurrency level with greedy raw prompts, then:
- server_us_per_reply: the socket loop's time per forwarded reply (pack + send), from hmad's status;
- ipc_rtt_us: a ping round trip on a bare ZeroMQ DEALER (client -> daemon -> client), median of 500;
- step_ms: hmad's mean engine step at the last level; overhead % = (server + rtt/2) / step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import zmq

from hmaclient import Client
from hmaclient import protocol as P


def start(model: str, backend: str, tmp: str, max_seqs: int) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(tmp, "hmad.sock")
    cmd = [
        sys.executable,
        "-m",
        "hmad",
        "--model",
        model,
        "--backend",
        backend,
        "--socket",
        sock,
        "--set",
        f"engine.max_seqs={max_seqs}",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd)
    subprocess.run(
        ["hmactl", "--socket", sock, "ping", "--wait", "300"], check=True, stdout=subprocess.DEVNULL
    )
    return proc, sock


def level(sock: str, n: int, tokens: int) -> dict:
    counts = [0] * n

    def ask(i: int) -> None:
        with Client(sock, timeout=600) as c:
            r = c.generate(
                f"Story {i}: once upon a time there was a", raw=True, max_tokens=tokens, temperature=0
            )
            counts[i] = r.generated_tokens

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    with Client(sock) as c:
        st = c.status()
    return {
        "clients": n,
        "tokens": sum(counts),
        "wall_s": round(wall, 3),
        "aggregate_tok_s": round(sum(counts) / wall, 2),
        "step_ms": st["step_ms"],
        "max_batch": max(st["recent_batch_sizes"] or [0]),
    }


def ipc_rtt_us(sock: str, n: int = 500) -> float:
    """Median ping round trip on a bare DEALER (no client-library overhead): ZeroMQ + the socket loop."""
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as s:
        s.connect(P.endpoint(sock))
        frame = P.pack(P.ping_request(1))
        samples = []
        for _ in range(n + 10):
            t = time.perf_counter()
            s.send(frame)
            s.recv()
            samples.append(time.perf_counter() - t)
    return statistics.median(samples[10:]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--levels", default="1,4,16,32")
    ap.add_argument("--json")
    a = ap.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        proc, sock = start(a.model, a.backend, tmp, max(levels))
        try:
            results = [level(sock, n, a.tokens) for n in levels]
            rtt = ipc_rtt_us(sock)
            with Client(sock) as c:
                st = c.status()
        finally:
            proc.terminate()
            proc.wait(60)
    step_us = results[-1]["step_ms"] * 1e3
    per_token_us = st["server_us_per_reply"] + rtt / 2
    out = {
        "device": f"{platform.machine()}, {os.cpu_count()} cores",
        "backend": st["backend"],
        "model": st["model"],
        "date": time.strftime("%Y-%m-%d"),
        "levels": results,
        "server_us_per_reply": st["server_us_per_reply"],
        "ipc_rtt_us": round(rtt, 1),
        "per_token_daemon_ipc_us": round(per_token_us, 1),
        "per_token_share_of_step_pct": round(100 * per_token_us / step_us, 3) if step_us else None,
    }
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
