#!/usr/bin/env python3
"""Speculative decoding (docs/speculation.md, issue 39): what a verify step costs, what a draft token
costs, the speed-up they give at a given acceptance, the same on paper for the 780M, and prompt lookup and
a draft model through the daemon beside llama-server, in one run.

    python3 bench/bench_speculation.py --target /tmp/syn-27b.gguf --draft /tmp/syn-270m.gguf \\
        --server-dir /tmp/peer/bin --json OUT.json [--parts verify,draft,table,paper,lookup,streams]
    python3 bench/bench_speculation.py --backend cpu --model tiny --json /tmp/spec.json   # a smoke run

Parts:
- ``verify``: a target step of one sequence feeding its last token and k drafts, k + 1 = 1..16 tokens and
  as many logits rows read back whole (as a speculating step runs: ``SeqSlice.all_rows``), at position
  ``--context``/2; StepBatch driven directly as bench_vulkan_model.py does. Also the plain decode step
  (one token, greedy argmax on the device: what a step without speculation runs). The median wall of
  ``--reps`` steps after one untimed (its bucket recorded).
- ``draft``: the draft's batch-1 decode step (argmax on the device), the same way.
- ``table``: from those, the expected speed-up at acceptance a = 0.5..0.8 for k = 1..15: a round yields
  E = (1 - a^(k+1)) / (1 - a) tokens (each draft kept with probability a, independently, plus the target's
  own) and costs T_verify(k+1) + k T_draft; speed-up = E T_verify(1) / cost (``speedup``), and against the
  plain argmax decode step (``speedup_vs_argmax``).
- ``paper`` (also with ``table``): the same table for the Radeon 780M from a roofline: T(step of n
  tokens) = max(weights / bandwidth, 2 params n / FP16 throughput); the assumptions are in the output.
- ``lookup``: the daemon (``--model``, default the embedded 270M) at batch 1, greedy, ``--gen`` new tokens,
  on two prompts where lookup pays (a paragraph rewritten with one change; a code listing continued): the
  decode rate without speculation (the request's ``speculate: false``), with prompt lookup, and with the
  model drafting for itself (``speculation.mode: draft``, ``draft_model`` the same file: its acceptance is
  that of identical weights, an upper bound). Acceptance from status. Then llama-server (``--server-dir``)
  on the same file and prompt text, plain, with its n-gram drafts (``--spec-type ngram-simple`` where its
  ``--help`` lists it) and with itself as draft (``-md``); its rate and acceptance from ``timings``.
- ``streams``: 32 concurrent streams through a daemon with ``speculation.mode: lookup``, each sent with
  and without ``speculate``: the wall tokens/s (speculation backs off past ``speculation.max_batch``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "daemon"), str(ROOT / "client"), str(ROOT / "bench"), str(ROOT / "tests")]

from bench_lavapipe_step import _option  # noqa: E402

from hmad.composition import load_model  # noqa: E402
from hmad.core.batch import SeqSlice, StepBatch  # noqa: E402
from hmad.engine.kvcache import KVCacheManager, KVLayout  # noqa: E402

ACCEPTANCE = (0.5, 0.6, 0.7, 0.8)
KS = range(1, 16)
#: the 780M on paper (``paper``): its shared memory and FP16 rate, and the two models' sizes
PAPER = {
    "bandwidth_GBps": 89.6,  # DDR5-5600, 2 x 64 bit, shared with the CPU
    "fp16_TFLOPs": 8.9,  # 12 CUs (768 lanes, dual issue) x 2.9 GHz x 2 (FMA) x 2 (packed FP16)
    "target_weights_GB": 16.0,  # Gemma 3 27B Q4_K_M
    "target_params": 27e9,
    "draft_weights_GB": 0.25,  # Gemma 3 270M Q4_K_M
    "draft_params": 0.27e9,
    "assumptions": (
        "a step reads every weight once and does 2 FLOPs per parameter per token; whichever is slower sets "
        "its time; the KV cache's reads, the activations, the logits and launch overheads are ignored; "
        "memory reaches its peak bandwidth and the GPU its peak FP16 rate"
    ),
}


# -- the models ------------------------------------------------------------------------------------------
def model_file(spec: str, shape: str, tmp: Path, seed: int) -> str:
    """``spec``: ``tiny`` (a tiny GGUF of tests/tiny_gguf.py, written), a GGUF path (written with
    bench_vulkan_model.write_model's ``shape`` if absent), or anything hmad loads (``default``)."""
    if spec == "tiny":
        from tiny_gguf import make_tiny_gguf

        return str(make_tiny_gguf(tmp / f"tiny-{seed}.gguf", seed=seed))
    if spec.endswith(".gguf") and not Path(spec).exists():
        from bench_vulkan_model import write_model

        print(f"writing the {shape}-shaped synthetic model to {spec}", flush=True)
        write_model(Path(spec), shape)
    return spec


def step_timer(model, context: int, max_chunk: int = 16):
    """A function timing steps of one sequence: (tokens, all rows?, reps, argmax?) -> median wall seconds.
    ``argmax``: each logits row's argmax on the device, the ids read back (else whole rows); by default
    only for a step of one row."""
    layout = KVLayout.plan(model.config, context, 1, max_chunk, 16)
    model.backend.alloc_kv(layout)
    kv = KVCacheManager(layout)
    t = kv.reserve(0, context)

    def timed(n: int, all_rows: bool, reps: int, argmax: bool | None = None) -> float:
        s = SeqSlice(0, 0, 0, context // 2, t.global_table, t.local_table, all_rows=all_rows)
        batch = StepBatch.build([(s, [5] * n, True)], layout.block_size)
        fn = model.forward_argmax if (not all_rows if argmax is None else argmax) else model.forward
        fn(batch)  # its bucket recorded (not timed)
        wall = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(batch)
            wall.append(time.perf_counter() - t0)
        return float(np.median(wall))

    return timed


def run_verify(a, tmp: Path) -> dict:
    model = load_model(model_file(a.target, "27b", tmp, 7), a.backend, **a.options)
    timed = step_timer(model, a.context)
    out = {"model": model.path, "decode_argmax_ms": 1e3 * timed(1, False, a.reps), "verify_ms": {}}
    out["verify_argmax_ms"] = {}  # greedy requests' verification: each row's argmax on the device
    for n in range(1, 17):
        out["verify_ms"][n] = 1e3 * timed(n, True, a.reps)
        out["verify_argmax_ms"][n] = 1e3 * timed(n, True, a.reps, argmax=True)
        print(
            f"verify step of {n:2d} tokens: {out['verify_ms'][n]:.3f} ms whole rows, "
            f"{out['verify_argmax_ms'][n]:.3f} ms argmax on the device",
            flush=True,
        )
    print(f"plain decode step (argmax on the device): {out['decode_argmax_ms']:.3f} ms", flush=True)
    model.backend.close()
    return out


def run_draft(a, tmp: Path) -> dict:
    model = load_model(model_file(a.draft, "270m", tmp, 8), a.backend, **a.options)
    ms = 1e3 * step_timer(model, a.context)(1, False, a.reps)
    print(f"draft decode step (batch 1): {ms:.3f} ms", flush=True)
    model.backend.close()
    return {"model": model.path, "decode_ms": ms}


# -- the expected speed-up -------------------------------------------------------------------------------
def expected_tokens(a: float, k: int) -> float:
    """Tokens a round yields when each of k drafts is kept with probability ``a`` (until the first miss),
    plus the target's own token."""
    return (1 - a ** (k + 1)) / (1 - a)


def speedup_table(t_verify: dict[int, float], t_draft: float, t_plain: float | None = None) -> dict:
    """{acceptance: {k: speed-up}} (and ``_vs_argmax`` against ``t_plain``), the best k per acceptance."""
    out: dict = {"speedup": {}, "best": {}}
    if t_plain is not None:
        out["speedup_vs_argmax"] = {}
    for acc in ACCEPTANCE:
        row = {}
        for k in KS:
            cost = t_verify[k + 1] + k * t_draft
            row[k] = round(expected_tokens(acc, k) * t_verify[1] / cost, 3)
            if t_plain is not None:
                out["speedup_vs_argmax"].setdefault(acc, {})[k] = round(
                    expected_tokens(acc, k) * t_plain / cost, 3
                )
        out["speedup"][acc] = row
        best = max(row, key=row.get)
        out["best"][acc] = {"k": best, "speedup": row[best]}
    return out


def print_table(title: str, table: dict) -> None:
    print(title, flush=True)
    print("  k  " + "".join(f"  a={acc:<5}" for acc in ACCEPTANCE))
    for k in KS:
        print(f" {k:2d}  " + "".join(f"  {table['speedup'][acc][k]:<7.2f}" for acc in ACCEPTANCE))
    print(
        "  best: "
        + ", ".join(f"a={acc}: {b['speedup']:.2f}x at k={b['k']}" for acc, b in table["best"].items())
    )


def paper_780m() -> dict:
    p = PAPER

    def step_s(weights_gb: float, params: float, n: int) -> float:
        return max(weights_gb / p["bandwidth_GBps"], 2 * params * n / (p["fp16_TFLOPs"] * 1e12))

    verify = {n: step_s(p["target_weights_GB"], p["target_params"], n) for n in range(1, 17)}
    draft = step_s(p["draft_weights_GB"], p["draft_params"], 1)
    table = speedup_table(verify, draft)
    return {
        "inputs": p,
        "verify_ms": {n: 1e3 * v for n, v in verify.items()},
        "draft_ms": 1e3 * draft,
        **table,
    }


# -- through the daemon ----------------------------------------------------------------------------------
PARAGRAPH = (
    "The river runs past the old mill at the edge of the town, where the children gather on summer "
    "evenings to watch the water turn gold in the low sun. Their parents remember when the mill still "
    "ground wheat for the whole valley, and when the river flooded every spring and carried away the "
    "wooden bridge that the town rebuilt each year. Now the bridge is made of stone, the mill is a small "
    "museum, and the river is quiet most of the year, though the old people say it only waits."
)
LISTING = "\n".join(
    f"def scale_{name}(values, factor):\n    return [v * factor for v in values if v is not None]\n"
    for name in ("width", "height", "depth", "weight", "price", "volume")
)
PROMPTS = {
    "rewrite": "Rewrite this paragraph exactly as it is, but write 'canal' instead of 'river':\n\n"
    + PARAGRAPH,
    "code": "Continue this Python listing with scale_area, scale_speed and scale_count, in its style:\n\n"
    + LISTING,
}


def chat(text: str) -> str:
    """The prompt as Gemma 3's chat turns (the same text goes to llama-server's /completion)."""
    return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"


def spec_counts(client) -> dict:
    st = client.status().get("speculation", {})
    return {k: st.get(k, 0) for k in ("drafted", "accepted", "rolled_back")}


def daemon(a, tmp: Path, *sets: str):
    """hmad started on ``a.model`` with ``sets`` (bench_daemon.start): (process, socket)."""
    from bench_daemon import start

    ns = types.SimpleNamespace(model=a.model_file, backend=a.backend, max_seqs=32, set=list(sets))
    d = tempfile.mkdtemp(dir=tmp)
    proc, sock, ready = start(ns, d)
    print(f"hmad ready in {ready:.1f} s ({', '.join(sets) or 'defaults'})", flush=True)
    return proc, sock


def stop(proc) -> None:
    proc.terminate()
    proc.wait(120)


def batch1(a, sock: str, modes: dict[str, bool]) -> dict:
    """Per prompt and mode (name -> the request's speculate): decode tok/s, tokens, acceptance (median
    of ``--runs`` after one untimed); and whether every mode gave the same tokens."""
    from hmaclient import Client

    out = {}
    with Client(sock, timeout=600) as c:
        for name, text in PROMPTS.items():
            res, ids = {}, {}
            for mode, speculate in modes.items():
                kw = dict(raw=True, max_tokens=a.gen, temperature=0.0, speculate=speculate)
                c.generate(chat(text), **kw)
                before, rates = spec_counts(c), []
                for _ in range(a.runs):
                    r = c.generate(chat(text), **kw)
                    rates.append(r.tokens_per_s)
                after = spec_counts(c)
                delta = {k: after[k] - before[k] for k in after}
                res[mode] = {
                    "tok_s": round(statistics.median(rates), 1),
                    "tokens": r.generated_tokens,
                    **delta,
                    "acceptance": round(delta["accepted"] / delta["drafted"], 3)
                    if delta["drafted"]
                    else None,
                }
                ids[mode] = r.token_ids
                print(f"hmad {name} {mode}: {res[mode]}", flush=True)
            res["same_tokens"] = len({tuple(v) for v in ids.values()}) == 1
            out[name] = res
    return out


def run_lookup(a, tmp: Path) -> dict:
    out = {}
    proc, sock = daemon(a, tmp, "speculation.mode=lookup", f"speculation.k_max={a.k_max}")
    try:
        out["lookup"] = batch1(a, sock, {"off": False, "lookup": True})
    finally:
        stop(proc)
    draft = a.lookup_draft or a.model_file
    proc, sock = daemon(a, tmp, "speculation.mode=draft", f"speculation.draft_model={draft}",
                        f"speculation.k_max={a.k_max}")  # fmt: skip
    try:
        out["draft"] = batch1(a, sock, {"draft": True})
        out["draft"]["draft_model"] = draft
        out["draft"]["acceptance_is"] = "the model drafting for itself" if draft == a.model_file else "a pair"
    finally:
        stop(proc)
    for name in PROMPTS:
        off = out["lookup"][name]["off"]["tok_s"]
        for mode, part in (("lookup", "lookup"), ("draft", "draft")):
            r = out[part][name][mode]
            r["speedup"] = round(r["tok_s"] / off, 3) if off else None
    out["peer"] = run_peer(a, tmp)
    return out


def gguf_file(path: str, tmp: Path) -> str:
    """A plain GGUF of ``path`` for llama-server: an hmad parts manifest joined into one file."""
    if not path.endswith(".parts"):
        return path
    lines = Path(path).read_text().splitlines()
    joined = tmp / Path(path).name.removesuffix(".parts")
    with open(joined, "wb") as f:
        for line in lines[2:]:
            with open(line.split(maxsplit=2)[2], "rb") as part:
                shutil.copyfileobj(part, f)
    return str(joined)


def run_peer(a, tmp: Path) -> dict:
    """llama-server on the same file and prompts: plain, n-gram drafts, itself as draft."""
    if not a.server_dir:
        return {"skipped": "no --server-dir"}
    import bench_peer

    server = Path(a.server_dir) / "llama-server"
    env = {**os.environ, "LD_LIBRARY_PATH": f"{a.server_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    helped = subprocess.run([str(server), "--help"], capture_output=True, text=True, env=env, timeout=60)
    env_help = helped.stdout + helped.stderr
    from hmad.model.loader import resolve_model_path

    gguf = gguf_file(str(resolve_model_path(a.model_file)), tmp)
    k = str(a.k_max)
    configs = {"off": []}
    new = "--spec-draft-n-max" in env_help  # (later releases renamed --draft-max and the n-gram sizes)
    if "--spec-type" in env_help and "ngram-simple" in env_help:
        size_m = ["--spec-ngram-simple-size-m", k] if "--spec-ngram-simple-size-m" in env_help else []
        configs["ngram"] = ["--spec-type", "ngram-simple", *(size_m if new else ["--draft-max", k])]
    if "--model-draft" in env_help:
        n_max, n_min = ("--spec-draft-n-max", "--spec-draft-n-min") if new else ("--draft-max", "--draft-min")
        configs["draft"] = ["-md", gguf, n_max, k, n_min, "0"]
        configs["draft"] += ["-ngld", "999"] if "-ngld" in env_help else []
    out: dict = {"help_has": {"ngram": "ngram" in configs, "draft": "draft" in configs}}
    if "ngram" not in configs:
        out["ngram"] = "this llama-server has no n-gram speculation (--spec-type ngram-simple not in --help)"
    for mode, extra in configs.items():
        flags = ["-ngl", "999", "-fa", "on", "-np", "1", "-c", "4096", *extra]
        log = open(tmp / f"peer-{mode}.log", "w")  # noqa: SIM115
        port = bench_peer.free_port()
        proc = bench_peer.start(Path(a.server_dir), gguf, port, flags, log)
        try:
            bench_peer.wait_ready(proc, port, 300)
            out[mode] = {name: peer_run(port, chat(text), a) for name, text in PROMPTS.items()}
            print(f"llama-server {mode}: {out[mode]}", flush=True)
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, the rest goes on
            out[mode] = {"error": f"{type(e).__name__}: {e}", "log": str(tmp / f"peer-{mode}.log")}
            print(f"llama-server {mode} failed: {e}", flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
            log.close()
    return out


def peer_run(port: int, prompt: str, a) -> dict:
    import urllib.request

    body = {"prompt": prompt, "n_predict": a.gen, "temperature": 0, "cache_prompt": False}
    rates, t = [], {}
    for i in range(a.runs + 1):
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            t = json.loads(r.read())["timings"]
        if i:  # the first untimed
            rates.append(t["predicted_per_second"])
    drafted, accepted = t.get("draft_n", 0), t.get("draft_n_accepted", 0)
    return {
        "tok_s": round(statistics.median(rates), 1),
        "tokens": t.get("predicted_n"),
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": round(accepted / drafted, 3) if drafted else None,
    }


def run_streams(a, tmp: Path) -> dict:
    from hmaclient import AsyncClient

    async def burst(sock: str, speculate: bool, salt: int) -> float:
        texts = [chat(f"{salt} {i} " + list(PROMPTS.values())[i % 2]) for i in range(a.streams)]

        async def one(c, text):
            r = await c.generate(
                text, raw=True, max_tokens=a.streams_gen, temperature=0.0, speculate=speculate
            )
            return r.generated_tokens

        async with AsyncClient(sock, timeout=1800) as c:
            await c.connect()
            t0 = time.perf_counter()
            toks = await asyncio.gather(*(one(c, t) for t in texts))
            return sum(toks) / (time.perf_counter() - t0)

    proc, sock = daemon(a, tmp, "speculation.mode=lookup", f"engine.max_seqs={a.streams}")
    out: dict = {"streams": a.streams, "gen": a.streams_gen, "off_runs": [], "lookup_runs": []}
    try:
        modes = [("off", False), ("lookup", True)] * (
            1 + a.streams_reps
        )  # alternated; the first pair untimed
        for salt, (mode, speculate) in enumerate(modes):
            rate = asyncio.run(burst(sock, speculate, salt))
            if salt >= 2:
                out[f"{mode}_runs"].append(round(rate, 1))
                print(f"{a.streams} streams, speculation {mode}: {rate:.1f} tok/s", flush=True)
        for mode in ("off", "lookup"):
            out[f"{mode}_tok_s"] = round(float(np.median(out[f"{mode}_runs"])), 1)
        from hmaclient import Client

        with Client(sock) as c:
            out["speculation_status"] = c.status().get("speculation", {})
    finally:
        stop(proc)
    out["ratio_on_off"] = round(out["lookup_tok_s"] / out["off_tok_s"], 3)  # of the medians
    pairs = zip(out["lookup_runs"], out["off_runs"], strict=True)
    out["ratio_each_pair"] = [round(on / off, 3) for on, off in pairs]
    return out


# -- the run ---------------------------------------------------------------------------------------------
def summary(res: dict) -> None:
    if "table" in res:
        print_table("expected speed-up, measured steps (vs T_verify(1)):", res["table"])
    if "table_greedy" in res:
        print_table("... greedy requests (argmax of each row on the device):", res["table_greedy"])
    if "paper" in res:
        print_table("expected speed-up, Radeon 780M on paper:", res["paper"])
        print("  assumptions: " + PAPER["assumptions"])
    for part in ("lookup", "draft"):
        for name, r in res.get("lookup", {}).get(part, {}).items():
            if isinstance(r, dict):
                print(f"{part} {name}: " + ", ".join(f"{m}: {v.get('tok_s')} tok/s" for m, v in r.items()
                                                       if isinstance(v, dict)))  # fmt: skip
    peer = res.get("lookup", {}).get("peer")
    if peer:
        print(f"llama-server: {json.dumps(peer)[:600]}")
    if "streams" in res:
        s = res["streams"]
        rates = f"off {s['off_tok_s']}, lookup {s['lookup_tok_s']} tok/s"
        print(f"{s['streams']} streams: {rates} ({s['ratio_on_off']}x)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--target", default="/tmp/syn-27b.gguf", help="the verify part's model ('tiny': a tiny one)"
    )
    p.add_argument(
        "--draft", default="/tmp/syn-270m.gguf", help="the draft part's model ('tiny': a tiny one)"
    )
    p.add_argument("--model", default="default", help="lookup and streams: the daemon's model ('tiny' too)")
    p.add_argument("--lookup-draft", default=None, help="lookup: mode draft's draft model (default: --model)")
    p.add_argument("--backend", default="vulkan")
    p.add_argument("--server-dir", default=None, help="llama-server and its libraries")
    p.add_argument("--parts", default="verify,draft,table,paper,lookup,streams")
    p.add_argument("--context", type=int, default=4096, help="verify/draft: KV positions (steps at half)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--gen", type=int, default=256, help="lookup: new tokens per request")
    p.add_argument("--runs", type=int, default=3, help="lookup: timed requests per prompt and mode")
    p.add_argument("--k-max", type=int, default=8)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--streams-gen", type=int, default=128)
    p.add_argument("--streams-reps", type=int, default=3, help="streams: timed off/on pairs, alternated")
    p.add_argument("--json", default=None)
    p.add_argument("--option", action="append", default=[], help="verify/draft: a Vulkan option, NAME=VALUE")
    a = p.parse_args()
    a.options = dict(_option(o) for o in a.option)
    if a.model == "tiny":  # the smoke run's small sizes
        a.target, a.draft = "tiny", "tiny"
    parts = set(a.parts.split(","))
    res: dict = {"args": vars(a), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        a.model_file = model_file(a.model, "270m", tmp, 7) if parts & {"lookup", "streams"} else a.model
        if "verify" in parts or "table" in parts:
            res["verify"] = run_verify(a, tmp)
        if "draft" in parts or "table" in parts:
            res["draft"] = run_draft(a, tmp)
        if "table" in parts:
            v = res["verify"]
            res["table"] = speedup_table(
                {int(n): ms for n, ms in v["verify_ms"].items()},
                res["draft"]["decode_ms"],
                v["decode_argmax_ms"],
            )
            res["table_greedy"] = speedup_table(
                {int(n): ms for n, ms in v["verify_argmax_ms"].items()},
                res["draft"]["decode_ms"],
                v["decode_argmax_ms"],
            )
        if parts & {"table", "paper"}:  # (no device needed: with the table always)
            res["paper"] = paper_780m()
        if "lookup" in parts:
            res["lookup"] = run_lookup(a, tmp)
        if "streams" in parts:
            res["streams"] = run_streams(a, tmp)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    summary(res)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
        print(f"wrote {a.json} ({res['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
