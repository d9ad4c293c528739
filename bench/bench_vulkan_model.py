#!/usr/bin/env python3
"""VulkanBackend on a Gemma-3-270M-shaped model: prefill, decode at batch 1/8/32, GPU vs host time per step.

The model is synthetic (timing does not depend on weight values): a GGUF with the real 270M shapes and quant
mix (18 layers, d 640, 4 heads over 1 KV head of 256, ffn 2048, vocab 262144; Q8_0 embedding,
Q5_0 q/k/gate/up, Q8_0 v, Q4_K attn_output, Q6_K ffn_down) written with random valid blocks into ``--dir``.
Steps are driven directly (StepBatch, KV blocks reserved for ``--context`` positions per sequence;
decode at position ``--context``/2), with the argmax on the GPU as the scheduler does for greedy requests.
The copy-kernel ceiling (bench_vulkan_copy.py) is measured in the same run; decode is reported as a fraction
of the roofline: bytes of weights read per step / GPU time per step / ceiling.

    python3 bench/bench_vulkan_model.py --out result.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "daemon"), str(ROOT / "bench")]

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFWriter  # noqa: E402

from hmad.engine.batch import SeqSlice, StepBatch  # noqa: E402
from hmad.engine.kvcache import KVCacheManager, KVLayout  # noqa: E402
from hmad.model.loader import load_model  # noqa: E402
from hmad.model.quants import random_blocks  # noqa: E402

SHAPE = dict(n_layers=18, d=640, heads=4, kv_heads=1, head_dim=256, ffn=2048, vocab=262144, window=512)
TYPES = {
    "attn_q": Q.Q5_0,
    "attn_k": Q.Q5_0,
    "attn_v": Q.Q8_0,
    "attn_output": Q.Q4_K,
    "ffn_gate": Q.Q5_0,
    "ffn_up": Q.Q5_0,
    "ffn_down": Q.Q6_K,
}


def write_model(path: Path, s=SHAPE) -> Path:
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "gemma3")
    w.add_name("synthetic-gemma3-270m-shape")
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
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    w.add_token_list(specials + [f"t{i}" for i in range(s["vocab"] - len(specials))])
    w.add_token_scores([0.0] * s["vocab"])
    w.add_token_types([3, 3, 3, 2] + [1] * (s["vocab"] - 4))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    d, q, kv = s["d"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    w.add_tensor("token_embd.weight", random_blocks(Q.Q8_0, (s["vocab"], d), rng), raw_dtype=Q.Q8_0)
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
    norms = {"attn_norm": d, "attn_q_norm": s["head_dim"], "attn_k_norm": s["head_dim"]}
    norms |= {"post_attention_norm": d, "ffn_norm": d, "post_ffw_norm": d}
    for i in range(s["n_layers"]):
        for kind, shape in shapes.items():
            w.add_tensor(
                f"blk.{i}.{kind}.weight", random_blocks(TYPES[kind], shape, rng), raw_dtype=TYPES[kind]
            )
        for kind, n in norms.items():
            w.add_tensor(f"blk.{i}.{kind}.weight", np.ones(n, np.float32))
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
    host, gpu = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        model.forward_argmax(batch)
        host.append(time.perf_counter() - t0)
        gpu.append(be.last_gpu_ns / 1e9)
    return {"host_ms": 1e3 * float(np.median(host)), "gpu_ms": 1e3 * float(np.median(gpu))}


def op_breakdown(model, key) -> list:
    t = model.backend.graphs[key].rec.gpu_times()
    agg = collections.Counter()
    for label, ns in t["commands"]:
        agg[label] += ns
    return [(k, round(v / 1e3, 1)) for k, v in agg.most_common(10)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--copy-mib", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res: dict = {}

    import bench_vulkan_copy as bc

    from hmad.backends.vulkan.device import Device
    from hmad.backends.vulkan.memory import create_buffer

    dev = Device()
    src = create_buffer(dev, args.copy_mib << 20, "device", "src")
    dst = create_buffer(dev, args.copy_mib << 20, "device", "dst")
    runs = [
        bc.bench_variant(dev, v, 256, src, dst, 10) for v in ("copy_vec4", "copy_vec4_x4", "copy_vec4_x8")
    ]
    res["copy"] = runs
    ceiling = max(r["GBps"] for r in runs)
    res["ceiling_GBps"] = ceiling
    src.arena.close()
    dst.arena.close()
    dev.close()
    print(f"copy ceiling {ceiling:.0f} GB/s", flush=True)

    t0 = time.perf_counter()
    path = write_model(Path(args.dir) / "synthetic-270m.gguf")
    res["write_model_s"] = time.perf_counter() - t0
    model = load_model(path, "vulkan", timestamps=True)
    be = model.backend
    res["device"], res["load_s"] = be.device, model.load_seconds
    weight_bytes = be.weights_plan.pools["device"].used + be.weights_plan.pools["host"].used
    res["weight_bytes"] = weight_bytes
    print(
        f"{be.device}: model {weight_bytes / 2**20:.0f} MiB loaded in {model.load_seconds:.1f} s", flush=True
    )
    max_seqs = 32
    layout = KVLayout.plan(model.config, max_seqs * args.context, max_seqs, 512)
    be.alloc_kv(layout)
    kv = KVCacheManager(layout)
    for sid in range(max_seqs):
        kv.reserve(sid, args.context)

    r = time_steps(model, make_batch(kv, layout, 1, 512, 0), max(5, args.reps // 3))
    r["tok_s"] = 512 / (r["host_ms"] / 1e3)
    res["prefill_512"] = r
    res["prefill_ops_us"] = op_breakdown(model, (512, 1))
    print(f"prefill 512: {r['tok_s']:.0f} tok/s (host {r['host_ms']:.2f} ms, gpu {r['gpu_ms']:.2f} ms)")
    res["decode"] = {}
    for b in (1, 8, 32):
        r = time_steps(model, make_batch(kv, layout, b, 1, args.context // 2), args.reps)
        r["tok_s"] = b / (r["host_ms"] / 1e3)
        r["roofline_fraction"] = weight_bytes / (r["gpu_ms"] / 1e3) / 1e9 / ceiling
        res["decode"][b] = r
        print(
            f"decode batch {b:2d}: {r['tok_s']:.0f} tok/s (host {r['host_ms']:.3f} ms/step, gpu "
            f"{r['gpu_ms']:.3f} ms; weights at {r['roofline_fraction']:.1%} of the copy ceiling)",
            flush=True,
        )
    res["decode1_ops_us"] = op_breakdown(model, (1, 1))
    print("decode batch 1, GPU us per op kind:", res["decode1_ops_us"])
    print("prefill 512, GPU us per op kind:", res["prefill_ops_us"])
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
