#!/usr/bin/env python3
"""Build hmad's NPU kernels: IRON designs -> MLIR -> xclbin + instruction stream, and the manifest hmad reads.

    python npu_kernels/build.py --plan                    # what would be built (no toolchain needed)
    python npu_kernels/build.py --family npu1             # build into npu_kernels/build/npu1/
    python npu_kernels/build.py --family npu1 --install   # + copy to /usr/local/share/hmad/npu_kernels/npu1/

Needs mlir-aie's Python package (``aie``, with aiecc.py), the Peano compiler (llvm-aie), ml_dtypes and XRT's
xclbinutil; exits with status 2 naming each one that is missing. Without --family the family is read from
the NPU of this machine (npu1: Phoenix / Hawk Point, npu2: Strix and later). See npu_kernels/README.md.

Per kernel: the core code (mlir-aie's mm.cc, hmad's cores/*.cc) is compiled with Peano into one archive, the
design (designs/*.py, parameters from designs/plans.py) prints MLIR, and aiecc.py makes ``<name>.xclbin``
and ``<name>.insts.bin``. NOT RUN: this script has never had the toolchain to run against.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "designs"))
sys.path.insert(0, str(HERE.parent / "daemon"))

from plans import GemmPlan, SoftmaxPlan, plans  # noqa: E402

from hmad.backends.npu.kernels import CATALOGUE, SYSTEM_KERNEL_DIR, manifest_entry, write_manifest  # noqa: E402

WARNINGS = ["-Wno-parentheses", "-Wno-attributes", "-Wno-macro-redefined", "-Wno-empty-body",
            "-Wno-missing-template-arg-list-after-template-kw"]  # fmt: skip
TARGET = {"npu1": ("aie2", "aie2-none-unknown-elf"), "npu2": ("aie2p", "aie2p-none-unknown-elf")}


@dataclass
class Toolchain:
    mlir_aie: Path  # root of the mlir_aie install (aie.utils.config.root_path())
    peano: Path  # llvm-aie install (bin/clang++)
    aiecc: str
    xclbinutil: str

    def kernel_source(self, arch: str, name: str) -> Path:
        for base in (self.mlir_aie / "include" / "aie_kernels", self.mlir_aie / "aie_kernels"):
            if (base / arch / name).is_file():
                return base / arch / name
        raise SystemExit(f"build.py: {name} for {arch} not found under {self.mlir_aie} (aie_kernels)")


def find_toolchain() -> tuple[Toolchain | None, list[str]]:
    """The toolchain, or None and a line per missing piece saying how to get it."""
    missing = []
    root = None
    try:
        root = Path(importlib.import_module("aie.utils.config").root_path())
    except Exception as e:
        missing.append(
            f"mlir-aie's Python package 'aie' ({e}): pip install mlir_aie from the mlir-aie releases"
        )
    try:
        importlib.import_module("ml_dtypes")
    except ImportError:
        missing.append("ml_dtypes: pip install ml_dtypes")
    aiecc = shutil.which("aiecc.py") or (str(root / "bin" / "aiecc.py") if root else None)
    if not aiecc or not os.path.exists(aiecc):
        missing.append("aiecc.py (ships with mlir_aie): put the mlir_aie install's bin on PATH")
    peano = _find_peano()
    if peano is None:
        missing.append("Peano (llvm-aie): pip install llvm-aie from its releases, or set PEANO_INSTALL_DIR")
    xclbinutil = shutil.which("xclbinutil") or "/opt/xilinx/xrt/bin/xclbinutil"
    if not os.path.exists(xclbinutil):
        missing.append("xclbinutil (XRT): install XRT and source /opt/xilinx/xrt/setup.sh")
    if missing:
        return None, missing
    return Toolchain(root, peano, aiecc, xclbinutil), []


def _find_peano() -> Path | None:
    candidates = [os.environ.get("PEANO_INSTALL_DIR", "")] + [os.path.join(p, "llvm-aie") for p in sys.path]
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, "bin", "clang++")):
            return Path(c)
    return None


def run(cmd: list[str], cwd: Path, stdout=None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True, stdout=stdout)


def compile_archive(tc: Toolchain, family: str, plan: GemmPlan | SoftmaxPlan, out: Path) -> None:
    """The core code of one kernel, compiled with Peano into ``out/<plan.kernel_archive>``."""
    arch, target = TARGET[family]
    flags = ["-O2", "-std=c++20", f"--target={target}", *WARNINGS, "-DNDEBUG", f"-I{tc.mlir_aie / 'include'}"]
    if isinstance(plan, GemmPlan):
        sources = [tc.kernel_source(arch, "mm.cc"), HERE / "cores" / "zero.cc"]
        flags += plan.kernel_defines()
    else:
        sources = [HERE / "cores" / "softmax_masked.cc"]
        if family == "npu1":  # AIE2 has no exp instruction: mlir-aie's lookup-table exp
            runtime_lib = tc.mlir_aie / "aie_runtime_lib" / "AIE2"
            sources.append(runtime_lib / "lut_based_ops.cpp")
            flags += ["-DHMAD_AIE2", f"-I{runtime_lib}"]
    objects = []
    for src in sources:
        obj = out / f"{plan.name}_{src.stem}.o"
        run([str(tc.peano / "bin" / "clang++"), *flags, "-c", str(src), "-o", str(obj)], out)
        objects.append(obj.name)
    ar = tc.peano / "bin" / "llvm-ar"
    run([str(ar) if ar.exists() else "ar", "rcs", plan.kernel_archive, *objects], out)


def build_kernel(tc: Toolchain, family: str, plan: GemmPlan | SoftmaxPlan, out: Path) -> dict:
    """Archive, MLIR, xclbin and instruction stream of one kernel; returns its manifest entry."""
    compile_archive(tc, family, plan, out)
    design = HERE / "designs" / ("gemm.py" if isinstance(plan, GemmPlan) else "softmax.py")
    with open(out / f"{plan.name}.mlir", "w") as f:
        run([sys.executable, str(design), *plan.design_args(family)], out, stdout=f)
    xclbin, insts = f"{plan.name}.xclbin", f"{plan.name}.insts.bin"
    run([tc.aiecc, "--alloc-scheme=basic-sequential", "--aie-generate-xclbin", "--no-compile-host",
         f"--xclbin-name={xclbin}", "--no-xchesscc", "--no-xbridge", f"--peano={tc.peano}",
         "--aie-generate-npu-insts", f"--npu-insts-name={insts}", f"{plan.name}.mlir"], out)  # fmt: skip
    return manifest_entry(CATALOGUE[plan.name], xclbin, insts)


def check_plans(family: str) -> dict:
    """The family's plans, checked against the runtime's catalogue (the buffers hmad will hand them)."""
    ps = plans(family)
    assert set(ps) == set(CATALOGUE), f"plans {sorted(ps)} != catalogue {sorted(CATALOGUE)}"
    for name, p in ps.items():
        shapes = [a.shape for a in CATALOGUE[name].args]
        want = (
            [(p.M, p.K), (p.N, p.K), (p.M, p.N)]
            if isinstance(p, GemmPlan)
            else [(p.R, p.L), (p.R, 2), (p.R, p.L)]
        )
        assert shapes == want, f"{family} {name}: plan shapes {want} != catalogue {shapes}"
    return ps


def detect_family() -> str:
    from hmad.backends.npu.errors import NpuError
    from hmad.backends.npu.xrt import open_device

    try:
        return open_device().family
    except NpuError as e:
        raise SystemExit(
            f"build.py: cannot tell the NPU family ({e}); pass --family npu1 or --family npu2"
        ) from None


def install(src: Path, dest_root: Path, family: str) -> None:
    dest = dest_root / family
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix in (".xclbin", ".json") or f.name.endswith(".insts.bin"):
            shutil.copy2(f, dest / f.name)
    print(f"installed {family} kernels in {dest}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=["npu1", "npu2"], help="default: this machine's NPU")
    ap.add_argument("--out", type=Path, default=HERE / "build", help="build root (default npu_kernels/build)")
    ap.add_argument("--install", nargs="?", const=SYSTEM_KERNEL_DIR, metavar="DIR",
                    help=f"copy the built kernels to DIR/<family> (default {SYSTEM_KERNEL_DIR})")  # fmt: skip
    ap.add_argument("--only", nargs="+", choices=sorted(CATALOGUE), help="build only these kernels")
    ap.add_argument(
        "--plan", action="store_true", help="print the kernels and design arguments; build nothing"
    )
    args = ap.parse_args(argv)
    if args.plan:
        for family in (args.family,) if args.family else ("npu1", "npu2"):
            for name, p in check_plans(family).items():
                print(f"{family} {name}: {' '.join(p.design_args(family))}")
        return 0
    tc, missing = find_toolchain()
    if tc is None:
        print("build.py: the NPU kernel toolchain is not installed; missing:", file=sys.stderr)
        for m in missing:
            print(f"  - {m}", file=sys.stderr)
        print("see npu_kernels/README.md", file=sys.stderr)
        return 2
    family = args.family or detect_family()
    out = args.out / family
    out.mkdir(parents=True, exist_ok=True)
    entries = {name: build_kernel(tc, family, p, out) for name, p in check_plans(family).items()
               if not args.only or name in args.only}  # fmt: skip
    print(f"wrote {write_manifest(out, family, entries)}")
    if args.install:
        install(out, Path(args.install), family)
    return 0


if __name__ == "__main__":
    sys.exit(main())
