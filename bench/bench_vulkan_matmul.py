#!/usr/bin/env python3
"""Quantized mat-vec (and tiled mat-mat) bandwidth at a Gemma 3 27B-like shape, next to the copy ceiling.

Default shape: the 27B FFN up projection, K = 5376, N = 21504, Q4_K (65 MB of blocks). For each mat-vec
variant (shared-memory / subgroup reduction), workgroup size and token count T, records ``--iters``
dispatches with a timestamp after each, submits once to warm up and once measured, and reports the median
GPU time and the achieved bandwidth = weight bytes / GPU time (x and y are < 0.2 % of the traffic). The
ceiling is ``copy_vec4_x4`` (bench_vulkan_copy.py) over a buffer the size of W in the same run, reported as
(read + write) bytes / time as that bench does. ``--prefill T`` also times mul_mat_<type> (TFLOP/s).
A few rows of the T = 1 result are checked against the numpy dequantization.

``--coopmat-variants 512,32`` times only the Q4_K cooperative-matrix GEMMs instead: every layout built
(:data:`COOPMAT_TILES` and :data:`COOPMAT_Q4K_VARIANTS`, or those of ``--coopmat-kernels``) on each Gemma 3
27B matmul shape (:data:`SHAPES_27B`) at each T, K split as the backend would. Per shape and T the 64×128
kernel's output is checked on 64 rows against numpy (float64 products of the dequantized weights, within
:data:`NUMPY_TOL` of the output scale: float16 x and W), then every variant's whole output against it
(within :data:`VARIANT_TOL`: float32 sums in another order), its y poisoned first; a variant off by more is
reported as wrong and not timed, one whose shared memory the device lacks as skipped. Prints µs per call
and TFLOP/s, and per variant the sum over one layer's matmuls (:data:`LAYER_27B`), as a share of the
measured cooperative-matrix peak where ``--peak-json`` gives bench_vulkan_coopmat_peak.py's result.

    python3 bench/bench_vulkan_matmul.py --iters 20 --out result.json       # device machine
    python3 bench/bench_vulkan_matmul.py --n 2048 --iters 2 --prefill 64     # lavapipe smoke run
    python3 bench/bench_vulkan_matmul.py --coopmat-variants 512,32 --peak-json peak.json --out v.json
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

from hmad.backends.vulkan import kernels_coopmat as km  # noqa: E402
from hmad.backends.vulkan.device import Device  # noqa: E402
from hmad.backends.vulkan.kernels_coopmat import (  # noqa: E402
    COOPMAT_Q4K_VARIANTS,
    COOPMAT_TILES,
    COOPMAT_TYPES,
    coopmat_fits,
    coopmat_splits,
    coopmat_usable,
    coopmat_variant,
    record_coopmat,
    record_row_scale,
)
from hmad.backends.vulkan.kernels_matmul import MATMUL_TYPES, UNIT_TYPES, record_matmul, weight_row_bytes  # noqa: E402
from hmad.backends.vulkan.kernels_q8 import record_matvec_q8  # noqa: E402
from hmad.backends.vulkan.memory import Uploader, create_buffer  # noqa: E402
from hmad.backends.vulkan.pipelines import Kernel  # noqa: E402
from hmad.backends.vulkan.push import QuantizeQ8Push  # noqa: E402
from hmad.backends.vulkan.recorder import CommandRecorder  # noqa: E402
from hmad.backends.vulkan.residency import probe_residency  # noqa: E402
from hmad.core.quants import dequantize, random_blocks  # noqa: E402
from hmad.core.tensors import QType  # noqa: E402

#: Gemma 3 27B's matmuls (N rows, K) and how many of each a layer has
SHAPES_27B = {"gate/up": (21504, 5376), "down": (5376, 21504), "q": (4096, 5376), "k/v": (2048, 5376)}
SHAPES_27B["o"] = (5376, 4096)
LAYER_27B = {"gate/up": 2, "down": 1, "q": 1, "k/v": 2, "o": 1}
COOPMAT_REFERENCE = "mul_mm_coopmat_q4_k_64x128"  # the prefill's kernel: every variant is checked against it
NUMPY_TOL = 4e-3  # the reference against numpy, of the output scale (float16 x and W: 2^-11 each, K terms)
VARIANT_TOL = 1e-4  # a variant against the reference, of the output scale (float32 sums in another order)


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
        slots = split_slots(args, kern)
        for t in ts:  # the row scales are made once per x: in the step, not per matmul

            def one(rec, i, kern=kern, t=t, slots=slots):
                return record_coopmat(rec, kern, red, w[i % len(w)], xh, y, scale, k, n, t, part, slots=slots)

            ns = median_gpu_ns(dev, args.iters, one)
            splits = coopmat_splits(k, n, t, (bt, bn), slots=slots, row_bytes=w[0].row_bytes)[0]
            r = {"kernel": name, "tile": [bt, bn], "T": t, "splits": splits, "resident": slots}
            r["us"] = ns / 1e3
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


_RESIDENT: dict[str, int] = {}


def split_slots(args, kern) -> int:
    """The K split's residency for ``kern`` as the backend takes it (probed once; 0 with --coopmat-split
    target: the workgroup targets)."""
    if args.coopmat_split != "waves":
        return 0
    if kern.name not in _RESIDENT:
        _RESIDENT[kern.name] = probe_residency(kern)
        print(f"{kern.name}: {_RESIDENT[kern.name]} workgroups resident at once", flush=True)
    return _RESIDENT[kern.name]


def q4k_coopmat_kernels() -> list[str]:
    """Every Q4_K cooperative-matrix GEMM built: the first layout's tiles, then the Q4_K-only layouts."""
    names = [f"mul_mm_coopmat_q4_k_{bt}x{bn}" for bt, bn in COOPMAT_TILES]
    return names + [f"mul_mm_coopmat_q4_k_{v.suffix}" for v in COOPMAT_Q4K_VARIANTS]


class ShapeBuffers:
    """One weight shape's buffers for the variant runs: ``rotate`` copies of a random Q4_K W (n, k), x
    (t_max, k) with its row scales and float16 copy made once (row_scale), y for the reference and y for the
    variant under test, the partial-sum scratch."""

    def __init__(self, dev, up, n: int, k: int, t_max: int, rotate: int, rng):
        rb = weight_row_bytes(QType.Q4_K, k)
        self.n, self.k = n, k
        w = np.ascontiguousarray(random_blocks(QType.Q4_K, (n, k), rng))
        self.w_host = w.view(np.uint8).reshape(n, rb)
        self.x_host = rng.standard_normal((t_max, k)).astype(np.float32)
        self.ws = [create_buffer(dev, self.w_host.nbytes, "device", "W") for _ in range(rotate)]
        for w in self.ws:
            w.row_bytes = rb
            up.upload(w, self.w_host)
        self.x = create_buffer(dev, self.x_host.nbytes, "device", "x")
        up.upload(self.x, self.x_host)
        up.flush()
        self.scale = create_buffer(dev, 4 * t_max, "device", "row scales")
        self.xh = create_buffer(dev, 2 * k * t_max, "device", "x float16")
        self.y_ref, self.y = (create_buffer(dev, 4 * t_max * n, "device", "y") for _ in range(2))
        self.part = create_buffer(dev, 256 << 20, "device", "partial sums")
        rs = Kernel(dev, "row_scale")
        rec = CommandRecorder(dev).begin()
        record_row_scale(rec, rs, self.x, self.scale, self.xh, k, t_max)
        rec.end()
        rec.submit()
        rec.close()
        rs.close()

    def run(self, dev, kern, red, y, t: int, slots: int = 0) -> None:
        """y[:t] = x[:t] · Wᵀ once on ``kern`` (K split for whole waves of ``slots`` when given)."""
        rec = CommandRecorder(dev).begin()
        args = (self.ws[0], self.xh, y, self.scale, self.k, self.n, t, self.part)
        record_coopmat(rec, kern, red, *args, slots=slots)
        rec.end()
        rec.submit()
        rec.close()

    def close(self) -> None:
        for b in (*self.ws, self.x, self.scale, self.xh, self.y_ref, self.y, self.part):
            b.arena.close()


def numpy_error(sb: ShapeBuffers, y_ref: np.ndarray, t: int) -> float:
    """Max |y_ref - numpy| over the output scale on the first and last 32 rows of W, all t tokens."""
    rows = np.r_[0:32, sb.n - 32 : sb.n]
    w = dequantize(sb.w_host[rows], QType.Q4_K, (len(rows), sb.k)).astype(np.float64)
    ref = sb.x_host[:t].astype(np.float64) @ w.T
    got = y_ref.reshape(t, sb.n)[:, rows]
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def variant_error(up, sb: ShapeBuffers, y_ref: np.ndarray, t: int) -> float:
    """Max |y - y_ref| over the output scale (inf where y holds a NaN: an element not written)."""
    got = up.download(sb.y).view(np.float32)[: t * sb.n]
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.abs(got - y_ref).max() / np.abs(y_ref).max())


def time_variant(dev, args, sb: ShapeBuffers, kern, red, t: int) -> dict:
    """Median GPU time of one call of ``kern`` (W copies used in turn), as µs and TFLOP/s."""

    slots = split_slots(args, kern)

    def one(rec, i):
        w = sb.ws[i % len(sb.ws)]
        return record_coopmat(rec, kern, red, w, sb.xh, sb.y, sb.scale, sb.k, sb.n, t, sb.part, slots=slots)

    ns = median_gpu_ns(dev, args.iters, one)
    tile = coopmat_variant(kern.name)[1]
    splits = coopmat_splits(sb.k, sb.n, t, (tile.bt, tile.bn), slots=slots, row_bytes=sb.ws[0].row_bytes)[0]
    return {"splits": splits, "resident": slots, "us": ns / 1e3, "TFLOPs": 2 * sb.k * sb.n * t / ns / 1e3}


def bench_coopmat_variants(dev, args) -> dict:
    """Every Q4_K coopmat layout on the 27B shapes at each T of ``args.coopmat_variants``: checked against the
    64×128 kernel (itself against numpy), then timed; per variant and T the sum over one layer's matmuls."""
    ts = [int(v) for v in args.coopmat_variants.split(",")]
    names = [v for v in args.coopmat_kernels.split(",") if v] or q4k_coopmat_kernels()
    res: dict = {"T": ts, "kernels": names, "rows": [], "skipped": {}, "wrong": []}
    for name in names:
        if not coopmat_fits(name, dev.limits):
            res["skipped"][name] = f"{coopmat_variant(name)[1].shared_bytes()} B of shared memory"
            print(f"{name}: skipped, {res['skipped'][name]} > {dev.limits['maxComputeSharedMemorySize']}")
    kerns = {}
    for name in dict.fromkeys([COOPMAT_REFERENCE, *names]):
        try:
            kerns[name] = Kernel(dev, name) if name not in res["skipped"] else None
        except Exception as e:  # e.g. a pipeline the driver refuses (its shared memory at the limit)
            res["skipped"][name] = f"pipeline not created: {e}"
            print(f"{name}: skipped, {res['skipped'][name]}")
    kerns = {n: k for n, k in kerns.items() if k is not None}
    red, up, rng = Kernel(dev, "split_reduce"), Uploader(dev), np.random.default_rng(0)
    for label, (n, k) in SHAPES_27B.items():
        sb = ShapeBuffers(dev, up, n, k, max(ts), args.rotate, rng)
        for t in ts:
            sb.run(dev, kerns[COOPMAT_REFERENCE], red, sb.y_ref, t)
            y_ref = up.download(sb.y_ref).view(np.float32)[: t * n]
            err = numpy_error(sb, y_ref, t)
            print(f"{label} N={n} K={k} T={t}: {COOPMAT_REFERENCE} against numpy {err:.1e}", flush=True)
            if not err <= NUMPY_TOL:
                raise SystemExit(f"{COOPMAT_REFERENCE} is off numpy by {err:.1e} of the output scale")
            rows = [check_and_time(dev, args, up, sb, y_ref, kerns[v], red, t) for v in names if v in kerns]
            for r in reversed([r for r in rows if "us" in r]):  # again in the opposite order: the faster kept
                again = time_variant(dev, args, sb, kerns[r["kernel"]], red, t)
                r |= again if again["us"] < r["us"] else {}
            for r in rows:
                res["rows" if "us" in r else "wrong"].append(r | {"shape": label})
        sb.close()
    peak = json.loads(Path(args.peak_json).read_text())["peak_tflops"] if args.peak_json else None
    res["layer"], res["peak_tflops"] = layer_totals(res["rows"], peak), peak
    for kern in (*kerns.values(), red):
        kern.close()
    up.close()
    return res


def check_and_time(dev, args, up, sb: ShapeBuffers, y_ref: np.ndarray, kern, red, t: int) -> dict:
    """One variant at one shape and T: its output (y poisoned first) against the reference's ``y_ref``,
    then, unless it is off by more than VARIANT_TOL, its time."""
    up.upload(sb.y, np.full(t * sb.n, np.nan, np.float32))
    up.flush()
    sb.run(dev, kern, red, sb.y, t, split_slots(args, kern))
    r = {"N": sb.n, "K": sb.k, "T": t, "kernel": kern.name, "error": variant_error(up, sb, y_ref, t)}
    if not r["error"] <= VARIANT_TOL:
        print(f"  {kern.name:42s} WRONG: {r['error']:.1e} of the output scale off the reference", flush=True)
        if not args.time_wrong:
            return r
    r |= time_variant(dev, args, sb, kern, red, t)
    print(
        f"  {kern.name:42s} T={t:4d} splits {r['splits']:2d}: {r['us']:8.1f} us {r['TFLOPs']:6.1f} TFLOP/s "
        f"(error {r['error']:.1e})",
        flush=True,
    )
    return r


def layer_totals(rows: list[dict], peak: float | None = None) -> list[dict]:
    """Per kernel and T with every shape measured: µs of one 27B layer's matmuls (LAYER_27B), TFLOP/s and
    their share of ``peak`` TFLOP/s (the measured cooperative-matrix peak) when given."""
    out = []
    for name, t in dict.fromkeys((r["kernel"], r["T"]) for r in rows):
        mine = {r["shape"]: r for r in rows if r["kernel"] == name and r["T"] == t}
        if set(mine) != set(LAYER_27B):
            continue
        us = sum(LAYER_27B[s] * r["us"] for s, r in mine.items())
        flop = sum(LAYER_27B[s] * 2 * r["N"] * r["K"] * t for s, r in mine.items())
        out.append({"kernel": name, "T": t, "us": us, "TFLOPs": flop / us / 1e6})
        if peak:
            out[-1]["of_peak"] = out[-1]["TFLOPs"] / peak
    for r in sorted(out, key=lambda r: (r["T"], r["us"])):
        share = f" ({100 * r['of_peak']:.1f} % of the {peak:.0f} TFLOP/s peak)" if peak else ""
        print(f"layer T={r['T']:4d} {r['kernel']:42s} {r['us']:9.1f} us {r['TFLOPs']:6.1f} TFLOP/s{share}")
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
        help="comma list of kernels_coopmat.COOPMAT_TARGET_GROUPS values to time the coopmat GEMM with (how "
        "far K is split; default: the backend's)",
    )
    ap.add_argument(
        "--coopmat-variants",
        default="",
        help="T list: time only the Q4_K coopmat GEMM layouts on the 27B shapes (module docstring)",
    )
    ap.add_argument("--coopmat-kernels", default="", help="with --coopmat-variants: these kernels only")
    ap.add_argument(
        "--coopmat-split",
        default="waves",
        choices=("waves", "target"),
        help="the coopmat GEMM's K split: for whole waves of the kernel's probed residency (the backend's), "
        "or for about --coopmat-groups workgroups",
    )
    ap.add_argument(
        "--time-wrong",
        action="store_true",
        help="with --coopmat-variants: time variants whose output is off too (ablation builds swapped in by "
        "HMAD_SHADER_DIR: what a kernel's time is made of)",
    )
    ap.add_argument("--peak-json", default="", help="bench_vulkan_coopmat_peak.py's --out (coopmat variants)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = Device(args.device)
    if args.coopmat_variants:
        if not coopmat_usable(dev.info):
            dev.close()
            raise SystemExit(f"{dev.info.name}: no float16 cooperative matrix with 32-wide subgroups")
        res = {"device": dev.describe()["name"]} | bench_coopmat_variants(dev, args)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
        dev.close()
        return 1 if res["wrong"] else 0
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
