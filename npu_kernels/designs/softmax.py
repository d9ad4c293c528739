"""IRON design: masked row softmax, float32 scores (R, L) + [lo, hi) per row (R, 2) int32 -> bf16 (R, L).

The attention piece between Q.K^T and .V (both run on gemm.py's bf16 GEMM): p[r, j] = exp(s[r, j] - max) / sum
over lo <= j < hi, 0 outside, where [lo, hi) is the causal (and sliding-window) range of the query row. The
cores of one column take rows round-robin: the mem tile splits each group of ``cores`` rows between them
and joins their outputs in the same order. Written after mlir-aie's programming_examples/ml/softmax.

NOT RUN: no NPU and no mlir-aie toolchain were available where this was written; see ../README.md.

    python softmax.py --dev npu1 -R 256 -L 2048 --cores 4 --archive softmax_bf16_kernels.a > softmax_bf16.mlir
"""

import argparse
import sys
from pathlib import Path

import numpy as np
from aie.iron import Kernel, ObjectFifo, Program, Runtime, Worker
from aie.iron.controlflow import range_
from aie.iron.device import NPU1Col1, NPU2Col1
from aie.iron.placers import SequentialPlacer
from ml_dtypes import bfloat16

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plans import SoftmaxPlan  # noqa: E402


def design(dev: str, p: SoftmaxPlan):
    s_ty = np.ndarray[(p.R * p.L,), np.dtype[np.float32]]
    lim_ty = np.ndarray[(p.R * 2,), np.dtype[np.int32]]
    out_ty = np.ndarray[(p.R * p.L,), np.dtype[bfloat16]]
    s_row = np.ndarray[(p.L,), np.dtype[np.float32]]
    lim_row = np.ndarray[(2,), np.dtype[np.int32]]
    p_row = np.ndarray[(p.L,), np.dtype[bfloat16]]

    softmax = Kernel("hmad_softmax_masked", p.kernel_archive, [s_row, lim_row, p_row, np.int32])

    # one group of `cores` rows per mem-tile object, split row by row between the cores
    s_in = ObjectFifo(np.ndarray[(p.cores * p.L,), np.dtype[np.float32]], name="S")
    lim_in = ObjectFifo(np.ndarray[(p.cores * 2,), np.dtype[np.int32]], name="LIM")
    p_out = ObjectFifo(np.ndarray[(p.cores * p.L,), np.dtype[bfloat16]], name="P")
    names = range(p.cores)
    s_rows = s_in.cons().split(
        [p.L * i for i in names], obj_types=[s_row] * p.cores, names=[f"S{i}" for i in names]
    )
    lims = lim_in.cons().split(
        [2 * i for i in names], obj_types=[lim_row] * p.cores, names=[f"LIM{i}" for i in names]
    )
    p_rows = p_out.prod().join(
        [p.L * i for i in names], obj_types=[p_row] * p.cores, names=[f"P{i}" for i in names]
    )

    def core_fn(s_fifo, lim_fifo, p_fifo, kernel):
        for _ in range_(p.R // p.cores):
            s, lim, out = s_fifo.acquire(1), lim_fifo.acquire(1), p_fifo.acquire(1)
            kernel(s, lim, out, p.L)
            s_fifo.release(1)
            lim_fifo.release(1)
            p_fifo.release(1)

    workers = [Worker(core_fn, [s_rows[i].cons(), lims[i].cons(), p_rows[i].prod(), softmax]) for i in names]

    rt = Runtime()
    with rt.sequence(s_ty, lim_ty, out_ty) as (S, LIM, P):  # data BOs: kernel.group_id(3), (4), (5)
        rt.start(*workers)
        rt.fill(s_in.prod(), S)
        rt.fill(lim_in.prod(), LIM)
        rt.drain(p_out.cons(), P, wait=True)

    device = NPU1Col1() if dev == "npu1" else NPU2Col1()
    return Program(device, rt).resolve_program(SequentialPlacer())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dev", choices=["npu1", "npu2"], required=True)
    ap.add_argument("-R", type=int, required=True)
    ap.add_argument("-L", type=int, required=True)
    ap.add_argument("--cores", type=int, default=4)
    ap.add_argument("--archive", required=True)
    a = ap.parse_args()
    print(design(a.dev, SoftmaxPlan(a.archive.removesuffix("_kernels.a"), a.R, a.L, a.cores)))


if __name__ == "__main__":
    main()
