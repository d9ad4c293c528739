"""The NPU kernel catalogue (what each kernel computes, its buffers) and finding the built kernels.

One source of truth: ``npu_kernels/build.py`` builds exactly the kernels listed in ``CATALOGUE`` and writes a
``manifest.json`` beside them that repeats each kernel's argument list; the runtime refuses a manifest whose
arguments differ from the catalogue (a stale build) with a reason naming the kernel.

Every kernel is invoked the way IRON designs are (mlir-aie ``python/utils/xrt.py``)::

    kernel(3, instr_bo, n_instr_words, bo_arg0, bo_arg1, ...)   # opcode 3, then the instruction stream
                                                                 # (group_id 1), then data BOs (group_id 3..)

Buffer contracts (row-major; bf16 travels as uint16 bit patterns):

    gemm_int8     a int8 (256, 256)   b int8 (512, 256)   c int32 (256, 512)    c = a @ b.T
    gemm_bf16     a bf16 (256, 256)   b bf16 (256, 256)   c f32   (256, 256)    c = a @ b.T (f32 accumulate)
    softmax_bf16  s f32  (256, 2048)  lim int32 (256, 2)  p bf16  (256, 2048)
                  p[r, j] = exp(s[r, j] - max) / sum over lim[r, 0] <= j < lim[r, 1]; 0 outside that range

``b`` is (N, K): a weight as stored (out_features, in_features), i.e. the designs' "B column-major" layout.
The same shapes are built for npu1 and npu2; only the designs' inner tiling differs (npu_kernels/README.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hmad.backends.npu.errors import NpuKernelsMissing

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
#: a system-wide install (``npu_kernels/build.py --install``); read-only to the service
SYSTEM_KERNEL_DIR = "/usr/local/share/hmad/npu_kernels"
#: a source checkout's build output (``npu_kernels/build.py`` without --install)
CHECKOUT_KERNEL_DIR = Path(__file__).resolve().parents[4] / "npu_kernels" / "build"
KERNEL_NAME = "MLIR_AIE"  # the kernel name aiecc.py gives every IRON design's xclbin


@dataclass(frozen=True)
class Arg:
    """One buffer of a kernel: its name, element type, shape, and whether the kernel writes it."""

    name: str
    dtype: str  # numpy dtype name; bf16 is "uint16"
    shape: tuple[int, ...]
    out: bool = False

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize

    def to_json(self) -> list:
        return [self.name, self.dtype, list(self.shape), "out" if self.out else "in"]


@dataclass(frozen=True)
class KernelSpec:
    """A kernel's contract: name (file stem), what it computes, its buffers in argument order."""

    name: str
    op: str  # "gemm" or "softmax"
    args: tuple[Arg, ...]

    @property
    def inputs(self) -> tuple[Arg, ...]:
        return tuple(a for a in self.args if not a.out)

    @property
    def outputs(self) -> tuple[Arg, ...]:
        return tuple(a for a in self.args if a.out)

    def gemm_tile(self) -> tuple[int, int, int]:
        """(M, K, N) of one invocation of a gemm kernel."""
        (m, k), (n, _) = self.args[0].shape, self.args[1].shape
        return m, k, n


def _gemm(name: str, dt_in: str, dt_out: str, m: int, k: int, n: int) -> KernelSpec:
    return KernelSpec(
        name, "gemm", (Arg("a", dt_in, (m, k)), Arg("b", dt_in, (n, k)), Arg("c", dt_out, (m, n), out=True))
    )


SOFTMAX_ROWS, SOFTMAX_COLS = 256, 2048

CATALOGUE: dict[str, KernelSpec] = {
    s.name: s
    for s in (
        _gemm("gemm_int8", "int8", "int32", 256, 256, 512),
        _gemm("gemm_bf16", "uint16", "float32", 256, 256, 256),
        KernelSpec(
            "softmax_bf16",
            "softmax",
            (
                Arg("s", "float32", (SOFTMAX_ROWS, SOFTMAX_COLS)),
                Arg("lim", "int32", (SOFTMAX_ROWS, 2)),
                Arg("p", "uint16", (SOFTMAX_ROWS, SOFTMAX_COLS), out=True),
            ),
        ),
    )
}

#: the kernels each configurable op needs (config npu.ops)
KERNELS_FOR_OP = {
    "gemm_int8": ("gemm_int8",),
    "gemm_bf16": ("gemm_bf16",),
    "attention_prefill": ("gemm_bf16", "softmax_bf16"),  # Q.K^T and .V on the bf16 gemm, softmax between
}


@dataclass(frozen=True)
class KernelFiles:
    """An installed kernel: its contract and where its xclbin and instruction stream are."""

    spec: KernelSpec
    xclbin: str
    insts: str
    kernel_name: str = KERNEL_NAME


def kernel_dirs(configured: str | None) -> list[Path]:
    """Where to look for ``<dir>/<family>/manifest.json``: the configured dir only, or the defaults."""
    if configured:
        return [Path(configured).expanduser()]
    return [CHECKOUT_KERNEL_DIR, Path(SYSTEM_KERNEL_DIR)]


def find_kernels(family: str, configured: str | None, names: list[str]) -> dict[str, KernelFiles]:
    """The installed kernels ``names`` for ``family``; NpuKernelsMissing naming what is absent or stale."""
    tried = []
    for d in kernel_dirs(configured):
        manifest = d / family / MANIFEST
        tried.append(str(manifest))
        if manifest.is_file():
            return _read_manifest(manifest, family, names)
    raise NpuKernelsMissing(
        f"no {family} kernels installed (looked for {', '.join(tried)}; build them with npu_kernels/build.py)"
    )


def _read_manifest(path: Path, family: str, names: list[str]) -> dict[str, KernelFiles]:
    try:
        doc = json.loads(path.read_text())
        kernels = doc["kernels"]
        if doc.get("format") != MANIFEST_FORMAT or doc.get("family") != family:
            raise ValueError(f"format {doc.get('format')!r} family {doc.get('family')!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise NpuKernelsMissing(f"{path}: not a usable kernel manifest ({e})") from None
    out = {}
    for name in names:
        entry = kernels.get(name)
        if not isinstance(entry, dict):
            raise NpuKernelsMissing(f"{path}: kernel {name!r} is not installed")
        out[name] = _kernel_files(path.parent, CATALOGUE[name], entry, path)
    return out


def _kernel_files(d: Path, spec: KernelSpec, entry: dict, manifest: Path) -> KernelFiles:
    want = [a.to_json() for a in spec.args]
    if entry.get("args") != want:
        raise NpuKernelsMissing(
            f"{manifest}: {spec.name} was built with arguments {entry.get('args')}, this hmad needs {want} "
            "(rebuild with npu_kernels/build.py)"
        )
    files = KernelFiles(
        spec,
        str(d / entry.get("xclbin", "")),
        str(d / entry.get("insts", "")),
        entry.get("kernel", KERNEL_NAME),
    )
    for f in (files.xclbin, files.insts):
        if not os.path.isfile(f):
            raise NpuKernelsMissing(f"{manifest}: {spec.name}: file {f} is missing")
    return files


def manifest_entry(spec: KernelSpec, xclbin: str, insts: str) -> dict:
    """The manifest entry of a built kernel (npu_kernels/build.py writes these; tests write fakes)."""
    return {"xclbin": xclbin, "insts": insts, "kernel": KERNEL_NAME, "args": [a.to_json() for a in spec.args]}


def write_manifest(directory: Path, family: str, entries: dict[str, dict]) -> Path:
    """Write ``<directory>/manifest.json`` for ``family`` (directory is the family's own folder)."""
    path = Path(directory) / MANIFEST
    doc = {"format": MANIFEST_FORMAT, "family": family, "kernels": entries}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def read_insts(path: str) -> np.ndarray:
    """The instruction stream as uint32 words: aiecc's ``insts.bin`` (little-endian words) or the older
    ``insts.txt`` (one hex word per line)."""
    if path.endswith(".txt"):
        with open(path) as f:
            words = [int(line, 16) for line in f.read().split()]
        return np.asarray(words, dtype=np.uint32)
    data = np.fromfile(path, dtype="<u4")
    if data.size == 0:
        raise NpuKernelsMissing(f"{path}: empty instruction stream")
    return data.astype(np.uint32)
