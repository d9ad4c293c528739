#!/usr/bin/env python3
"""What the cooperative-matrix GEMM's time is made of: builds of one mul_mm_coopmat Q4_K kernel with parts of
its work taken out (wrong outputs: for timing only), ``<out>/<variant>.spv``, each swapped into a copy of
shaders/spv for ``HMAD_SHADER_DIR`` and timed by ``bench_vulkan_matmul.py --coopmat-variants T --time-wrong``.
Needs glslangValidator (the ``shaders`` extra): build here, carry ``<out>`` to the device machine.

    python3 bench/coopmat_ablations.py build/abl                                  # here
    K=mul_mm_coopmat_q4_k_128x128_s2x2_w2; for v in same nodecode qprod wcache nobar skeleton; do   # device
      mkdir -p /tmp/spv_$v && cp shaders/spv/* /tmp/spv_$v/ && cp build/abl/$v.spv /tmp/spv_$v/$K.spv
      HMAD_SHADER_DIR=/tmp/spv_$v python3 bench/bench_vulkan_matmul.py --coopmat-variants 512 \\
        --coopmat-kernels $K --time-wrong --out abl_$v.json; done

Variants (defines of a patched copy of shaders/mul_mm_coopmat.comp; the copy is deleted after):
``same`` (the committed kernel), ``nodecode`` (W's quant words stored undecoded), ``qprod`` (a quarter of the
products: one A fragment of four), ``wcache`` (W read from 8 rows, which stay cached), ``nobar`` (no barriers
in the K loop), ``skeleton`` (wcache + nodecode + qprod: what is left is staging x and W through registers
into shared memory, the fragments' loads and the barriers). docs/performance.md has the H200's figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SHADERS = Path(__file__).resolve().parents[1] / "shaders"
sys.path.insert(0, str(SHADERS))

import build as shader_build  # noqa: E402  (shaders/build.py)

KERNEL = "mul_mm_coopmat_q4_k_128x128_s2x2_w2"
VARIANTS = {
    "same": {},
    "nodecode": {"ABL_NODECODE": "1"},
    "qprod": {"ABL_QPROD": "1"},
    "wcache": {"ABL_WCACHE": "1"},
    "nobar": {"ABL_NOBAR": "1"},
    "skeleton": {"ABL_WCACHE": "1", "ABL_NODECODE": "1", "ABL_QPROD": "1"},
}

# (text of shaders/mul_mm_coopmat.comp, its replacement with the ablation's #ifdef)
_DECODE = "ws[WSI(r * SK8 + {p} + 2u * v{o})] = nib8({a}, {b}, {s}u, dl{i}, ml{i});"
_STORES = [("lo", "", "q.x", "q.y", 0, 0), ("lo", " + 1u", "q.z", "q.w", 0, 0)]
_STORES += [("hi", "", "q.x", "q.y", 4, 1), ("hi", " + 1u", "q.z", "q.w", 4, 1)]
_DECODED = "\n".join(
    "            " + _DECODE.format(p=p, o=o, a=a, b=b, s=s, i=i) for p, o, a, b, s, i in _STORES
)
_RAW = "\n".join(f"            ws[WSI(r * SK8 + {p} + 2u * v{o})] = q;" for p, o, *_ in _STORES)
_MMA = "acc[i][j] = coopMatMulAdd(a[i], b[j], acc[i][j]);"
_W_BLOCK = "        const uint b = min(n0 + r, p.N - 1u) * rstride + (k0 / 256u) * 9u;"
_LOOP = """        store(k0, tid);
        barrier();
        if (k0 + BK < k_end) fetch(n0, t0, k0 + BK, k_end, tid);  // in flight during the products
        PRODUCTS();
        barrier();
    }"""
PATCHES = [
    (_DECODED, f"#ifdef ABL_NODECODE\n{_RAW}\n#else\n{_DECODED}\n#endif"),
    (f"{_MMA}", f"if (i < ABL_TF) {_MMA}"),
    ("#define XPT (", "#ifdef ABL_QPROD\n#define ABL_TF 1u\n#else\n#define ABL_TF TF\n#endif\n#define XPT ("),
    (_W_BLOCK, f"#ifdef ABL_WCACHE\n        const uint b = (r % 8u) * rstride;\n#else\n{_W_BLOCK}\n#endif"),
    (_LOOP, _LOOP.replace("barrier();", "\n#ifndef ABL_NOBAR\nbarrier();\n#endif\n") + "\n    barrier();"),
]


def patched_source() -> str:
    """shaders/mul_mm_coopmat.comp with the ablations' #ifdefs (each patch must match once)."""
    src = (SHADERS / "mul_mm_coopmat.comp").read_text()
    for old, new in PATCHES:
        if src.count(old) != 1:
            raise SystemExit(f"mul_mm_coopmat.comp changed: {old.strip()[:60]!r} is not there once")
        src = src.replace(old, new)
    return src


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder for <variant>.spv")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    defines = next(d for name, _, d in shader_build.BUILD if name == KERNEL)
    tmp = SHADERS / "_ablation.comp"  # beside its includes
    tmp.write_text(patched_source())
    shader_build.GLSLANG_SOURCES.add(tmp.name)  # the cooperative-matrix compiler
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        for v in args.variants.split(","):
            shader_build.compile_one(tmp.name, {**defines, **VARIANTS[v]}, args.out / f"{v}.spv")
            print(args.out / f"{v}.spv")
    finally:
        tmp.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
