#!/usr/bin/env python3
"""VulkanBackend on Gemma-3-shaped models: prefill, decode at 1-32 sequences, the engine end to end, GPU time.

Models are synthetic (timing does not depend on weight values): GGUFs with the real shapes written with
random valid blocks into ``--dir`` (``write_model``; the 27B one reuses each tensor kind's blocks in every
layer, so 16 GB write in seconds), or a real file of the shape with ``--gguf 270m=PATH`` (the embedded
Gemma 3 270M):
- ``270m``: 18 layers, d 640, 4 heads over 1 KV head of 256, ffn 2048, vocab 262144; the embedded model's
  quant mix (Q8_0 embedding = output, Q5_0 q/k/gate/up, Q8_0 v, Q4_K attn_output, Q6_K ffn_down).
- ``27b``: 62 layers, d 5376, 32 heads over 16 KV heads of 128, ffn 21504, vocab 262144; every matrix
  Q4_K (~16 GB, the shape llama.cpp's anchor figures were measured on).
Per model, in one run:
- ``steps``: StepBatch driven directly (KV blocks reserved for ``--context`` positions per sequence; decode
  at position context/2), greedy argmax on the GPU as the scheduler does for greedy requests; wall time per
  step (no timestamps recorded) -> tokens/s; decode weights-read rate as a fraction of the read-only
  ceiling measured on random bytes at the start of the same run (bench_vulkan_copy.py's kernels; until
  2026-11-25 it was a copy of never-written memory, zeros, which an H100 moved 1.8x faster than data).
- ``engine``: ``generate()`` (scheduler, sampling, stop checks: what the daemon runs) with 1, 8, 32 prompts
  of 32 tokens and ``--gen`` greedy tokens each, one scheduler configuration for all (the KV pools and
  recordings made once, in a warm-up, as in the daemon): generated tokens / wall time, prefill included.
- ``profile``: the steps again with a GPU timestamp after every command: GPU vs host time per step and the
  GPU microseconds per kernel (top kinds).

    python3 bench/bench_vulkan_model.py --models 270m,27b --out result.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "daemon"), str(ROOT / "bench")]

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFWriter  # noqa: E402

from hmad.composition import load_model  # noqa: E402
from hmad.core.batch import SeqSlice, StepBatch  # noqa: E402
from hmad.core.quants import random_blocks  # noqa: E402
from hmad.engine.generate import generate  # noqa: E402
from hmad.engine.kvcache import KVCacheManager, KVLayout  # noqa: E402
from hmad.engine.sampling import SamplingParams  # noqa: E402
from hmad.engine.scheduler import SchedulerConfig  # noqa: E402

SHAPES = {
    "270m": dict(n_layers=18, d=640, heads=4, kv_heads=1, head_dim=256, ffn=2048, vocab=262144, window=512),
    "27b": dict(
        n_layers=62, d=5376, heads=32, kv_heads=16, head_dim=128, ffn=21504, vocab=262144, window=1024
    ),
}
TYPES = {
    "270m": {
        "token_embd": Q.Q8_0,
        "attn_q": Q.Q5_0,
        "attn_k": Q.Q5_0,
        "attn_v": Q.Q8_0,
        "attn_output": Q.Q4_K,
        "ffn_gate": Q.Q5_0,
        "ffn_up": Q.Q5_0,
        "ffn_down": Q.Q6_K,
    },
    "27b": dict.fromkeys(
        ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), Q.Q4_K
    ),
}


def synthetic_vocab(n: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary of ``n`` tokens that encodes any text: the 4 specials, the 256 byte
    tokens ``<0xXX>`` (type 6), then ``▁``-words and letters (scored so longer pieces win), then fillers, the
    last ones Gemma 3's turn and image control tokens (type 3: chat and image prompts work)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    letters = [chr(c) for c in range(0x21, 0x7F)]
    words = ["\u2581" + w for w in ("the", "of", "and", "to", "in", "is", "was", "there", "time")]
    pieces = ["\u2581", *letters, *("\u2581" + c for c in letters), *words]
    controls = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>"]
    fillers = [f"t{i}" for i in range(n - len(specials) - len(byte_tokens) - len(pieces) - len(controls))]
    tokens = specials + byte_tokens + pieces + fillers + controls
    scores = [0.0] * (len(specials) + len(byte_tokens)) + [float(len(p)) for p in pieces]
    scores += [-1e4] * len(fillers) + [0.0] * len(controls)
    types_ = [3, 3, 3, 2] + [6] * len(byte_tokens) + [1] * (len(pieces) + len(fillers)) + [3] * len(controls)
    return tokens, scores, types_


def write_model(path: Path, name: str) -> Path:
    """A GGUF of ``SHAPES[name]`` with random valid blocks of ``TYPES[name]``; layers share block bytes."""
    s, types = SHAPES[name], TYPES[name]
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "gemma3")
    w.add_name(f"synthetic-gemma3-{name}-shape")
    w.add_block_count(s["n_layers"])
    w.add_context_length(32768)
    w.add_embedding_length(s["d"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(s["window"])
    w.add_tokenizer_model("llama")
    tokens, scores, types_ = synthetic_vocab(s["vocab"])
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types_)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    d, q, kv = s["d"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    emb = types["token_embd"]
    w.add_tensor("token_embd.weight", random_blocks(emb, (s["vocab"], d), rng), raw_dtype=emb)
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    shapes = {
        "attn_q": (q, d),
        "attn_k": (kv, d),
        "attn_v": (kv, d),
        "attn_output": (d, q),
        "ffn_gate": (s["ffn"], d),
        "ffn_up": (s["ffn"], d),
        "ffn_down": (d, s["ffn"]),
    }
    blocks = {kind: random_blocks(types[kind], shape, rng) for kind, shape in shapes.items()}
    norms = {"attn_norm": d, "attn_q_norm": s["head_dim"], "attn_k_norm": s["head_dim"]}
    norms |= {"post_attention_norm": d, "ffn_norm": d, "post_ffw_norm": d}
    ones = {n: np.ones(n, np.float32) for n in set(norms.values())}
    for i in range(s["n_layers"]):
        for kind in shapes:
            w.add_tensor(f"blk.{i}.{kind}.weight", blocks[kind], raw_dtype=types[kind])
        for kind, n in norms.items():
            w.add_tensor(f"blk.{i}.{kind}.weight", ones[n])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def make_batch(kv, layout, n_seqs: int, n_tok: int, pos0: int) -> StepBatch:
    parts = []
    for sid in range(n_seqs):
        t = kv.tables(sid)
        parts.append((SeqSlice(sid, 0, 0, pos0, t.global_table, t.local_table), [5 + sid] * n_tok, True))
    return StepBatch.build(parts, layout.block_size)


def time_steps(model, batch, reps: int) -> dict:
    be = model.backend
    model.forward_argmax(batch)  # records the bucket (not timed)
    wall, gpu = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        model.forward_argmax(batch)
        wall.append(time.perf_counter() - t0)
        gpu.append((be.last_gpu_ns or 0) / 1e9)
    return {"wall_ms": 1e3 * float(np.median(wall)), "gpu_ms": 1e3 * float(np.median(gpu))}


def op_breakdown(model, key, top: int = 12) -> list:
    t = model.backend.graphs[key].rec.gpu_times()
    agg = collections.Counter()
    for label, ns in t["commands"]:
        agg[label] += ns
    return [(k, round(v / 1e3, 1)) for k, v in agg.most_common(top)]


DECODE_BATCHES = (1, 8, 16, 32)  # sequences of the decode steps timed
PREFILL_SIZES = [512]  # tokens of the prefill steps timed (--prefill; 512 always)


def measure_steps(model, kv, layout, context: int, reps: int, ceiling: float, weight_bytes: int) -> dict:
    out = {}
    for n in PREFILL_SIZES:
        r = time_steps(model, make_batch(kv, layout, 1, n, 0), max(3, reps // 5))
        r["tok_s"] = n / (r["wall_ms"] / 1e3)
        out[f"prefill_{n}"] = r
    for b in DECODE_BATCHES:
        r = time_steps(model, make_batch(kv, layout, b, 1, context // 2), reps)
        r["tok_s"] = b / (r["wall_ms"] / 1e3)
        r["weights_GBps"] = weight_bytes / (r["wall_ms"] / 1e3) / 1e9
        r["of_ceiling"] = r["weights_GBps"] / ceiling
        out[f"decode_{b}"] = r
    return out


def sweep(model, kv, layout, args, attr: str, values, ceiling: float, weight_bytes: int) -> dict:
    """The steps (prefill 512, decode at DECODE_BATCHES sequences) with the backend option ``attr`` (a field
    of VulkanOptions: fuse, attention_kl, coopmat_layout, a setting under test) at each of ``values`` in
    turn (``dataclasses.replace`` of the options, every bucket recorded again per value); side by side in
    one process. The options are restored after."""
    be, out, keep = model.backend, {}, model.backend.options
    for i, v in enumerate(values):
        be.set_options(replace(keep, **{attr: v}))
        try:
            r = measure_steps(model, kv, layout, args.context, args.reps, ceiling, weight_bytes)
        except Exception as e:  # noqa: BLE001 - a value the device refuses (a kernel over its limits)
            out[f"{v}#{i}"] = {"error": repr(e)}
            print(f"  {attr} {v}: {e!r}", flush=True)
            continue
        out[f"{v}#{i}"] = r
        print(f"  {attr} {v}: " + ", ".join(f"{k} {x['tok_s']:.0f}" for k, x in r.items()), flush=True)
        print(
            f"  {attr} {v}: decode_1 {r['decode_1']['wall_ms']:.3f} ms, weights at "
            f"{r['decode_1']['of_ceiling']:.1%} of the read ceiling",
            flush=True,
        )
    be.set_options(keep)
    return out


def sweep_value(text: str):
    """A --sweep value: an int (1, 0 for flags), "none" for None, else the text (a kernel layout)."""
    if text == "none":
        return None
    return int(text) if text.lstrip("-").isdigit() else text


def measure_engine(model, gen: int, streams) -> dict:
    """generate() with one scheduler configuration for every run, as the daemon keeps one scheduler: the
    KV pools and the recorded graphs are made once (in the warm-up), not per call."""
    out = {}
    rng = np.random.default_rng(1)
    greedy = SamplingParams(temperature=0.0, max_tokens=gen, stop=[])
    cfg = SchedulerConfig(max_seqs=max(streams), kv_tokens=max(streams) * (32 + gen + 16))
    t0 = time.perf_counter()
    warm = [list(map(int, rng.integers(4, 1000, 32))) for _ in range(max(streams))]
    generate(model, warm, SamplingParams(temperature=0.0, max_tokens=4), cfg)
    for n in streams:  # record every bucket the runs will use
        generate(model, warm[:n], SamplingParams(temperature=0.0, max_tokens=2), cfg)
    print(f"  engine warm-up (recordings): {time.perf_counter() - t0:.2f} s", flush=True)
    for n in streams:
        prompts = [list(map(int, rng.integers(4, 1000, 32))) for _ in range(n)]
        t0 = time.perf_counter()
        res = generate(model, prompts, greedy, cfg)
        dt = time.perf_counter() - t0
        toks = sum(len(r.token_ids) for r in res)
        out[f"streams_{n}"] = {"generated": toks, "seconds": dt, "tok_s": toks / dt}
        print(f"  engine {n} streams: {toks / dt:.0f} tok/s ({toks} tokens in {dt:.2f} s)", flush=True)
    return out


def bench_model(name: str, args, ceiling: float) -> dict:
    t0 = time.perf_counter()
    real = args.gguf.get(name)  # a real model file of this shape (--gguf 270m=PATH), else a synthetic one
    path = Path(real) if real else write_model(Path(args.dir) / f"synthetic-{name}.gguf", name)
    res: dict = {"model_file": str(path) if real else "synthetic", "write_model_s": time.perf_counter() - t0}
    model = load_model(
        path,
        "vulkan",
        matvec=args.matvec,
        coopmat=args.coopmat,
        coopmat_min_tokens=args.coopmat_min_tokens,
        kv_dtype=args.kv_dtype,
    )
    be = model.backend
    be.set_options(replace(be.options, attention_kl=not args.no_attention_kl))
    weight_bytes = be.weights_plan.pools["device"].used + be.weights_plan.pools["host"].used
    res |= {"device": be.device, "load_s": model.load_seconds, "weight_bytes": weight_bytes}
    res |= {"coopmat": be.coopmat, "coopmat_min_tokens": be.coopmat_min_t, "kv_dtype": be.kv_dtype}
    res["attention_kl"] = be.attention_kl
    print(f"{name}: {weight_bytes / 2**30:.2f} GiB of weights on {be.device} in {model.load_seconds:.1f} s")
    layout = KVLayout.plan(model.config, 32 * args.context, 32, 512)
    be.alloc_kv(layout)
    kv = KVCacheManager(layout)
    for sid in range(32):
        kv.reserve(sid, args.context)
    res["steps"] = measure_steps(model, kv, layout, args.context, args.reps, ceiling, weight_bytes)
    for k, r in res["steps"].items():
        extra = f", weights at {r['of_ceiling']:.1%} of the read ceiling" if "of_ceiling" in r else ""
        print(f"  {name} {k}: {r['tok_s']:.0f} tok/s ({r['wall_ms']:.3f} ms/step{extra})", flush=True)
    for spec in args.sweep:  # attr=v1,v2,...: twice over, so that each value is timed early and late
        attr, values = spec.split("=")
        vals = [sweep_value(v) for v in values.split(",")] * 2
        res.setdefault("sweeps", {})[attr] = sweep(model, kv, layout, args, attr, vals, ceiling, weight_bytes)
    res["engine"] = measure_engine(model, args.gen, args.engine_streams if name in args.engine else (1,))
    be.set_timestamps(True)
    be.alloc_kv(layout)  # generate() re-planned the KV pools for its prompts; kv's tables are this layout's
    res["profile"] = measure_steps(
        model, kv, layout, args.context, max(3, args.reps // 3), ceiling, weight_bytes
    )
    res["ops_decode_1_us"] = op_breakdown(model, (1, 1))
    res["ops_decode_8_us"] = op_breakdown(model, (8, 8), top=16)
    res["ops_decode_32_us"] = op_breakdown(model, (32, 32))
    res["ops_prefill_512_us"] = op_breakdown(model, (512, 1))
    for k in ("prefill_512", "decode_1", "decode_8", "decode_32"):
        r = res["profile"][k]
        print(f"  {name} profile {k}: gpu {r['gpu_ms']:.3f} ms, wall {r['wall_ms']:.3f} ms per step")
    for k in ("ops_decode_1_us", "ops_decode_8_us", "ops_decode_32_us", "ops_prefill_512_us"):
        print(f"  {name} {k}: {res[k]}")
    be.close()
    if not real:
        path.unlink()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="270m,27b")
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--gen", type=int, default=64, help="greedy tokens per prompt in the engine runs")
    ap.add_argument("--matvec", default="exact", choices=("exact", "int8", "float"))
    ap.add_argument("--coopmat", default="auto", choices=("auto", "off"))
    ap.add_argument("--coopmat-min-tokens", type=int, default=4)
    ap.add_argument("--kv-dtype", default="float32", choices=("float32", "float16"))
    ap.add_argument("--no-attention-kl", action="store_true", help="attention_decode, not _kl (to compare)")
    ap.add_argument("--engine", default="270m,27b", help="models whose engine runs take 1, 8, 32 streams")
    ap.add_argument(
        "--gguf",
        action="append",
        default=[],
        help="name=PATH: bench this GGUF (e.g. the embedded Gemma 3 270M) in place of the synthetic model",
    )
    ap.add_argument(
        "--sweep",
        action="append",
        default=[],
        help="attr=v1,v2,...: the steps with a backend option (VulkanOptions field) at each value (fuse=1,0; "
        "coopmat_layout=none,64x128; attention_kl=1,0)",
    )
    ap.add_argument("--copy-mib", type=int, default=1024)
    ap.add_argument("--prefill", default="512", help="comma list: tokens of the prefill steps timed (+512)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--watchdog-s", type=float, default=0, help="dump the stacks and exit after this")
    args = ap.parse_args()
    if args.watchdog_s:
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    args.engine, args.engine_streams = args.engine.split(","), (1, 8, 32)
    PREFILL_SIZES[:] = sorted({512, *(int(v) for v in args.prefill.split(","))})
    args.gguf = dict(spec.split("=", 1) for spec in args.gguf)
    import bench_vulkan_copy as bc

    from hmad.backends.vulkan.device import Device
    from hmad.backends.vulkan.memory import create_buffer

    dev = Device()
    src = create_buffer(dev, args.copy_mib << 20, "device", "src")
    dst = create_buffer(dev, args.copy_mib << 20, "device", "dst")
    bc.fill_buffer(dev, src, bc.source_bytes(src.nbytes, "random"))  # weights are data: zeros move faster
    # warm (clocks up) and timed for a while: a cold GPU's first submit reads at a third of the rate
    runs = [bc.bench_variant(dev, v, 256, src, dst, 10, warm_s=2.0, seconds=0.5) for v in bc.VARIANTS]
    res: dict = {"copy": runs, **bc.ceilings(runs), "date": time.strftime("%Y-%m-%d"), "models": {}}
    ceiling = res["read_ceiling_GBps"]  # a decode step reads its weights
    src.arena.close()
    dst.arena.close()
    dev.close()
    print(f"read ceiling {ceiling:.0f} GB/s, copy {res['ceiling_GBps']:.0f} GB/s (random bytes)", flush=True)
    for name in args.models.split(","):
        res["models"][name] = bench_model(name, args, ceiling)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
