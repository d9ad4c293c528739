#!/usr/bin/env python3
"""Quantized mat-vec (and tiled mat-mat) bandwidth at a Gemma 3 27B-like shape, next to the copy ceiling.

Default shape: the 27B FFN up projection, K = 5376, N = 21504, Q4_K (65 MB of blocks). For each mat-vec
variant (shared-memory / subgroup reduction), workgroup size and token count T, records ``--iters``
dispatches with a timestamp after each, submits once to warm up and once measured, and reports the median
GPU time and the achieved bandwidth = weight bytes / GPU time (x and y are < 0.2 % of the traffic). The
ceiling is ``copy_vec4_x4`` (bench_vulkan_copy.py) over a buffer the size of W in the same run, reported as
(read + write) bytes / time as that bench does. ``--prefill T`` also times mul_mat_<type> (TFLOP/s).
A few rows of the T = 1 result are checked against the numpy dequantization.

    python3 bench/bench_vulkan_matmul.py --iters 20 --out result.json       # device machine
    python3 bench/bench_vulkan_matmul.py --n 2048 --iters 2 --prefill 64     # lavapipe smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

from bench_vulkan_copy import bench_variant  # noqa: E402

from hmad.backends.vulkan import kernels_matmul as km  # noqa: E402
from hmad.backends.vulkan.device import Device  # noqa: E402
from hmad.backends.vulkan.kernels_matmul import (  # noqa: E402
    COOPMAT_TILES,
    COOPMAT_TYPES,
    MATMUL_TYPES,
    UNIT_TYPES,
    coopmat_splits,
    coopmat_usable,
    record_coopmat,
    record_matmul,
    record_matvec_q8,
    record_row_scale,
    weight_row_bytes,
)
from hmad.backends.vulkan.memory import Uploader, create_buffer  # noqa: E402
from hmad.backends.vulkan.pipelines import CommandRecorder, Kernel, QuantizeQ8Push  # noqa: E402
from hmad.model.quants import dequantize, random_blocks  # noqa: E402


def median_gpu_ns(dev, iters: int, record_one, warm_s: float = 0.0) -> float:
    """Median GPU ns of one call: ``record_one(rec, i)`` records call i into ``rec`` and returns its dispatch
    count; the recording is submitted once to warm up (and again for ``warm_s`` seconds: the GPU clocks
    down while the host prepares), then once measured (a timestamp after each command)."""
    rec = CommandRecorder(dev, timestamps=True, max_commands=iters * 8).begin()
    per_call = 0
    for i in range(iters):
        per_call = record_one(rec, i)
    rec.end()
    rec.submit()  # warm-up
    t_end = time.perf_counter() + warm_s
    while time.perf_counter() < t_end:
        rec.submit()
    rec.submit()
    ns = np.array([v for _, v in rec.gpu_times()["commands"]]).reshape(iters, per_call).sum(axis=1)
    rec.close()
    return float(np.median(ns))


def time_kernel(dev, kernel, ws, x, y, k, n, t, iters) -> float:
    """Median GPU ns of one y = x · Wᵀ (summed over its bind ranges), ``ws`` copies of W used in turn (so
    that W is not in the L2 cache from the previous call)."""
    return median_gpu_ns(
        dev, iters, lambda rec, i: record_matmul(rec, kernel, ws[i % len(ws)], x, y, k, n, t)
    )


def time_q8(dev, kernel, ws, xq, xd, y, k, n, t, iters) -> float:
    """Median GPU ns of one int8 mat-vec (x already quantized), ``ws`` as in :func:`time_kernel`."""
    return median_gpu_ns(
        dev, iters, lambda rec, i: record_matvec_q8(rec, kernel, ws[i % len(ws)], xq, xd, y, k, n, t)
    )


def bench_q8(dev, args, w, x, y, k, n, copy_gbps) -> list[dict]:
    """The int8 mat-vecs at each T, next to the copy ceiling: x as three planes (``x3``, the exact path) and
    as one (``q8x``); x quantized once on the GPU first; ``_t1`` variants at T = 1."""
    t_max, out = 8, []
    for planes, x_name, quant_name in ((3, "x3", "quantize_x3"), (1, "q8x", "quantize_q8")):
        xq = create_buffer(dev, planes * t_max * k, "device")
        xd = create_buffer(dev, t_max * k // 32 * 8, "device")
        quant = Kernel(dev, quant_name)
        rec = CommandRecorder(dev).begin()
        rec.dispatch(quant, [x, xq, xd], QuantizeQ8Push(k, t_max, k), 64)
        rec.end()
        rec.submit()
        rec.close()
        tokens = list(map(int, args.tokens.split(",")))
        base = f"mul_mat_vec_{x_name}_{args.type}"
        for name, ts in ((base, tokens), (base + "_t1", [1])):
            kern = Kernel(dev, name)
            for t in ts:
                ns = time_q8(dev, kern, w, xq, xd, y, k, n, t, args.iters)
                nbytes = w[0].nbytes
                r = {
                    "variant": name,
                    "T": t,
                    "us": ns / 1e3,
                    "GBps": nbytes / ns,
                    "of_copy": nbytes / ns / copy_gbps,
                }
                out.append(r)
                pct = 100 * r["of_copy"]
                print(f"{name:28s} T={t}: {ns / 1e3:9.1f} us  {r['GBps']:8.1f} GB/s ({pct:.0f}% of copy)")
            kern.close()
        quant.close()
        xq.arena.close()
        xd.arena.close()
    return out


def bench_coopmat(dev, args, w, x, y, k, n, ts, copy_gbps) -> list[dict]:
    """mul_mm_coopmat_<type>_<BT>x<BN> (x as its float16 copy from row_scale) for every tile and T (K split
    as the backend would): TFLOP/s, and weight GB/s over the ceiling. ``w`` copies of W used in turn."""
    out = []
    part = create_buffer(dev, 256 << 20, "device", "partial sums")
    scale = create_buffer(dev, 4 * max(ts), "device", "row scales")
    xh = create_buffer(dev, 2 * k * max(ts), "device", "x float16")
    red, rs = Kernel(dev, "split_reduce"), Kernel(dev, "row_scale")
    rec = CommandRecorder(dev).begin()
    record_row_scale(rec, rs, x, scale, xh, k, max(ts))
    rec.end()
    rec.submit()
    rec.close()
    for bt, bn in COOPMAT_TILES:
        name = f"mul_mm_coopmat_{args.type}_{bt}x{bn}"
        kern = Kernel(dev, name)
        for t in ts:  # the row scales are made once per x: in the step, not per matmul

            def one(rec, i, kern=kern, t=t):
                return record_coopmat(rec, kern, red, w[i % len(w)], xh, y, scale, k, n, t, part)

            ns = median_gpu_ns(dev, args.iters, one)
            splits = coopmat_splits(k, n, t, (bt, bn))[0]
            r = {"kernel": name, "tile": [bt, bn], "T": t, "splits": splits, "us": ns / 1e3}
            r["TFLOPs"] = 2 * k * n * t / ns / 1e3
            r["GBps"] = w[0].nbytes / ns
            r["of_copy"] = r["GBps"] / copy_gbps
            out.append(r)
            print(
                f"{name:30s} T={t:4d} splits {splits:2d}: {ns / 1e3:8.1f} us {r['TFLOPs']:6.1f} TFLOP/s "
                f"weights {r['GBps']:7.1f} GB/s ({100 * r['of_copy']:.0f}% of copy)",
                flush=True,
            )
        kern.close()
    red.close()
    rs.close()
    for b in (part, scale, xh):
        b.arena.close()
    return out


def matvec_variants(t_name: str, tokens: list[int]) -> list[tuple[str, list[int]]]:
    """(float mat-vec variant, its token counts) of a weight type: the unit kernel (``_t1`` at T = 1) for
    quantized types, the shared / subgroup reductions for float ones."""
    if t_name not in UNIT_TYPES:
        return [(f"mul_mat_vec_{t_name}{s}", tokens) for s in ("", "_subgroup")]
    return [(f"mul_mat_vec_{t_name}", tokens), (f"mul_mat_vec_{t_name}_t1", [1])]


def check_rows(up, w_host, qtype, y, x, k, n) -> float:
    """Max error (relative to the output scale) of the first and last 32 rows of the T = 1 result."""
    rows = np.r_[0:32, n - 32 : n]
    ref = dequantize(w_host[rows], qtype, (len(rows), k)).astype(np.float64) @ x[0].astype(np.float64)
    got = up.download(y).view(np.float32)[:n][rows]
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--type", default="q4_k", choices=sorted(MATMUL_TYPES))
    ap.add_argument("--k", type=int, default=5376)
    ap.add_argument("--n", type=int, default=21504)
    ap.add_argument("--tokens", default="1,2,4,8", help="mat-vec token counts")
    ap.add_argument("--blocks", default="128,256", help="mat-vec workgroup sizes")
    ap.add_argument("--prefill", type=int, default=512, help="T of the mat-mat run (0: skip)")
    ap.add_argument(
        "--coopmat", default="16,32,64,128,512", help="T of the cooperative-matrix runs ('': skip)"
    )
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rotate", type=int, default=4, help="copies of W the mat-vec timings cycle through")
    ap.add_argument(
        "--coopmat-groups",
        default="",
        help="comma list of kernels_matmul.COOPMAT_TARGET_GROUPS values to time the coopmat GEMM with (how "
        "far K is split; default: the backend's)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = Device(args.device)
    qtype, k, n = MATMUL_TYPES[args.type], args.k, args.n
    rb = weight_row_bytes(qtype, k)
    w_host = np.ascontiguousarray(random_blocks(qtype, (n, k), np.random.default_rng(0))).view(np.uint8)
    w_host = w_host.reshape(n, rb)
    coop_ts = [int(v) for v in args.coopmat.split(",") if v]
    t_max = max(8, args.prefill, *coop_ts)
    x_host = np.random.default_rng(1).standard_normal((t_max, k)).astype(np.float32)
    up = Uploader(dev)
    w, x = create_buffer(dev, w_host.nbytes, "device", "W"), create_buffer(dev, x_host.nbytes, "device", "x")
    y = create_buffer(dev, t_max * n * 4, "device", "y")
    w.row_bytes = rb
    up.upload(w, w_host)
    ws = [w]  # copies of W used in turn by the mat-vec timings: together well past the L2 cache
    for _ in range(args.rotate - 1):
        ws.append(create_buffer(dev, w_host.nbytes, "device", "W copy"))
        ws[-1].row_bytes = rb
        up.upload(ws[-1], w_host)
    up.upload(x, x_host)
    up.flush()
    res = {"device": dev.describe()["name"], "type": args.type, "K": k, "N": n, "weight_bytes": w.nbytes}

    src, dst = (
        create_buffer(dev, w.nbytes // 4096 * 4096, "device"),
        create_buffer(dev, w.nbytes // 4096 * 4096),
    )
    copy = bench_variant(dev, "copy_vec4_x4", 256, src, dst, args.iters)
    res["copy_ceiling_GBps"] = copy["GBps"]
    print(
        f"{res['device']}: copy_vec4_x4 over {src.nbytes / 1e6:.0f} MB: {copy['GBps']:.1f} GB/s (read+write)"
    )

    res["matvec"] = []
    if args.type in UNIT_TYPES:
        res["matvec_q8"] = bench_q8(dev, args, ws, x, y, k, n, copy["GBps"])
    tokens = list(map(int, args.tokens.split(",")))
    for variant, ts in matvec_variants(args.type, tokens):
        for block in map(int, args.blocks.split(",")):
            kern = Kernel(dev, variant, block_size=block)
            for t in ts:
                ns = time_kernel(dev, kern, ws, x, y, k, n, t, args.iters)
                r = {"variant": variant, "block": block, "T": t, "us": ns / 1e3, "GBps": w.nbytes / ns}
                r["of_copy"] = r["GBps"] / copy["GBps"]
                res["matvec"].append(r)
                print(
                    f"{variant:26s} block {block:3d} T={t}: {ns / 1e3:9.1f} us  {r['GBps']:8.1f} GB/s "
                    f"({100 * r['of_copy']:.0f}% of copy)",
                    flush=True,
                )
                if t == 1:
                    r["max_err"] = check_rows(up, w_host, qtype, y, x_host, k, n)
                    assert r["max_err"] < 1e-4, r
            kern.close()
    if args.prefill:
        kern = Kernel(dev, f"mul_mat_{args.type}")
        ns = time_kernel(dev, kern, [w], x, y, k, n, args.prefill, max(1, args.iters // 2))
        res["matmul"] = {"T": args.prefill, "us": ns / 1e3, "TFLOPs": 2 * k * n * args.prefill / ns / 1e3}
        print(
            f"mul_mat_{args.type} T={args.prefill}: {ns / 1e3:.1f} us, {res['matmul']['TFLOPs']:.2f} TFLOP/s"
        )
        kern.close()
    if coop_ts and coopmat_usable(dev.info) and args.type in COOPMAT_TYPES:
        res["coopmat"] = []
        for groups in [int(g) for g in args.coopmat_groups.split(",") if g] or [km.COOPMAT_TARGET_GROUPS]:
            km.COOPMAT_TARGET_GROUPS = groups  # coopmat_splits reads it at each call
            print(f"coopmat GEMM, K split for about {groups} workgroups:")
            res["coopmat"] += [
                r | {"target_groups": groups}
                for r in bench_coopmat(dev, args, ws, x, y, k, n, coop_ts, copy["GBps"])
            ]
    best = max(res["matvec"], key=lambda r: r["GBps"])
    print(f"best mat-vec: {best['variant']} block {best['block']} T={best['T']}: {best['GBps']:.1f} GB/s")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    up.close()
    for b in (*ws, x, y, src, dst):
        b.arena.close()
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
