"""What users get from a running hmad, beside what its engine does in-process, measured in one run.

    python3 bench/bench_daemon.py --model M.gguf [--backend vulkan] [--levels 8,32] [--gen 128] [--engine]
                                  [--json out.json]

It starts hmad itself (socket in a temp dir) and measures, through hmaclient's AsyncClient (N concurrent
streamed requests on one event loop, as an app would), in this order (the state bench_peer.py measures
llama-server in: idle, each shape warmed once before it is timed):
- ``ready_s``: process start -> the first ``pong`` (READY: the model resident, the buckets recorded);
- ``first_burst`` (``--first-burst``, on by default): the largest level, sent the moment hmad is ready;
- ``prefill``: one untimed request, then one request at a time of a fresh ``--prefill``-token prompt and 1
  new token, three times: prompt tokens / the daemon's ``ttft_s`` (arrival to first token: it includes the
  prompt's tokenization and the first token's sampling, which llama-server's ``prompt_per_second`` does not),
  the median;
- ``levels``: each level twice in a row, the second one reported. Per level: ``decode_tok_s`` (the
  requests' own decode rates, ``tokens_per_s`` of their ``done`` replies, summed: llama-server's
  ``predicted_per_second`` is the peer's), ``wall_tok_s`` (generated tokens / wall time, the prompts'
  prefill included; ``tok_s`` is the same figure under its old name), the client-side time to first token
  (median, max). Prompts of ``--prompt-tokens`` tokens each (the length bench_peer.py gives llama-server),
  else ``--prompt-words`` words;
- ``step_profile_ms``: hmad's mean step and, of it, the forward pass (status ``step_ms`` and ``forward_ms``;
  the rest is host work: batch, sampling, detokenization, stop strings, events), over the last level's last
  steps; then ``ipc_rtt_us``.
The GPU's clocks are sampled during every timed section (bench/gpu_clocks.py).
With ``--engine``, hmad is stopped and the same prompts run in-process through ``generate()`` (one
scheduler configuration, warmed once: what bench_vulkan_model.py's engine figures measure), and each level's
ratio daemon / engine is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "daemon")]

from hmaclient import AsyncClient, Client  # noqa: E402
from hmaclient import protocol as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_clocks import ClockLog, describe, max_clocks  # noqa: E402

# one token each in the embedded model's vocabulary and in bench_vulkan_model.synthetic_vocab's
WORDS = ("the", "of", "and", "to", "in", "is", "was", "there", "time")


def prompt(i: int, words: int, salt: int = 0) -> str:
    """Client ``i``'s prompt of burst ``salt``: it starts with both numbers, so no two prompts of a run share
    a prefix-cache block and every burst computes its prefill (the engine's runs share nothing either)."""
    return f"{salt} {i} " + " ".join(WORDS[(i * 7 + j * (j + i)) % len(WORDS)] for j in range(words - 2))


def start(a, tmp: str) -> tuple[subprocess.Popen, str, float]:
    sock = os.path.join(tmp, "hmad.sock")
    cmd = [sys.executable, "-m", "hmad", "--model", a.model, "--backend", a.backend, "--socket", sock]
    cmd += ["--set", f"engine.max_seqs={a.max_seqs}", "--log-level", "warning"]
    for s in a.set:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"hmad exited with {proc.returncode}")
        try:
            with Client(sock, timeout=1, connect_timeout=1) as c:
                if c.ready():
                    return proc, sock, time.perf_counter() - t0
        except Exception:
            time.sleep(0.05)


BURSTS = itertools.count(1)
#: --sampling: greedy, or Gemma 3's recommended settings (hmad's defaults; bench_peer.py gives llama-server
#: the same)
SAMPLING = {
    "greedy": {"temperature": 0},
    "gemma": {"temperature": 1.0, "top_k": 64, "top_p": 0.95, "min_p": 0.0},
}


async def one_stream(c: AsyncClient, text: str, a) -> tuple[float, object]:
    """One streamed request: (time to its first token at the client, its Result)."""
    t0, ttft = time.perf_counter(), None
    stream = c.stream(text, raw=True, max_tokens=a.gen, **SAMPLING[a.sampling])
    async with stream:
        async for _ in stream:
            if ttft is None:
                ttft = time.perf_counter() - t0
    return ttft or 0.0, stream.result


async def burst(sock: str, n: int, a) -> dict:
    """``n`` concurrent streamed requests: the decode rate (hmad's own), the wall rate, the TTFT."""
    texts = level_prompts(a, n, next(BURSTS))  # made before the clock starts (a tokenizer is loaded once)
    async with AsyncClient(sock, timeout=1800) as c:
        await c.connect()
        with ClockLog(f"hmad {n} streams") as clk:
            t0 = time.perf_counter()
            res = await asyncio.gather(*(one_stream(c, text, a) for text in texts))
            wall = time.perf_counter() - t0
    toks = sum(r.generated_tokens for _, r in res)
    ttft = [t for t, _ in res]
    return {
        "clients": n,
        "generated": toks,
        "prompt_tokens_mean": statistics.mean(r.prompt_tokens for _, r in res),
        "wall_s": round(wall, 3),
        "tok_s": round(toks / wall, 1),  # the wall rate under its old name
        "wall_tok_s": round(toks / wall, 1),
        "decode_tok_s": round(sum(r.tokens_per_s for _, r in res), 1),
        "per_stream_decode_tok_s": round(statistics.mean(r.tokens_per_s for _, r in res), 2),
        "ttft_s": {"median": statistics.median(ttft), "max": max(ttft)},
        "clocks": clk.summary,
    }


@functools.cache
def tokenizer(model: str):
    from hmad.model.loader import read_model_files, resolve_model_path

    return read_model_files(resolve_model_path(model)).tokenizer


def cut(model: str, text: str, n: int) -> str:
    """``text`` cut to a raw prompt of ``n`` tokens (BOS included, give or take a merge at the cut) in the
    model's own tokenizer."""
    tok = tokenizer(model)
    return tok.decode(tok.encode(text)[1:n])


def prompts_of_tokens(model: str, n: int, count: int) -> list[str]:
    """``count`` fresh raw prompts of ``n`` tokens."""
    return [cut(model, prompt(0, n, next(BURSTS)), n) for _ in range(count)]


def level_prompts(a, n: int, salt: int) -> list[str]:
    """The ``n`` clients' prompts of burst ``salt``: ``--prompt-tokens`` tokens each (what bench_peer.py's
    ``--prompt-len`` gives llama-server: the same work on both), else ``--prompt-words`` words."""
    if a.prompt_tokens:
        return [cut(a.model, prompt(i, a.prompt_tokens, salt), a.prompt_tokens) for i in range(n)]
    return [prompt(i, a.prompt_words, salt) for i in range(n)]


async def prefill(sock: str, prompts: list[str]) -> dict:
    """Prompt tokens per second of the daemon's time to first token, one prompt at a time (the median)."""
    rates, tokens = [], 0
    async with AsyncClient(sock, timeout=1800) as c:
        with ClockLog("hmad prefill") as clk:
            for text in prompts:
                r = await c.generate(text, raw=True, max_tokens=1, temperature=0)
                rates.append(r.prompt_tokens / r.ttft_s)
                tokens = r.prompt_tokens
    median = round(statistics.median(rates), 1)
    return {"tokens": tokens, "tok_s": median, "runs_tok_s": [round(x) for x in rates], "clocks": clk.summary}


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


def run_ready(a) -> dict:
    """hmad started and stopped: process start -> ready, and the load phases its status reports."""
    with tempfile.TemporaryDirectory() as tmp:
        proc, sock, ready = start(a, tmp)
        try:
            with Client(sock) as c:
                load = c.status().get("load", {})
        finally:
            proc.terminate()
            code = proc.wait(120)
    print(f"hmad ready in {ready:.2f} s; its phases: {load}", flush=True)
    return {"ready_s": round(ready, 3), "load": load, "exit": code}


def run_daemon(a, levels: list[int]) -> dict:
    """Ready, then (``--first-burst``) the largest level at once; the prefill (one untimed first: idle and
    warmed, as bench_peer.py measures llama-server's); every level warmed once, then measured."""
    with tempfile.TemporaryDirectory() as tmp:
        proc, sock, ready = start(a, tmp)
        print(f"hmad ready in {ready:.2f} s", flush=True)
        out: dict = {"ready_s": round(ready, 3)}
        try:
            if a.first_burst:
                out["first_burst"] = asyncio.run(burst(sock, max(levels), a))
                print(f"first burst ({max(levels)} clients): {out['first_burst']['tok_s']} tok/s", flush=True)
            if a.prefill:
                asyncio.run(prefill(sock, prompts_of_tokens(a.model, a.prefill, 1)))  # warm-up
                out["prefill"] = pre = asyncio.run(prefill(sock, prompts_of_tokens(a.model, a.prefill, 3)))
                print(f"prefill {pre['tokens']}: {pre['tok_s']} tok/s, {describe(pre['clocks'])}", flush=True)
            out["levels"] = {}
            for n in levels:
                asyncio.run(burst(sock, n, a))
                r = out["levels"][n] = asyncio.run(burst(sock, n, a))
                print(
                    f"{n} clients, steady: decode {r['decode_tok_s']} tok/s, wall {r['wall_tok_s']} tok/s, "
                    f"TTFT median {r['ttft_s']['median'] * 1e3:.0f} ms, {describe(r['clocks'])}",
                    flush=True,
                )
            with Client(sock) as c:  # the last level's steps: forward pass vs host work per step
                st = c.status()
                out["step_profile_ms"] = {"step": st["step_ms"], "forward": st["forward_ms"]}
                print(f"per step: {st['step_ms']} ms, of which forward {st['forward_ms']} ms", flush=True)
                piped = {k: st.get(k) for k in ("steps", "pipelined_steps", "draws_corrected")}
                print(f"steps so far: {piped}", flush=True)
            out["ipc_rtt_us"] = round(ipc_rtt_us(sock), 1)
            with Client(sock) as c:
                out["status"] = c.status()
        finally:
            proc.terminate()
            out["exit"] = proc.wait(120)
    return out


def run_engine(a, levels: list[int]) -> dict:
    """The same prompts through generate() in-process: the engine alone, no socket, no client."""
    from hmad.composition import load_model
    from hmad.engine.generate import generate
    from hmad.engine.sampling import SamplingParams
    from hmad.engine.scheduler import SchedulerConfig

    model = load_model(a.model, a.backend)
    cfg = SchedulerConfig(max_seqs=a.max_seqs, kv_tokens=32768)
    greedy = SamplingParams(temperature=0.0, max_tokens=a.gen, stop=[])
    generate(model, level_prompts(a, max(levels), 0), greedy, cfg)  # warm-up
    out = {}
    for n in levels:
        prompts = level_prompts(a, n, n)
        t0 = time.perf_counter()
        res = generate(model, prompts, greedy, cfg)
        wall = time.perf_counter() - t0
        toks = sum(len(r.token_ids) for r in res)
        out[n] = {"generated": toks, "wall_s": round(wall, 3), "tok_s": round(toks / wall, 1)}
        print(f"engine {n} streams: {out[n]['tok_s']} tok/s", flush=True)
    model.backend.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=127)
    ap.add_argument(
        "--prompt-tokens", type=int, default=0, help="prompts of N tokens instead (the peer's 128)"
    )
    ap.add_argument("--levels", default="8,32")
    ap.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy", help="the levels' requests")
    ap.add_argument("--max-seqs", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill figure (0: none)")
    ap.add_argument("--set", action="append", default=[], help="a config override for hmad (KEY=VALUE)")
    ap.add_argument("--engine", action="store_true", help="also the engine in-process, for the ratio")
    ap.add_argument(
        "--first-burst",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the largest level sent the moment hmad is ready (off: the state bench_peer.py measures in)",
    )
    ap.add_argument("--ready-only", type=int, default=0, help="N: only start hmad N times, time READY")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.ready_only:
        out = {
            "model": a.model,
            "date": time.strftime("%Y-%m-%d"),
            "runs": [run_ready(a) for _ in range(a.ready_only)],
        }
        print(json.dumps(out))
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
        return
    levels = [int(x) for x in a.levels.split(",")]
    out = {
        "host": f"{platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "model": a.model,
        "backend": a.backend,
        "gen": a.gen,
        "sampling": a.sampling,
        **max_clocks(),
        "daemon": run_daemon(a, levels),
    }
    out["device"] = out["daemon"]["status"].get("device")
    if a.engine:
        out["engine"] = run_engine(a, levels)
        out["ratio_daemon_engine"] = {
            n: round(out["daemon"]["levels"][n]["tok_s"] / out["engine"][n]["tok_s"], 3) for n in levels
        }
        print(f"daemon / engine: {out['ratio_daemon_engine']}", flush=True)
    if "first_burst" in out["daemon"]:
        first = out["daemon"]["first_burst"]["tok_s"] / out["daemon"]["levels"][max(levels)]["tok_s"]
        out["ratio_first_burst_steady"] = round(first, 3)
    print(json.dumps({k: v for k, v in out.items() if k != "daemon"} | {"ready_s": out["daemon"]["ready_s"]}))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
