#!/usr/bin/env python3
"""The measured cooperative-matrix peak: TFLOP/s of float16 16×16×16 products into float32 accumulators (the
shape of hmad's GEMM, shaders/mul_mm_coopmat.comp) and nothing else (shaders/coopmat_peak.comp): what issue
17's "prefill at 40 % of the peak" is measured against.

A configuration is a kernel variant (``coopmat_peak_a<NA>x<NB>``: NA × NB independent accumulators a
subgroup), a workgroup size (subgroups of 32 a workgroup) and a workgroup count (``--per-sm`` workgroups per
SM; the SM count is read through VK_NV_shader_sm_builtins or VK_AMD_shader_core_properties, else given as
``--sms``). Per configuration the loop count is set so that one dispatch takes about ``--target-ms``, then
``--reps`` dispatches (a barrier between each: they all write the output) are recorded with a timestamp after
each, submitted once to warm up and once measured; TFLOP/s = 2 · 16³ · products / median dispatch time
(host time of the submit over ``--reps`` where the device has no timestamps). The whole list is run after
``--warm-s`` seconds of the first configuration (the clocks rise under load). Reports every configuration and
the largest as ``peak_tflops``; exits with a message on a device without the float16 cooperative matrix.

    python3 bench/bench_vulkan_coopmat_peak.py --out peak.json                      # device machine
    python3 bench/bench_vulkan_coopmat_peak.py --variants a2x4 --blocks 128 --per-sm 4  # one configuration
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

import vulkan as vk  # noqa: E402

from hmad.backends.vulkan.device import Device  # noqa: E402
from hmad.backends.vulkan.kernels_coopmat import coopmat_usable  # noqa: E402
from hmad.backends.vulkan.memory import Uploader, create_buffer  # noqa: E402
from hmad.backends.vulkan.pipelines import Kernel  # noqa: E402
from hmad.backends.vulkan.push import CoopMatPeakPush  # noqa: E402
from hmad.backends.vulkan.recorder import CommandRecorder  # noqa: E402
from hmad.backends.vulkan.vkffi import lib, new  # noqa: E402

FLOP_PER_PRODUCT = 2 * 16 * 16 * 16  # one 16×16×16 coopMatMulAdd


def sm_count(dev) -> tuple[int | None, str]:
    """(SMs or CUs of the device, where the number came from): VK_NV_shader_sm_builtins' shaderSMCount, or
    VK_AMD_shader_core_properties' engines × arrays × CUs; None where neither is there (or says 0)."""
    exts = dev.info.extensions
    if "VK_NV_shader_sm_builtins" in exts:
        ext = new(
            "VkPhysicalDeviceShaderSMBuiltinsPropertiesNV",
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_SM_BUILTINS_PROPERTIES_NV,
        )
        _properties2(dev, ext)
        return int(ext.shaderSMCount) or None, "VK_NV_shader_sm_builtins"
    if "VK_AMD_shader_core_properties" in exts:
        ext = new(
            "VkPhysicalDeviceShaderCorePropertiesAMD",
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_CORE_PROPERTIES_AMD,
        )
        _properties2(dev, ext)
        cus = ext.shaderEngineCount * ext.shaderArraysPerEngineCount * ext.computeUnitsPerShaderArray
        return int(cus) or None, "VK_AMD_shader_core_properties"
    return None, "unknown"


def _properties2(dev, ext) -> None:
    """Fill the extension struct ``ext`` through vkGetPhysicalDeviceProperties2 (core in Vulkan 1.1)."""
    props = new("VkPhysicalDeviceProperties2", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2)
    props.pNext = ext
    lib.vkGetPhysicalDeviceProperties2(dev.info.handle, props)


def fragments(dev, up, na: int, nb: int, rng):
    """Device buffers of NA A and NB B fragments (16 × 16 float16, uniform in [-1, 1])."""
    out = []
    for n in (na, nb):
        host = rng.uniform(-1, 1, (n, 16, 16)).astype(np.float16)
        buf = create_buffer(dev, host.nbytes, "device", "fragments")
        up.upload(buf, host)
        out.append(buf)
    up.flush()
    return out


def dispatch_ns(dev, kern, bufs, groups: int, iters: int, reps: int) -> float:
    """Median GPU ns of one dispatch of ``groups`` workgroups at ``iters`` loop iterations (only workgroup 0
    stores its accumulators), over ``reps`` recorded back to back."""
    rec = CommandRecorder(dev, timestamps=True, max_commands=reps + 1).begin()
    for _ in range(reps):
        rec.dispatch(kern, bufs, CoopMatPeakPush(iters, 1, CoopMatPeakPush.NAN), groups)
    rec.end()
    rec.submit()  # warm-up
    host_s = rec.submit()
    times = rec.gpu_times()
    rec.close()
    if not times:
        return host_s * 1e9 / reps
    return float(np.median([ns for _, ns in times["commands"]]))


def run_config(dev, kern, bufs, na: int, nb: int, groups: int, args) -> dict:
    """Time one configuration, the loop count scaled to about ``args.target_ms`` from short runs (twice: the
    first, at 64 iterations, may be mostly the dispatch's fixed cost)."""
    iters = 64
    for _ in range(2):
        ns = dispatch_ns(dev, kern, bufs, groups, iters, 3)
        iters = max(1, min(round(iters * args.target_ms * 1e6 / ns), 64 * iters))
    ns = dispatch_ns(dev, kern, bufs, groups, iters, args.reps)
    subgroups = kern.block_size // 32
    products = groups * subgroups * iters * CoopMatPeakPush.ROUNDS * na * nb
    return {
        "kernel": kern.name,
        "accumulators": na * nb,
        "subgroups": subgroups,
        "block": kern.block_size,
        "groups": groups,
        "iters": iters,
        "us": ns / 1e3,
        "TFLOPs": products * FLOP_PER_PRODUCT / ns / 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument(
        "--variants",
        default="a2x2,a2x4,a4x4",
        help="coopmat_peak_<variant> kernels (a4x4_lds, a4x4_step: the staged ones, see the shader)",
    )
    ap.add_argument("--blocks", default="128,256", help="workgroup sizes (32 per subgroup)")
    ap.add_argument("--per-sm", default="1,2,4,8", help="workgroups per SM")
    ap.add_argument("--sms", type=int, default=0, help="SM count when the device does not report it")
    ap.add_argument("--target-ms", type=float, default=4.0, help="GPU time of one dispatch")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warm-s", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = Device(args.device)
    if not coopmat_usable(dev.info):
        dev.close()
        raise SystemExit(
            f"{dev.info.name}: no float16 16x16x16 cooperative matrix with float32 accumulators and 32-wide "
            "subgroups (VK_KHR_cooperative_matrix, Vulkan 1.3): no cooperative-matrix peak to measure"
        )
    sms, source = sm_count(dev)
    if args.sms:
        sms, source = args.sms, "--sms"
    if sms is None:
        dev.close()
        raise SystemExit(f"{dev.info.name} does not report its SM count: give it as --sms")
    res = {"device": dev.describe()["name"], "driver": dev.info.driver, "sms": sms, "sms_from": source}
    print(f"{res['device']} ({res['driver']}): {sms} SMs ({source})", flush=True)
    up, rng = Uploader(dev), np.random.default_rng(0)
    res["configs"] = []
    warmed = False
    for variant in args.variants.split(","):
        na, nb = (int(v) for v in variant.split("_")[0].removeprefix("a").split("x"))
        a, b = fragments(dev, up, na, nb, rng)
        for block in map(int, args.blocks.split(",")):
            kern = Kernel(dev, f"coopmat_peak_{variant}", block_size=block)
            c = create_buffer(dev, block // 32 * na * nb * 1024, "device", "accumulators")
            for per_sm in map(int, args.per_sm.split(",")):
                if not warmed:
                    t_end = time.perf_counter() + args.warm_s
                    while time.perf_counter() < t_end:
                        run_config(dev, kern, [a, b, c], na, nb, sms * per_sm, args)
                    warmed = True
                r = run_config(dev, kern, [a, b, c], na, nb, sms * per_sm, args) | {"per_sm": per_sm}
                res["configs"].append(r)
                print(
                    f"{r['kernel']:18s} {r['accumulators']:2d} acc, {r['subgroups']} subgroups a workgroup, "
                    f"{per_sm} a SM ({r['groups']} groups, {r['iters']} iterations): {r['us']:8.1f} us "
                    f"{r['TFLOPs']:7.1f} TFLOP/s",
                    flush=True,
                )
            kern.close()
            c.arena.close()
        a.arena.close()
        b.arena.close()
    best = max(res["configs"], key=lambda r: r["TFLOPs"])
    res["peak_tflops"], res["peak_config"] = best["TFLOPs"], best
    where = f"{best['kernel']}, block {best['block']}, {best['per_sm']} a SM"
    print(f"peak_tflops {best['TFLOPs']:.1f} ({where})")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    up.close()
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
