"""One list of kernel variants (daemon/hmad/backends/vulkan/variants.py), read by shaders/build.py and by the
runtime's registry; the committed SPIR-V is exactly that list, and each registered interface (binding
count, push struct) is the one its committed SPIR-V declares. No device needed: the SPIR-V is reflected
from the committed files."""

from __future__ import annotations

import ast
import ctypes
import json
import sys
from pathlib import Path

from vk_harness import shader_build

from hmad.backends.vulkan import variants
from hmad.backends.vulkan.program import reflect, shader_dir
from hmad.backends.vulkan.registry import KERNELS, SOURCES

ROOT = Path(__file__).resolve().parents[1]


def test_variants_module_imports_only_the_standard_library():
    """shaders/build.py loads variants.py by path with a bare python3: it may import nothing else."""
    tree = ast.parse(Path(variants.__file__).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    assert roots and roots <= set(sys.stdlib_module_names) | {"__future__"}, roots


def test_build_list_is_the_variants_list():
    """build.py compiles exactly variants.VARIANTS (names, sources, defines, in order), from the file the
    runtime imports."""
    build = shader_build()
    assert Path(build.VARIANTS_PY).resolve() == Path(variants.__file__).resolve()
    assert [(v.name, v.source, v.defines) for v in variants.VARIANTS] == build.BUILD
    names = [v.name for v in variants.VARIANTS]
    assert len(names) == len(set(names)), "a variant name twice"
    assert all((ROOT / "shaders" / v.source).exists() for v in variants.VARIANTS)


def test_every_registered_kernel_has_its_committed_spirv_and_back():
    """KERNELS, the committed shaders/spv/*.spv and the manifest name the same variants, and the manifest's
    defines for each are the list's (so the committed SPIR-V was built from this list)."""
    spv = {p.stem for p in shader_dir().glob("*.spv")}
    manifest = json.loads((shader_dir() / "manifest.json").read_text())["shaders"]
    assert set(KERNELS) == spv == set(manifest) == {v.name for v in variants.VARIANTS}
    for v in variants.VARIANTS:
        assert manifest[v.name]["source"] == v.source == KERNELS[v.name].source, v.name
        assert manifest[v.name]["defines"] == dict(sorted(v.defines.items())), v.name


def test_registered_interfaces_match_the_spirv():
    """Per variant: the shader's bindings are 0..n_buffers-1 and its push block has the registered struct's
    offsets and size (what Kernel checks when it builds a pipeline, here for every variant at once)."""
    assert {v.source for v in variants.VARIANTS} == set(SOURCES)
    for name, spec in KERNELS.items():
        iface = reflect((shader_dir() / f"{name}.spv").read_bytes())
        assert iface.bindings == tuple(range(spec.n_buffers)), (name, iface.bindings, spec.n_buffers)
        offsets = tuple(getattr(spec.push, f).offset for f, _ in spec.push._fields_)
        assert (iface.push_offsets, iface.push_size) == (offsets, ctypes.sizeof(spec.push)), name
        assert spec.block_size > 0 and spec.block_size & (spec.block_size - 1) == 0, name


def test_texel_buffers_only_in_the_cpu_kernels_and_read_only():
    """Storage texel buffers (physical.texel_loads: CPU implementations) are declared by exactly the kernels
    made for those devices: the register mat-mat's ``_texel`` variants (its plain ones stay storage buffers,
    a GPU knob), attention_split_l1 and the int8 mat-vec's one-lane layouts; each of their inputs is read
    only, in a format program.TEXEL_FORMATS knows, and no other kernel declares one."""
    from hmad.backends.vulkan.program import TEXEL_FORMATS

    def cpu_kernel(name: str) -> bool:
        one_lane = name.startswith("mul_mat_vec_") and any(lay in name for lay in variants.Q8_LANES)
        return name.endswith("_texel") or name.startswith("attention_split_l1_") or one_lane

    seen = 0
    for name in KERNELS:
        iface = reflect((shader_dir() / f"{name}.spv").read_bytes())
        assert bool(iface.texels) == cpu_kernel(name), (name, iface.texels)
        assert set(iface.texels.values()) <= set(TEXEL_FORMATS), name
        assert not set(iface.texels) & set(iface.written), name
        seen += bool(iface.texels)
    assert seen >= 50
