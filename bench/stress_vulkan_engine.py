#!/usr/bin/env python3
"""Stress the Vulkan engine the way the daemon and the model benchmark use it, to catch hangs and corruption.

One synthetic model (bench_vulkan_model.write_model) is loaded once; then, until ``--seconds`` are spent,
rounds of ``generate()`` over a fixed set of workloads (random prompts of 4..``--max-prompt`` tokens, 1..32
streams, greedy) under scheduler configurations taken in turn, so the KV pools are closed and made again
between rounds (what a configuration change does). Every third round first runs bench_vulkan_model's steps
phase (its own KV layout: prefill 512, decode at 32 streams) and then that benchmark's engine configuration:
the transition where an H200 step once never finished (2026-11-23), because most KV views of the second
layout have the arena size, offset and size of one of the first, the driver hands the new arenas the closed
ones' VkBuffer handles, and descriptor sets were cached by handle.

Checks, per round:
- every step finishes within ``--step-timeout-s`` (the backend raises VulkanError Timeout naming the bucket;
  the stack and the round are printed and the tool exits 3);
- a workload run again under the same configuration gives the same tokens as its first run (greedy, the
  same batches: a difference means a kernel read memory it should not have; exit 2).

    python3 bench/stress_vulkan_engine.py --model 27b --seconds 240 --out stress.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "daemon"), str(ROOT / "bench")]

from bench_vulkan_model import make_batch, write_model  # noqa: E402

from hmad.backends.vulkan.descriptors import arenas_of, handle_key, key_of, range_of  # noqa: E402
from hmad.backends.vulkan.memory import Arena  # noqa: E402
from hmad.backends.vulkan.pipelines import Kernel  # noqa: E402
from hmad.backends.vulkan.vkerrors import VulkanError  # noqa: E402
from hmad.composition import load_model  # noqa: E402
from hmad.engine.generate import generate  # noqa: E402
from hmad.engine.kvcache import KVCacheManager, KVLayout  # noqa: E402
from hmad.engine.sampling import SamplingParams  # noqa: E402
from hmad.engine.scheduler import SchedulerConfig  # noqa: E402


def workloads(n: int, max_prompt: int, vocab: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        streams = int(rng.choice([1, 2, 5, 8, 9, 17, 32]))
        lens = rng.integers(4, max_prompt + 1, streams)
        prompts = [list(map(int, rng.integers(4, min(vocab, 1000), k))) for k in lens]
        out.append({"prompts": prompts, "gen": int(rng.integers(1, 17))})
    return out


def configs(max_prompt: int) -> list[SchedulerConfig]:
    """The model benchmark's engine configuration first (it follows each steps phase there), then others."""
    per = max_prompt + 16 + 16
    return [
        SchedulerConfig(max_seqs=32, kv_tokens=32 * (32 + 32 + 16)),
        SchedulerConfig(max_seqs=32, kv_tokens=32 * per),
        SchedulerConfig(max_seqs=32, kv_tokens=32 * per + 4096, step_tokens=256, max_chunk=128),
        SchedulerConfig(max_seqs=16, kv_tokens=16 * per, step_tokens=512, max_chunk=64),
    ]


def steps_phase(model, context: int) -> None:
    """bench_vulkan_model's steps phase: its own KV layout, prefill 512 then decode at 32 streams."""
    layout = KVLayout.plan(model.config, 32 * context, 32, 512)
    model.backend.alloc_kv(layout)
    kv = KVCacheManager(layout)
    for sid in range(32):
        kv.reserve(sid, context)
    model.forward_argmax(make_batch(kv, layout, 1, 512, 0))
    for _ in range(3):
        model.forward_argmax(make_batch(kv, layout, 32, 1, context // 2))


# what the run saw: arenas made, of which with a VkBuffer handle an earlier arena had; and (with
# --handle-keyed-cache) descriptor sets bound for a buffer that were written for a closed one
SEEN = {"arenas": 0, "reused_handles": 0, "stale_binds": 0}
_handles: set[int] = set()


def _counting_arena_init(init):
    def wrapped(self, *a, **kw):
        init(self, *a, **kw)
        h = handle_key(self.buffer)
        SEEN["arenas"] += 1
        SEEN["reused_handles"] += h in _handles
        _handles.add(h)

    return wrapped


def _checked_descriptor_set(descriptor_set):
    """Kernel.descriptor_set, counting the sets it returns that were written for another (closed) buffer."""

    def wrapped(self, buffers):
        hit = self._sets.get(tuple(key_of(b) for b in buffers))
        if hit is not None and any(a is not b for a, b in zip(hit[1], arenas_of(buffers), strict=True)):
            SEEN["stale_binds"] += 1
        return descriptor_set(self, buffers)

    return wrapped


def _handle_keyed_descriptor_set(self, buffers):
    """Kernel.descriptor_set before 2026-11-23: keyed by VkBuffer handle, so a new buffer that the driver
    gave a closed one's handle was bound through the closed one's set (freed memory)."""
    ranges = [range_of(b) for b in buffers]
    key = tuple((handle_key(h), o, n) for h, o, n in ranges)
    hit = self._sets.get(key)
    if hit is None:
        hit = self._sets[key] = (self._write_set(ranges), arenas_of(buffers))
    elif any(a is not b for a, b in zip(hit[1], arenas_of(buffers), strict=True)):
        SEEN["stale_binds"] += 1
    return hit[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="270m", choices=("270m", "27b"))
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--workloads", type=int, default=6)
    ap.add_argument("--max-prompt", type=int, default=160)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--step-timeout-s", type=float, default=60)
    ap.add_argument("--coopmat", default="auto", choices=("auto", "off"))
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument(
        "--handle-keyed-cache",
        action="store_true",
        help="the defect fixed on 2026-11-23: descriptor sets cached under VkBuffer handles (to show the "
        "stress finds it)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    Arena.__init__ = _counting_arena_init(Arena.__init__)
    if args.handle_keyed_cache:
        Kernel.descriptor_set = _handle_keyed_descriptor_set
        Kernel.forget_closed = lambda self: 0  # as before: cached sets were never dropped
    else:
        Kernel.descriptor_set = _checked_descriptor_set(Kernel.descriptor_set)
    path = write_model(Path(args.dir) / f"stress-{args.model}.gguf", args.model)
    model = load_model(path, "vulkan", coopmat=args.coopmat)
    be = model.backend
    be.set_options(replace(be.options, step_timeout_s=args.step_timeout_s))
    work = workloads(args.workloads, args.max_prompt, model.config.vocab_size, args.seed)
    cfgs = configs(args.max_prompt)
    first: dict[tuple[int, int], list] = {}
    log: list[dict] = []
    res = {"model": args.model, "device": be.device, "rounds": log, "mismatches": 0, "hang": None}
    res["handle_keyed_cache"] = args.handle_keyed_cache
    t_end = time.perf_counter() + args.seconds
    rnd, rc = 0, 0
    print(f"{args.model} on {be.device}: {len(work)} workloads x {len(cfgs)} configurations", flush=True)
    try:
        while time.perf_counter() < t_end:
            w, c = rnd % len(work), (rnd // len(work) + rnd) % len(cfgs)
            if rnd % 3 == 2:  # then the benchmark's engine configuration, as in bench_vulkan_model
                steps_phase(model, args.context)
                c = 0
            t0 = time.perf_counter()
            params = SamplingParams(temperature=0.0, max_tokens=work[w]["gen"], stop=[])
            toks = [r.token_ids for r in generate(model, work[w]["prompts"], params, cfgs[c])]
            same = first.setdefault((w, c), toks) == toks
            res["mismatches"] += not same
            entry = {"round": rnd, "workload": w, "config": c, "streams": len(toks), "same": same}
            entry["seconds"] = round(time.perf_counter() - t0, 3)
            log.append(entry)
            print(f"  {entry}", flush=True)
            rnd += 1
    except VulkanError as e:
        traceback.print_exc()
        res["hang"] = {"round": rnd, "error": str(e)}
        print(f"STEP DID NOT FINISH in round {rnd}: {e}", flush=True)
        rc = 3
    repeats = len(log) - len(first)
    res |= {"rounds_run": rnd, "repeats_compared": repeats, "recordings": be.recordings, "steps": be.steps}
    res |= SEEN
    print(
        f"{rnd} rounds, {repeats} compared with a first run, {res['mismatches']} differed, "
        f"{be.recordings} recordings, {be.steps} steps; {SEEN}",
        flush=True,
    )
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    if rc:
        return rc  # a hung device: skip close (it would wait on the hung queue)
    be.close()
    path.unlink()
    return 2 if res["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
