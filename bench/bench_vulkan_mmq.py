#!/usr/bin/env python3
"""The exact int8 cooperative-matrix GEMM (mul_mmq_coopmat.comp) beside the x3 mat-vec, on the 27B's shapes.

For each Gemma 3 27B matmul shape (Q4_K, random blocks) and T in --tokens: x ~ N(0, 1) with a few large
values (Gemma's activations have them), quantized to the three int8 planes on the GPU (quantize_x3, as the
backend's ops do); every mmq layout the device can run is checked against float64 products of the
dequantized weights (within :data:`TOL` of the output scale; y poisoned with NaN first, so an unwritten
element fails) and against the x3 mat-vec's output at T <= 8, then timed (median GPU time, W rotating over
copies past the L2) beside the mat-vec in the backend's layout (T <= 8: one dispatch; more: 8-token
dispatches, as the backend would without the GEMM).

    python3 bench/bench_vulkan_mmq.py --out bench/results/<date>-<device>-mmq.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vulkan_copy import bench_variant  # noqa: E402
from bench_vulkan_matmul import median_gpu_ns  # noqa: E402

from hmad.backends.vulkan import kernels_mmq as kq  # noqa: E402
from hmad.backends.vulkan import kernels_q8 as km  # noqa: E402
from hmad.backends.vulkan.device import Device  # noqa: E402
from hmad.backends.vulkan.kernels_matmul import weight_row_bytes  # noqa: E402
from hmad.backends.vulkan.memory import BufferView, Uploader, create_buffer  # noqa: E402
from hmad.backends.vulkan.pipelines import Kernel  # noqa: E402
from hmad.backends.vulkan.push import QuantizeQ8Push  # noqa: E402
from hmad.backends.vulkan.recorder import CommandRecorder  # noqa: E402
from hmad.core.quants import dequantize, random_blocks  # noqa: E402
from hmad.core.tensors import QType  # noqa: E402

#: (name, N, K) of the 27B's matmuls; a layer has q, k, v (fused as QKV: 8192 rows), o, gate, up, down
SHAPES = [("qkv", 8192, 5376), ("o", 5376, 4096), ("gate", 21504, 5376), ("down", 5376, 21504)]
LAYER = {"qkv": 1, "o": 1, "gate": 2, "down": 1}
TOL = 2e-6  # of the output scale: float32 roundings of K / 32 block terms (the x3 mat-vec's class)


def submit(dev, fn) -> None:
    rec = CommandRecorder(dev).begin()
    fn(rec)
    rec.end()
    rec.submit()
    rec.close()


class Case:
    """One shape's buffers: W copies (rotating past the L2), x and its planes, y, the partial sums."""

    def __init__(self, dev, up, quant, name, n, k, t_max, rng, rotate_bytes):
        self.name, self.n, self.k, self.t_max = name, n, k, t_max
        rb = weight_row_bytes(QType.Q4_K, k)
        host = np.ascontiguousarray(random_blocks(QType.Q4_K, (n, k), rng)).view(np.uint8).reshape(n, rb)
        self.wref = dequantize(host.reshape(-1), QType.Q4_K, (n, k)).astype(np.float64)
        self.nbytes = host.nbytes
        self.ws = []
        for i in range(max(2, -(-rotate_bytes // host.nbytes))):
            w = create_buffer(dev, host.nbytes, "device", f"{name} W{i}")
            w.row_bytes = rb
            up.upload(w, host)
            self.ws.append(w)
        x = rng.standard_normal((t_max, k)).astype(np.float32)
        x[:, rng.integers(0, k, 4)] *= 40.0  # a few large activations
        self.x = x
        bx = create_buffer(dev, x.nbytes, "device")
        up.upload(bx, x)
        up.flush()
        self.xq = create_buffer(dev, 3 * t_max * k, "device")
        self.xd = create_buffer(dev, t_max * k // 32 * 8, "device")
        self.y = create_buffer(dev, t_max * n * 4, "device")
        self.part = create_buffer(dev, 64 * t_max * n * 4, "device")
        submit(dev, lambda rec: rec.dispatch(quant, [bx, self.xq, self.xd], QuantizeQ8Push(k, t_max, k), 64))
        bx.arena.close()
        self.ref = x.astype(np.float64) @ self.wref.T  # (t_max, n)

    def poison(self, up) -> None:
        up.upload(self.y, np.full(self.t_max * self.n, np.nan, np.float32))
        up.flush()

    def result(self, up, t: int) -> np.ndarray:
        return up.download(self.y).view(np.float32)[: t * self.n].reshape(t, self.n)

    def close(self) -> None:
        for b in (*self.ws, self.xq, self.xd, self.y, self.part):
            b.arena.close()


def matvec_name(t: int, n: int, k: int) -> str:
    return "mul_mat_vec_x3_q4_k" + km.q8_matvec_layout(min(t, 8), n, k) + ("_t1" if t == 1 else "")


def sub(v: BufferView, offset: int, nbytes: int) -> BufferView:
    return BufferView(v.arena, v.offset + offset, nbytes)


def record_matvec(rec, kern, c: Case, w, t: int) -> int:
    """The x3 mat-vec over t tokens, 8 a dispatch (the backend's MATVEC_MAX_T)."""
    count = 0
    for t0 in range(0, t, 8):
        tt = min(8, t - t0)
        xq = sub(c.xq, t0 * 3 * c.k, tt * 3 * c.k)
        xd = sub(c.xd, t0 * c.k // 32 * 8, tt * c.k // 32 * 8)
        y = sub(c.y, t0 * c.n * 4, tt * c.n * 4)
        count += km.record_matvec_q8(rec, kern, w, xq, xd, y, c.k, c.n, tt)
    return count


def errors(got: np.ndarray, ref: np.ndarray) -> dict:
    scale = float(np.abs(ref).max())
    bad = ~np.isfinite(got)
    err = np.where(bad, np.inf, np.abs(got - ref)) / scale
    out = {"max_err": float(err.max()), "nonfinite": int(bad.sum())}
    if out["max_err"] > TOL:
        t, r = np.unravel_index(int(np.argmax(err)), err.shape)
        out["worst"] = {"token": int(t), "row": int(r), "got": float(got[t, r]), "ref": float(ref[t, r])}
        out["wrong_share"] = float((err > TOL).mean())
    return out


def record(rec, kern, reduce, c: Case, w, t: int, target: int = kq.MMQ_TARGET_GROUPS) -> int:
    """One product of t tokens on ``kern``: the mat-vec (8 tokens a dispatch) or an mmq kernel (K split
    for about ``target`` workgroups)."""
    if kern.name.startswith("mul_mat_vec"):
        return record_matvec(rec, kern, c, w, t)
    return kq.record_mmq(rec, kern, reduce, w, c.xq, c.xd, c.y, c.k, c.n, t, c.part, target=target)


def check(dev, up, kern, reduce, c: Case, t: int, y_mv=None) -> tuple[dict, np.ndarray]:
    """``kern``'s errors at t tokens (y poisoned first), against float64 and the mat-vec's ``y_mv``."""
    c.poison(up)
    submit(dev, lambda rec: record(rec, kern, reduce, c, c.ws[0], t))
    y = c.result(up, t)
    e = errors(y, c.ref[:t])
    if y_mv is not None:
        e["vs_matvec"] = float(np.abs(y - y_mv).max() / np.abs(c.ref[:t]).max())
    return e, y


def run_case(dev, up, c: Case, mmq_names, reduce, tokens, args, copy_gbps) -> list[dict]:
    rows = []
    for t in tokens:
        kerns = [Kernel(dev, matvec_name(t, c.n, c.k))] + [Kernel(dev, n) for n in mmq_names]
        e, y_mv = check(dev, up, kerns[0], reduce, c, t)
        errs = [e] + [check(dev, up, kern, reduce, c, t, y_mv)[0] for kern in kerns[1:]]
        cases = [(kerns[0], errs[0], 0)]
        cases += [(kern, e, g) for kern, e in zip(kerns[1:], errs[1:], strict=True) for g in args.targets]
        for kern, e, target in cases:
            ws = c.ws

            def one(rec, i, kern=kern, ws=ws, t=t, target=target):
                return record(rec, kern, reduce, c, ws[i % len(ws)], t, target)

            a = median_gpu_ns(dev, args.iters, one, args.warm_s)
            b = median_gpu_ns(dev, args.iters, one, args.warm_s)
            ns = min(a, b)
            gbps = c.nbytes / ns
            name = kern.name + (f"@{target}" if len(args.targets) > 1 and target else "")
            r = {"shape": c.name, "N": c.n, "K": c.k, "T": t, "kernel": name, "us": ns / 1e3}
            r |= {"us_both": [a / 1e3, b / 1e3], "GBps": gbps, "of_copy": gbps / copy_gbps, **e}
            if kern.name.startswith("mul_mmq"):
                r["splits"] = kq.mmq_splits(c.k, c.n, t, kq.mmq_tile(kern.name), target)[0]
                r["target_groups"] = target
            rows.append(r)
            ok = "ok" if e["max_err"] <= TOL else f"WRONG {e.get('worst')}"
            print(
                f"{c.name:5s} T={t:2d} {name:39s} {r['us']:8.1f} us {gbps:6.0f} GB/s "
                f"({100 * r['of_copy']:3.0f}%)  err {e['max_err']:.1e} {ok}",
                flush=True,
            )
        for kern in kerns:
            kern.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--tokens", default="1,8,16,32")
    ap.add_argument("--shapes", default="", help="comma list of shape names (default: all)")
    ap.add_argument("--kernels", default="", help="comma list of mmq kernels (default: all the device runs)")
    ap.add_argument("--targets", default=str(kq.MMQ_TARGET_GROUPS), help="K split for ~these workgroups")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warm-s", type=float, default=0.2)
    ap.add_argument("--rotate-mb", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = Device(args.device)
    mk = kq.mmq_shape_k(dev.info)
    shapes16 = [s for s in dev.info.coopmat_shapes if "8" in s.get("A", "")]
    print(f"{dev.describe()['name']}: int8 coopmat shapes {shapes16}, K picked {mk}", flush=True)
    if mk is None:
        print("no int8 16x16 cooperative matrix on this device: nothing to run")
        return 0
    n8 = kq.mmq_has_n8(dev.info, mk)
    names = [kq.mmq_kernel_name(*lay) for lay in kq.MMQ_LAYOUTS if lay[2] == mk and (lay[4] == 16 or n8)]
    if args.kernels:
        names = args.kernels.split(",")
    up = Uploader(dev)
    src, dst = create_buffer(dev, 64 << 20, "device"), create_buffer(dev, 64 << 20, "device")
    copy = bench_variant(dev, "copy_vec4_x4", 256, src, dst, 20)
    res = {"device": dev.describe()["name"], "copy_ceiling_GBps": copy["GBps"], "tol": TOL, "rows": []}
    print(f"copy_vec4_x4 over 64 MiB {copy['GBps']:.0f} GB/s", flush=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    args.targets = [int(g) for g in args.targets.split(",")]
    quant, reduce = Kernel(dev, "quantize_x3"), Kernel(dev, "split_reduce")
    rng = np.random.default_rng(1)
    wanted = set(filter(None, args.shapes.split(",")))
    for name, n, k in SHAPES:
        if wanted and name not in wanted:
            continue
        c = Case(dev, up, quant, name, n, k, max(tokens), rng, args.rotate_mb << 20)
        res["rows"] += run_case(dev, up, c, names, reduce, tokens, args, copy["GBps"])
        c.close()
    # per kernel and T: one layer's matmuls (LAYER) in µs
    layer: dict[tuple[str, int], float] = {}
    for r in res["rows"]:
        key = ("matvec" if r["kernel"].startswith("mul_mat_vec") else r["kernel"], r["T"])
        layer[key] = layer.get(key, 0.0) + LAYER[r["shape"]] * r["us"]
    res["layer_us"] = [{"kernel": k, "T": t, "us": us} for (k, t), us in sorted(layer.items())]
    for (k, t), us in sorted(layer.items(), key=lambda kv: (kv[0][1], kv[1])):
        print(f"layer T={t:2d} {k:39s} {us:8.1f} us", flush=True)
    res["wrong"] = [r for r in res["rows"] if r["max_err"] > TOL]
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    quant.close()
    reduce.close()
    up.close()
    for b in (src, dst):
        b.arena.close()
    dev.close()
    return 1 if res["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
