#!/usr/bin/env python3
"""The tails of a step: the on-device top-k of its logits rows (shaders/topk.comp, what a sampled step runs
before sample_topk.comp), each row's log-sum-exp (shaders/row_lse.comp, which the top-k tail records after
it, for logprobs), each row's logit of one given token (shaders/row_gather.comp, recorded beside it, for
prompt logprobs) and the greedy argmax (shaders/argmax.comp): GPU time against their first stage's chunk
count (the log-sum-exp at the backend's chunks, argmax's; its values and the gather's checked against
numpy's).

For each row count (``--rows``) and first-stage chunk count a row (``--chunks``, ``--argmax-chunks``; 1: one
stage, one workgroup a row, the kernels before issue 17's seventh session), ``--reps`` top-ks (or argmaxes)
of fresh random (rows, ``--vocab``) float32 logits are recorded back to back with a timestamp after every
dispatch, submitted once to warm up and once measured; one's time is the median of its dispatches' sum. Each
configuration's ids are checked against numpy's (top-k: a lexsort, value descending, lowest id on ties).

    python3 bench/bench_vulkan_topk.py --out topk.json        # device machine
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

from hmad.backends.vulkan.device import Device  # noqa: E402
from hmad.backends.vulkan.memory import Uploader, create_buffer  # noqa: E402
from hmad.backends.vulkan.pipelines import Kernel  # noqa: E402
from hmad.backends.vulkan.push import ArgmaxPush, RowGatherPush, RowLsePush, TopkPush  # noqa: E402
from hmad.backends.vulkan.recorder import CommandRecorder  # noqa: E402
from hmad.backends.vulkan.shapes import ARGMAX_CHUNKS, topk_chunk  # noqa: E402

K = 128  # the backend's candidates a row (TOPK_CANDIDATES)


def record(rec, kernels, bufs, rows: int, vocab: int, chunks: int) -> int:
    """Record one top-k of (rows, vocab) as the backend does (``_record_topk``); returns its dispatches."""
    first, merge = kernels
    logits, ids, vals, c_ids, c_vals = bufs
    chunk = topk_chunk(vocab, chunks)
    n_chunks = -(-vocab // chunk)
    if n_chunks == 1:
        rec.dispatch(
            first, [logits, ids, vals], TopkPush(rows, vocab, vocab, K, vocab), first.groups_for(rows)
        )
        return 1
    push = TopkPush(rows, vocab, vocab, K, chunk)
    rec.dispatch(first, [logits, c_ids, c_vals], push, first.groups_for(rows * n_chunks))
    n = n_chunks * K
    rec.dispatch(merge, [c_vals, ids, vals, c_ids], TopkPush(rows, n, n, K, n), merge.groups_for(rows))
    return 2


def record_reduction(push_type, merge_order, rec, kernels, bufs, rows: int, vocab: int, chunks: int) -> int:
    """Record one row reduction of (rows, vocab) as the backend does: one stage, or each chunk's partials
    (two buffers) then their merge, which binds them in ``merge_order`` around the output. Returns its
    dispatches."""
    single, first, merge = kernels
    logits, out, part_a, part_b = bufs
    chunk = topk_chunk(vocab, chunks)
    n = -(-vocab // chunk)
    if n == 1:
        rec.dispatch(single, [logits, out], push_type(rows, vocab, vocab, vocab), single.groups_for(rows))
        return 1
    rec.dispatch(
        first, [logits, part_a, part_b], push_type(rows, vocab, vocab, chunk), first.groups_for(rows * n)
    )
    a, b = (part_a, part_b) if merge_order == "ab" else (part_b, part_a)
    rec.dispatch(merge, [a, out, b], push_type(rows, n, n, n), merge.groups_for(rows))
    return 2


# argmax (the backend's ``argmax_tail``): partials (ids, values), merged reading values first;
# the log-sum-exp (``Readback._record_lse``): partials (maxima, sums), merged reading maxima first
record_argmax = functools.partial(record_reduction, ArgmaxPush, "ba")
record_lse = functools.partial(record_reduction, RowLsePush, "ab")


def record_gather(rec, kernels, bufs, rows: int, vocab: int, chunks: int) -> int:
    """Record one target gather of (rows, vocab) as the backend does (``Readback._record_gather``; its
    targets at word 0 of ``meta``)."""
    (k,) = kernels
    meta, logits, out = bufs
    rec.dispatch(k, [meta, logits, out], RowGatherPush(rows, vocab, vocab, 0), k.groups_for(rows))
    return 1


def time_tail(dev, record_fn, kernels, bufs, rows: int, vocab: int, chunks: int, reps: int) -> float:
    """Median GPU µs of one tail (``record`` or ``record_argmax``) over ``reps`` recorded back to back."""
    rec = CommandRecorder(dev, timestamps=True, max_commands=2 * reps + 1).begin()
    per = 0
    for _ in range(reps):
        per = record_fn(rec, kernels, bufs, rows, vocab, chunks)
    rec.end()
    rec.submit()
    rec.submit()
    ns = [t for _, t in rec.gpu_times()["commands"]]
    rec.close()
    return float(np.median([sum(ns[i : i + per]) for i in range(0, len(ns), per)])) / 1e3


def check(dev, kernels, bufs, host: np.ndarray, chunks: int) -> None:
    """The configuration's ids equal numpy's for every row (raises otherwise)."""
    rows, vocab = host.shape
    rec = CommandRecorder(dev).begin()
    record(rec, kernels, bufs, rows, vocab, chunks)
    rec.end()
    rec.submit()
    rec.close()
    got = bufs[1].array(np.uint32)[: rows * K].reshape(rows, K)
    want = np.stack([np.lexsort((np.arange(vocab), -r))[:K] for r in host])
    if not np.array_equal(got, want):
        raise SystemExit(f"chunks {chunks}, rows {rows}: topk ids differ from numpy's")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--vocab", type=int, default=262_144)
    ap.add_argument("--rows", default="1,8,16,32,64")
    ap.add_argument("--chunks", default="1,4,8,16,32,64,128", help="top-k first-stage chunks a row")
    ap.add_argument("--argmax-chunks", default="1,16,32,64,128,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = Device(args.device)
    kernels = (Kernel(dev, "topk_f32"), Kernel(dev, "topk_merge_f32"))
    argmax = tuple(Kernel(dev, f"argmax{v}_f32") for v in ("", "_chunks", "_merge"))
    lse = tuple(Kernel(dev, f"row_lse{v}_f32") for v in ("", "_chunks", "_merge"))
    gather = (Kernel(dev, "row_gather_f32"),)
    rows_list = [int(r) for r in args.rows.split(",")]
    vocab, big = args.vocab, max(rows_list)
    chunk_counts = [int(c) for c in f"{args.chunks},{args.argmax_chunks}".split(",")]
    n_max = max(-(-vocab // topk_chunk(vocab, c)) for c in chunk_counts) * K
    logits = create_buffer(dev, 4 * big * vocab, "device", "logits")
    ids, vals = (create_buffer(dev, 4 * big * K, "readback", n) for n in ("ids", "values"))
    c_ids, c_vals = (create_buffer(dev, 4 * big * n_max, "device", n) for n in ("chunk ids", "chunk values"))
    out = create_buffer(dev, 4 * big, "readback", "argmax")
    host = (np.random.default_rng().standard_normal((big, vocab)) * 3).astype(np.float32)
    targets = np.random.default_rng().integers(0, vocab, big)
    meta = create_buffer(dev, 4 * big, "device", "targets")
    up = Uploader(dev)
    up.upload(logits, host)
    up.upload(meta, (targets + 1).astype(np.uint32))  # the metadata's words: 1 + the id
    up.flush()
    bufs = [logits, ids, vals, c_ids, c_vals]
    res = {"device": dev.describe()["name"], "driver": dev.info.driver, "vocab": vocab, "k": K, "runs": []}
    print(f"{res['device']} ({res['driver']}), vocab {vocab}, k {K}", flush=True)
    for rows in rows_list:
        line = {"rows": rows}
        for chunks in map(int, args.argmax_chunks.split(",")):
            bufs_a = [logits, out, c_ids, c_vals]
            us = time_tail(dev, record_argmax, argmax, bufs_a, rows, vocab, chunks, args.reps)
            got = out.array(np.uint32)[:rows]
            if not np.array_equal(got, np.argmax(host[:rows], axis=1)):
                raise SystemExit(f"argmax chunks {chunks}, rows {rows}: ids differ from numpy's")
            line[f"argmax_us_chunks{chunks}"] = us
        bufs_l = [logits, out, c_ids, c_vals]
        line["lse_us"] = time_tail(dev, record_lse, lse, bufs_l, rows, vocab, ARGMAX_CHUNKS, args.reps)
        x = host[:rows].astype(np.float64)
        want = x.max(axis=1) + np.log(np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1))
        if not np.allclose(out.array(np.float32)[:rows], want, rtol=1e-5):
            raise SystemExit(f"lse, rows {rows}: values differ from numpy's")
        line["gather_us"] = time_tail(
            dev, record_gather, gather, [meta, logits, out], rows, vocab, 1, args.reps
        )
        if not np.array_equal(out.array(np.float32)[:rows], host[np.arange(rows), targets[:rows]]):
            raise SystemExit(f"gather, rows {rows}: values differ from numpy's")
        for chunks in map(int, args.chunks.split(",")):
            check(dev, kernels, bufs, host[:rows], chunks)
            line[f"topk_us_chunks{chunks}"] = time_tail(
                dev, record, kernels, bufs, rows, vocab, chunks, args.reps
            )
        res["runs"].append(line)
        print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in line.items()))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    for b in (*bufs, out, meta):
        b.arena.close()
    up.close()
    for k in (*kernels, *argmax, *lse, *gather):
        k.close()
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
