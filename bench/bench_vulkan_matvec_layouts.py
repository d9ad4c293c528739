#!/usr/bin/env python3
"""The int8 mat-vec's layouts on each layer shape of the Gemma 3 27B and 270M, next to the copy ceiling.

mul_mat_vec_q8.comp is built in several layouts (kernels_q8.Q8_LAYOUTS: rows per lane group, lane
groups splitting K); the backend picks one per step by ``q8_matvec_layout(t, n, k)``. This times every
layout on the models' weight shapes at one token (the ``_t1`` variants) and at 8, with x as three planes
(the exact path, ``--planes 3``) or one, and says per case which layout was fastest and which the backend
picks. Each timing follows ~0.2 s of the same calls back to back, and every case is timed twice, in
opposite orders, the lower time kept (both are in the JSON): on an H200 the first timings after a shape's
weights were uploaded read up to 5x too slow, warm-up or not. W rotates over copies past the L2.
Each variant's T = 1 output is checked against float64 (gelu(g) * u for the GeGLU shapes).

    python3 bench/bench_vulkan_matvec_layouts.py --out bench/results/<date>-<device>-matvec-layouts.json
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

from hmad.backends.vulkan import kernels_q8 as km  # noqa: E402
from hmad.backends.vulkan.device import Device  # noqa: E402
from hmad.backends.vulkan.kernels_matmul import weight_row_bytes  # noqa: E402
from hmad.backends.vulkan.memory import Uploader, create_buffer  # noqa: E402
from hmad.backends.vulkan.pipelines import Kernel  # noqa: E402
from hmad.backends.vulkan.push import QuantizeQ8Push  # noqa: E402
from hmad.backends.vulkan.recorder import CommandRecorder  # noqa: E402
from hmad.core.quants import dequantize, random_blocks  # noqa: E402
from hmad.core.tensors import QType  # noqa: E402

#: (name, weight type, K, N, GeGLU): the weights of one layer (bench_vulkan_model.py's synthetic types)
SHAPES = [
    ("27b_qkv", "q4_k", 5376, 8192, False),
    ("27b_o", "q4_k", 4096, 5376, False),
    ("27b_gate_up", "q4_k", 5376, 21504, True),
    ("27b_down", "q4_k", 21504, 5376, False),
    ("270m_q", "q5_0", 640, 1024, False),
    ("270m_o", "q4_k", 1024, 640, False),
    ("270m_gate_up", "q5_0", 640, 2048, True),
    ("270m_down", "q6_k", 2048, 640, False),
]
T_MAX = 8


def reference(x: np.ndarray, w: list[np.ndarray], geglu: bool) -> np.ndarray:
    """Row 0 of x · Wᵀ in float64, or gelu_tanh(x · Gᵀ) * (x · Uᵀ)."""
    g = x[:1].astype(np.float64) @ w[0].T
    if not geglu:
        return g[0]
    gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
    return (gelu * (x[:1].astype(np.float64) @ w[1].T))[0]


class Shape:
    """One shape's buffers on the GPU: W copies (a rotation past the L2), x quantized, y."""

    def __init__(self, dev, up, quant, planes, shape, rng, rotate_bytes):
        self.name, tname, self.k, self.n, self.geglu = shape
        self.qtype, k, n = QType[tname.upper()], self.k, self.n
        rb = weight_row_bytes(self.qtype, k)
        host = [
            np.ascontiguousarray(random_blocks(self.qtype, (n, k), rng)).view(np.uint8).reshape(n, rb)
            for _ in range(2)
        ]
        self.wref = [dequantize(h.reshape(-1), self.qtype, (n, k)).astype(np.float64) for h in host]
        self.nbytes = host[0].nbytes * (2 if self.geglu else 1)
        self.ws = []
        for i in range(max(4, -(-rotate_bytes // host[0].nbytes))):
            w = create_buffer(dev, host[0].nbytes, "device", f"{self.name} W{i}")
            w.row_bytes = rb
            up.upload(w, host[i % 2])
            self.ws.append(w)
        self.x = rng.standard_normal((T_MAX, k)).astype(np.float32)
        bx = create_buffer(dev, self.x.nbytes, "device")
        up.upload(bx, self.x)
        up.flush()
        self.xq = create_buffer(dev, planes * T_MAX * k, "device")
        self.xd = create_buffer(dev, T_MAX * k // 32 * 8, "device")
        self.y = create_buffer(dev, T_MAX * n * 4, "device")
        rec = CommandRecorder(dev).begin()
        rec.dispatch(quant, [bx, self.xq, self.xd], QuantizeQ8Push(k, T_MAX, k), 64)
        rec.end()
        rec.submit()
        rec.close()
        bx.arena.close()

    def record(self, rec, kern, i: int, t: int) -> int:
        ws, c = self.ws, len(self.ws)
        up = ws[(i + 1) % c] if self.geglu else None
        return km.record_matvec_q8(rec, kern, ws[i % c], self.xq, self.xd, self.y, self.k, self.n, t, w_up=up)

    def close(self) -> None:
        for b in (*self.ws, self.xq, self.xd, self.y):
            b.arena.close()


def time_case(dev, up, sh: Shape, ref, name: str, t: int, args) -> dict:
    """One variant at ``t`` tokens: its row-0 error (T = 1 outputs of the rotation's first W) and time."""
    kern = Kernel(dev, name)
    rec = CommandRecorder(dev).begin()
    sh.record(rec, kern, 0, t)
    rec.end()
    rec.submit()
    rec.close()
    y0 = up.download(sh.y).view(np.float32)[: sh.n]
    ns = median_gpu_ns(dev, args.iters, lambda rec, i: sh.record(rec, kern, i, t), args.warm_s)
    kern.close()
    return {"ns": ns, "max_err_over_max_ref": float(np.abs(y0 - ref).max() / np.abs(ref).max())}


def run_shape(dev, up, sh: Shape, x_name: str, args, copy_gbps: float) -> list[dict]:
    """Every layout at 1 and 8 tokens, timed twice in opposite orders; the lower time is the figure (the
    first timings after a shape's upload can read several times too slow, whatever the warm-up)."""
    base = f"mul_mat_vec_{x_name}_{sh.qtype.name.lower()}" + ("_geglu" if sh.geglu else "")
    ref = reference(sh.x, sh.wref, sh.geglu)
    lays = [lay for lay, (nr, _) in km.Q8_LAYOUTS.items() if nr == 2 or not sh.geglu]  # GeGLU: NR 2 only
    cases = [(1, lay) for lay in km.Q8_T1_LAYOUTS] + [(T_MAX, lay) for lay in lays]
    built = set(km.q8_matvec_suffixes(sh.qtype.name.lower()))  # (some layouts: some types only)
    geglu = "_geglu" if sh.geglu else ""
    cases = [(t, lay) for t, lay in cases if f"{geglu}{lay}{'_t1' if t == 1 else ''}" in built]
    runs: dict[tuple[int, str], list[dict]] = {c: [] for c in cases}
    for t, lay in cases + cases[::-1]:
        runs[t, lay].append(time_case(dev, up, sh, ref, base + lay + ("_t1" if t == 1 else ""), t, args))
    rows = []
    for (t, lay), (a, b) in runs.items():
        ns = min(a["ns"], b["ns"])
        gbps = sh.nbytes / ns
        r = {"shape": sh.name, "type": sh.qtype.name, "K": sh.k, "N": sh.n, "T": t, "layout": lay}
        r |= {"us": ns / 1e3, "us_both": [a["ns"] / 1e3, b["ns"] / 1e3]}
        r |= {"GBps": gbps, "of_copy": gbps / copy_gbps}
        r["max_err_over_max_ref"] = max(a["max_err_over_max_ref"], b["max_err_over_max_ref"])
        rows.append(r)
    for t in (1, T_MAX):
        best = min((r for r in rows if r["T"] == t), key=lambda r: r["us"])
        pick = km.q8_matvec_layout(t, sh.n, sh.k, geglu=sh.geglu)
        for r in (r for r in rows if r["T"] == t):
            r["fastest"], r["picked"] = r is best, r["layout"] == pick
            tag = ("fastest " if r["fastest"] else "") + ("picked" if r["picked"] else "")
            print(
                f"{sh.name:13s} T={t} {r['layout'] or '(default)':9s} {r['us']:8.1f} us "
                f"{r['GBps']:7.0f} GB/s ({100 * r['of_copy']:3.0f}%)  (passes {r['us_both'][0]:.1f}, "
                f"{r['us_both'][1]:.1f})  err {r['max_err_over_max_ref']:.0e}  {tag}",
                flush=True,
            )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--planes", type=int, default=3, choices=(1, 3), help="3: the exact path, 1: int8")
    ap.add_argument("--shapes", default="", help="comma list of shape names (default: all)")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--warm-s", type=float, default=0.2)
    ap.add_argument("--rotate-mb", type=int, default=300, help="MB of W copies the timings cycle through")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = Device(args.device)
    up = Uploader(dev)
    src, dst = create_buffer(dev, 64 << 20, "device"), create_buffer(dev, 64 << 20, "device")
    copy = bench_variant(dev, "copy_vec4_x4", 256, src, dst, 20)
    res = {"device": dev.describe()["name"], "copy_ceiling_GBps": copy["GBps"], "planes": args.planes}
    print(f"{res['device']}: copy_vec4_x4 over 64 MiB {copy['GBps']:.0f} GB/s", flush=True)
    x_name, quant = ("x3", "quantize_x3") if args.planes == 3 else ("q8x", "quantize_q8")
    quant = Kernel(dev, quant)
    wanted = set(filter(None, args.shapes.split(",")))
    res["rows"] = []
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        if wanted and shape[0] not in wanted:
            continue
        sh = Shape(dev, up, quant, args.planes, shape, rng, args.rotate_mb << 20)
        res["rows"] += run_shape(dev, up, sh, x_name, args, copy["GBps"])
        sh.close()
    missed = [r for r in res["rows"] if r["fastest"] and not r["picked"]]
    cases = {(r["shape"], r["T"]) for r in res["rows"]}
    print(f"the picked layout is not the fastest in {len(missed)} of {len(cases)} cases")
    for r in missed:
        pick = next(p for p in res["rows"] if p["picked"] and (p["shape"], p["T"]) == (r["shape"], r["T"]))
        lay = r["layout"] or "(default)"
        print(f"  {r['shape']} T={r['T']}: {lay} {r['us']:.1f} us, the picked one {pick['us']:.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    quant.close()
    up.close()
    for b in (src, dst):
        b.arena.close()
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
