"""The design parameters of every hmad NPU kernel, per NPU family, in plain Python (no mlir-aie needed).

The IRON designs (gemm.py, softmax.py) and build.py read these; tests/test_npu_kernels_plan.py replays the
GEMM data movement they describe in numpy, so the access patterns are checked here even though the designs
themselves only run where the toolchain and an NPU are.

GEMM (whole array, after mlir-aie's programming_examples/basic/matrix_multiplication/whole_array): 4 rows of
compute cores x ``n_cols`` columns; core (row, col) computes output tiles (m, n) of C = A B^T, rows
row*m.. of the 256-row invocation, columns (i * n_cols + col) * n.. for i in range(tiles_per_core), summing
K/k products of (m, k) x (k, n) tiles. A row block enters through shim/mem tile column ``row`` and is
broadcast along its core row; B (stored (N, K): "B column-major") enters through column ``col`` and is
broadcast down it; each column's mem tile joins its 4 cores' C tiles and sends them back through its shim.
The microkernel is mlir-aie's aie_kernels/aie2(p)/mm.cc built with -DB_COL_MAJ; (r, s, t) is its mmul shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

N_ROWS = 4  # compute rows of npu1 and npu2


@dataclass(frozen=True)
class GemmPlan:
    """One GEMM invocation: C (M, N) = A (M, K) @ B (N, K)^T, tiled for the array."""

    name: str
    dtype_in: str  # "i8" or "bf16"
    dtype_out: str  # "i32" or "f32"
    M: int
    K: int
    N: int
    m: int
    k: int
    n: int
    r: int
    s: int
    t: int
    n_cols: int

    def __post_init__(self):
        assert self.m * N_ROWS == self.M, "one row block per invocation: M = 4 m"
        assert self.K % self.k == 0 and self.N % (self.n * self.n_cols) == 0
        assert self.m % self.r == 0 and self.k % self.s == 0 and self.n % self.t == 0
        assert self.n_cols >= N_ROWS, "A enters through columns 0..3"

    @property
    def tiles_per_core(self) -> int:
        return self.N // (self.n * self.n_cols)

    @property
    def kernel_archive(self) -> str:
        return f"{self.name}_kernels.a"

    def a_tap(self, row: int) -> tuple[int, list[int], list[int]]:
        """(offset, sizes, strides) over A (M, K), elements: core row ``row``'s (m, k) tiles in the order its
        cores consume them, repeated for each of their output tiles."""
        return (
            row * self.m * self.K,
            [self.tiles_per_core, self.K // self.k, self.m, self.k],
            [0, self.k, self.K, 1],
        )

    def b_tap(self, col: int) -> tuple[int, list[int], list[int]]:
        """Over B (N, K): column ``col``'s (n, k) tiles, output tile by output tile, K steps inside."""
        return (
            col * self.n * self.K,
            [self.tiles_per_core, self.K // self.k, self.n, self.k],
            [self.n_cols * self.n * self.K, self.k, self.K, 1],
        )

    def c_tap(self, col: int) -> tuple[int, list[int], list[int]]:
        """Over C (M, N): column ``col``'s (M, n) blocks, one per output tile."""
        return col * self.n, [1, self.tiles_per_core, self.M, self.n], [0, self.n_cols * self.n, self.N, 1]

    def design_args(self, family: str) -> list[str]:
        return [
            "--dev", family, "-M", str(self.M), "-K", str(self.K), "-N", str(self.N),
            "-m", str(self.m), "-k", str(self.k), "-n", str(self.n),
            "--mmul", f"{self.r}x{self.s}x{self.t}", "--cols", str(self.n_cols),
            "--dtype-in", self.dtype_in, "--dtype-out", self.dtype_out, "--archive", self.kernel_archive,
        ]  # fmt: skip

    def kernel_defines(self) -> list[str]:
        """Preprocessor flags of the microkernel build (mlir-aie's mm.cc and our zero.cc)."""
        return [f"-DDIM_M={self.m}", f"-DDIM_K={self.k}", f"-DDIM_N={self.n}", "-DB_COL_MAJ",
                f"-D{self.dtype_in}_{self.dtype_out}_ONLY"]  # fmt: skip


@dataclass(frozen=True)
class SoftmaxPlan:
    """Masked row softmax: R rows of L float32 scores, [lo, hi) per row -> bf16; ``cores`` cores of one
    column take the rows round-robin (core i: rows i, i + cores, ...)."""

    name: str
    R: int
    L: int
    cores: int = 4

    def __post_init__(self):
        assert self.R % self.cores == 0 and self.L % 16 == 0

    @property
    def kernel_archive(self) -> str:
        return f"{self.name}_kernels.a"

    def design_args(self, family: str) -> list[str]:
        return ["--dev", family, "-R", str(self.R), "-L", str(self.L), "--cores", str(self.cores),
                "--archive", self.kernel_archive]  # fmt: skip


def plans(family: str) -> dict[str, GemmPlan | SoftmaxPlan]:
    """Every kernel hmad loads (the runtime's catalogue, hmad/backends/npu/kernels.py), for ``family``."""
    if family == "npu1":  # Phoenix / Hawk Point: AIE2, 4 columns; mmul shapes of mm.cc's aie2 combos
        i8, bf16, cols = (4, 8, 8), (4, 8, 4), 4
    elif family == "npu2":  # Strix and later: AIE2P, 8 columns
        i8, bf16, cols = (8, 8, 8), (4, 8, 8), 8
    else:
        raise ValueError(f"unknown NPU family {family!r} (npu1, npu2)")
    return {
        "gemm_int8": GemmPlan("gemm_int8", "i8", "i32", 256, 256, 512, 64, 64, 64, *i8, cols),
        "gemm_bf16": GemmPlan("gemm_bf16", "bf16", "f32", 256, 256, 256, 64, 64, 32, *bf16, cols),
        "softmax_bf16": SoftmaxPlan("softmax_bf16", 256, 2048),
    }


def walk(offset: int, sizes: list[int], strides: list[int]) -> np.ndarray:
    """The element indices a DMA access pattern visits, in order (for checking the patterns on the host)."""
    idx = np.array([offset])
    for size, stride in zip(sizes, strides, strict=True):
        idx = (idx[:, None] + stride * np.arange(size)[None, :]).reshape(-1)
    return idx
