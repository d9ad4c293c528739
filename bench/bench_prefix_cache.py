"""Time to first token of a prompt whose long prefix is cached, against the same prompt computed whole.

    python3 bench/bench_prefix_cache.py [--model default] [--backend cpu|vulkan] [--prefix-tokens 2000]
                                        [--runs 3] [--json out.json]

It starts hmad itself (socket in a temp dir, engine.prefix_cache on), sends one warm-up prompt of the same
length that shares nothing (so the first timed request pays no one-time cost: weight caches, the Vulkan
backend's recordings), then per run a new shared prefix of about ``--prefix-tokens`` tokens: first
``prefix + question A`` (nothing cached: the whole prompt is computed), then ``prefix + question B``
(the prefix's full blocks come from the cache). max_tokens 1, greedy, raw prompts. Printed per run: the
daemon's ttft_s (arrival to first token) of both, the prompt and cached token counts, and their ratio.
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
import time

from hmaclient import Client, HmaError


def shared_prefix(n_tokens: int, tag: str) -> str:
    """About ``n_tokens`` tokens of varied text (~20 tokens a record with Gemma's tokenizer)."""
    return " ".join(
        f"Record {tag}-{i}: sensor {i % 17} read {(i * 37) % 101} units at hour {i % 24}."
        for i in range(-(-n_tokens // 20))
    )


def start(model: str, backend: str, sock: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hmad", "--model", model, "--backend", backend, "--socket", sock]
    proc = subprocess.Popen([*cmd, "--set", "engine.prefix_cache=true", "--log-level", "warning"])
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with Client(sock, timeout=5) as c:
                if c.ready():  # the model loaded (the socket answers while it loads)
                    return proc
        except HmaError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"hmad did not come up (exit status {proc.poll()})")


def ttft_pair(c: Client, prefix: str) -> dict:
    """The uncached and the cached request of one prefix."""
    out = {}
    for name, q in (("first", "Which sensor read most?"), ("second", "What did sensor 3 read at hour 5?")):
        r = c.generate(f"{prefix}\nQuestion: {q}", raw=True, max_tokens=1, temperature=0)
        out[name] = {"ttft_s": r.ttft_s, "prompt_tokens": r.prompt_tokens, **r.extra}
    out["ratio"] = round(out["second"]["ttft_s"] / out["first"]["ttft_s"], 4)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sock = os.path.join(tmp, "hmad.sock")
        proc = start(args.model, args.backend, sock)
        try:
            with Client(sock, timeout=600) as c:
                warm_up = shared_prefix(args.prefix_tokens, "warm-up")
                c.generate(warm_up, raw=True, max_tokens=1, temperature=0)
                runs = [ttft_pair(c, shared_prefix(args.prefix_tokens, f"run{i}")) for i in range(args.runs)]
                status = c.status()
        finally:
            proc.terminate()
            proc.wait(60)
    for i, r in enumerate(runs):
        f, s = r["first"], r["second"]
        print(
            f"run {i}: first ttft {f['ttft_s'] * 1e3:.1f} ms ({f['prompt_tokens']} prompt tokens, "
            f"{f.get('cached_tokens')} cached), second {s['ttft_s'] * 1e3:.1f} ms ({s['prompt_tokens']} "
            f"prompt tokens, {s.get('cached_tokens')} cached): ratio {r['ratio']:.3f}"
        )
    result = {
        "backend": status.get("backend"),
        "device": status.get("device"),
        "model": status.get("model"),
        "host": platform.node(),
        "runs": runs,
        "median_ratio": statistics.median(r["ratio"] for r in runs),
        "prefix_cache": status.get("kv", {}).get("prefix_cache"),
    }
    print(f"median ratio {result['median_ratio']:.3f}; prefix_cache {result['prefix_cache']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
