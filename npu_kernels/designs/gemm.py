"""IRON design: one GEMM invocation C (M, N) = A (M, K) @ B (N, K)^T on the whole NPU array (npu1 or npu2).

Prints the MLIR module; build.py hands it to aiecc.py. Written from mlir-aie's
programming_examples/basic/matrix_multiplication/whole_array (whole_array_iron.py), simplified to what hmad
needs: one row block per invocation (M = 4 m), B stored as (N, K) (the weight layout, "B column-major"),
explicit access patterns from plans.GemmPlan (checked in numpy by tests/test_npu_kernels_plan.py).

NOT RUN: no NPU and no mlir-aie toolchain were available where this was written; see ../README.md.

    python gemm.py --dev npu1 -M 256 -K 256 -N 512 -m 64 -k 64 -n 64 --mmul 4x8x8 --cols 4 \
        --dtype-in i8 --dtype-out i32 --archive gemm_int8_kernels.a > gemm_int8.mlir
"""

import argparse
import sys
from pathlib import Path

import numpy as np
from aie.helpers.taplib import TensorAccessPattern
from aie.iron import Kernel, ObjectFifo, Program, Runtime, Worker
from aie.iron.controlflow import range_
from aie.iron.device import NPU2, NPU1Col4, Tile
from aie.iron.placers import SequentialPlacer
from ml_dtypes import bfloat16

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plans import N_ROWS, GemmPlan  # noqa: E402

DTYPES = {"i8": np.int8, "i32": np.int32, "bf16": bfloat16, "f32": np.float32}
FIFO_DEPTH = 2  # double buffering between every pair of tiles


def design(dev: str, p: GemmPlan):
    t_in, t_out = DTYPES[p.dtype_in], DTYPES[p.dtype_out]
    a_ty = np.ndarray[(p.M * p.K,), np.dtype[t_in]]
    b_ty = np.ndarray[(p.N * p.K,), np.dtype[t_in]]
    c_ty = np.ndarray[(p.M * p.N,), np.dtype[t_out]]
    a_l1 = np.ndarray[(p.m, p.k), np.dtype[t_in]]
    b_l1 = np.ndarray[(p.k, p.n), np.dtype[t_in]]
    c_l1 = np.ndarray[(p.m, p.n), np.dtype[t_out]]
    c_l2 = np.ndarray[(p.m * p.n * N_ROWS,), np.dtype[t_out]]

    # hmad's zero (npu_kernels/cores/zero.cc) and mlir-aie's mm.cc, both in one archive per kernel
    zero = Kernel(f"hmad_zero_{p.dtype_out}", p.kernel_archive, [c_l1])
    matmul = Kernel(f"matmul_{p.dtype_in}_{p.dtype_out}", p.kernel_archive, [a_l1, b_l1, c_l1])

    # A: row block of core row i through column i's shim and mem tile, re-laid into (r, s) sub-tiles
    a_l3l2 = [ObjectFifo(a_l1, name=f"A_L3L2_{i}", default_depth=FIFO_DEPTH) for i in range(N_ROWS)]
    a_dims = [(p.m // p.r, p.r * p.k), (p.k // p.s, p.s), (p.r, p.k), (p.s, 1)]
    a_l2l1 = [
        a_l3l2[i]
        .cons()
        .forward(obj_type=a_l1, name=f"A_L2L1_{i}", dims_to_stream=a_dims, placement=Tile(i, 1))
        for i in range(N_ROWS)
    ]
    # B: stored (N, K); each (n, k) tile re-laid into the (t, s) sub-tiles mm.cc reads with B_COL_MAJ
    b_l3l2 = [ObjectFifo(b_l1, name=f"B_L3L2_{j}", default_depth=FIFO_DEPTH) for j in range(p.n_cols)]
    b_dims = [(p.n // p.t, p.t * p.k), (p.k // p.s, p.s), (p.t, p.k), (p.s, 1)]
    b_l2l1 = [
        b_l3l2[j]
        .cons()
        .forward(obj_type=b_l1, name=f"B_L2L1_{j}", dims_to_stream=b_dims, placement=Tile(j, 1))
        for j in range(p.n_cols)
    ]
    # C: the 4 cores of column j join their (m, n) tiles in mem tile j; (r, t) sub-tiles back to row-major
    c_dims = [(p.m // p.r, p.r * p.n), (p.r, p.t), (p.n // p.t, p.r * p.t), (p.t, 1)]
    c_l2l3 = [
        ObjectFifo(c_l2, name=f"C_L2L3_{j}", default_depth=FIFO_DEPTH, dims_to_stream=c_dims)
        for j in range(p.n_cols)
    ]
    c_l1l2 = [
        c_l2l3[j]
        .prod()
        .join(
            [p.m * p.n * i for i in range(N_ROWS)],
            obj_types=[c_l1] * N_ROWS,
            names=[f"C_L1L2_{j}_{i}" for i in range(N_ROWS)],
            depths=[FIFO_DEPTH] * N_ROWS,
            placement=Tile(j, 1),
        )
        for j in range(p.n_cols)
    ]

    def core_fn(a_in, b_in, c_out, zero_k, matmul_k):
        tiles = range_(p.tiles_per_core) if p.tiles_per_core > 1 else range(1)
        for _ in tiles:
            c = c_out.acquire(1)
            zero_k(c)
            for _ in range_(p.K // p.k):
                a, b = a_in.acquire(1), b_in.acquire(1)
                matmul_k(a, b, c)
                a_in.release(1)
                b_in.release(1)
            c_out.release(1)

    workers = [
        Worker(
            core_fn,
            [a_l2l1[i].cons(), b_l2l1[j].cons(), c_l1l2[j][i].prod(), zero, matmul],
            placement=Tile(j, i + 2),
        )
        for i in range(N_ROWS)
        for j in range(p.n_cols)
    ]

    rt = Runtime()
    with rt.sequence(a_ty, b_ty, c_ty) as (A, B, C):  # data BOs 0, 1, 2: kernel.group_id(3), (4), (5)
        rt.start(*workers)
        tg = rt.task_group()
        for i in range(N_ROWS):
            rt.fill(
                a_l3l2[i].prod(), A, tap=_tap((p.M, p.K), *p.a_tap(i)), task_group=tg, placement=Tile(i, 0)
            )
        for j in range(p.n_cols):
            rt.fill(
                b_l3l2[j].prod(), B, tap=_tap((p.N, p.K), *p.b_tap(j)), task_group=tg, placement=Tile(j, 0)
            )
        for j in range(p.n_cols):
            c_tap = _tap((p.M, p.N), *p.c_tap(j))
            rt.drain(c_l2l3[j].cons(), C, tap=c_tap, wait=True, task_group=tg, placement=Tile(j, 0))
        rt.finish_task_group(tg)

    device = NPU1Col4() if dev == "npu1" else NPU2()
    return Program(device, rt).resolve_program(SequentialPlacer())


def _tap(dims, offset, sizes, strides) -> TensorAccessPattern:
    return TensorAccessPattern(dims, offset, sizes, strides)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dev", choices=["npu1", "npu2"], required=True)
    for dim in ("M", "K", "N", "m", "k", "n"):
        ap.add_argument(f"-{dim}", type=int, required=True)
    ap.add_argument("--mmul", required=True, help="r x s x t of the microkernel, e.g. 4x8x8")
    ap.add_argument("--cols", type=int, required=True)
    ap.add_argument("--dtype-in", choices=["i8", "bf16"], required=True)
    ap.add_argument("--dtype-out", choices=["i32", "f32"], required=True)
    ap.add_argument("--archive", required=True)
    a = ap.parse_args()
    r, s, t = (int(v) for v in a.mmul.split("x"))
    name = a.archive.removesuffix("_kernels.a")
    plan = GemmPlan(name, a.dtype_in, a.dtype_out, a.M, a.K, a.N, a.m, a.k, a.n, r, s, t, a.cols)
    print(design(a.dev, plan))


if __name__ == "__main__":
    main()
