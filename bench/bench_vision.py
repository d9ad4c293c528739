#!/usr/bin/env python3
"""Image input beside llama-server --mmproj, in one run: Gemma 3's real vision tower shape (896 px, patch
14, width 1152, 27 layers, 16 heads, FFN 4304, 256 soft tokens) with synthetic weights, on a text model.

    python3 bench/bench_vision.py --model syn-27b.gguf --server-dir DIR [--text-width 5376] [--json out.json]

It writes the projector GGUF both servers load (``write_mmproj``: llama.cpp's mmproj layout, float16
matrices, as its converter writes them), then measures, each server started alone on the idle GPU:

- ``encoder``: hmad's encoder alone (VulkanVisionOps, in-process): ms per image at 1 and 8 images a call
  (warm: recorded once, the median of 5 replays), the GPU's time per kernel class (timestamps) and the
  encoder's FLOP rate (the GEMMs' and attention's multiply-adds counted from the shape);
- ``hmad`` / ``peer``: through each server's API, a fresh random 896 x 896 PNG and a 64-token question,
  1 new token: the client's time to first token (the median of 3, each image new to the server); then 8
  concurrent requests with 8 different images: their wall time (the aggregate image rate). hmad through
  hmaclient (images= beside a prompt); llama-server through /v1/chat/completions with a data: URI, and
  its log's own "image slice encoded in N ms" lines. ``hmad@N`` (in ``--parts``): hmad again with
  engine.step_tokens and engine.max_chunk N (2048: llama-server's logical batch here, ``-b 2048``).
The GPU's clocks are sampled during every timed section (gpu_clocks.py).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_daemon import start as start_hmad  # noqa: E402
from bench_peer import free_port, server_flags, wait_ready  # noqa: E402
from bench_peer import start as start_peer  # noqa: E402
from gpu_clocks import ClockLog  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from synthetic_mmproj import GEMMA3_TOWER, write_mmproj  # noqa: E402

QUESTION = " ".join(["describe"] * 64)  # about 64 tokens on any vocabulary


def png(seed: int, size: int = 896) -> bytes:
    px = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(px).save(out, format="PNG", compress_level=1)
    return out.getvalue()


def encoder_flops(t: dict) -> float:
    """Multiply-adds x 2 of one image: the 27 layers' GEMMs and attention, the patch embedding."""
    p = (t["image_size"] // t["patch_size"]) ** 2
    d, f = t["hidden"], t["ffn"]
    per_layer = 2 * p * (4 * d * d + 2 * d * f) + 4 * p * p * d
    return t["n_layers"] * per_layer + 2 * p * d * 3 * t["patch_size"] ** 2


def bench_encoder(mmproj: Path) -> dict:
    """hmad's encoder alone on the Vulkan backend: ms per image at 1 and 8 images a call."""
    from hmad.backends.vulkan.backend import VulkanBackend
    from hmad.model.siglip import VisionTower
    from hmad.model.vision import read_mmproj

    cfg, weights = read_mmproj(mmproj)
    be = VulkanBackend()
    ops = be.vision_ops()
    tower = VisionTower(cfg, weights, ops)
    ops.prepare(tower)  # uploaded as the daemon loads it
    out, flops = {}, encoder_flops(GEMMA3_TOWER)
    for n in (1, 8):
        px = np.random.default_rng(n).uniform(-1, 1, (n, 3, 896, 896)).astype(np.float32)
        ops.run(tower, px)  # records
        times = []
        with ClockLog(f"encoder {n}") as clk:
            for _ in range(5):
                t0 = time.perf_counter()
                ops.run(tower, px)
                times.append(time.perf_counter() - t0)
        ops.timestamps = True  # a replay with timestamps: its own recording (made by this first run)
        ops.run(tower, px)
        ops.run(tower, px)
        ops.timestamps = False
        commands = ops.last_gpu.get("commands", [])
        if not commands:
            raise RuntimeError("vision encoder: no GPU timestamps came back (ops.last_gpu is empty)")
        kernels = gpu_ms_by_kernel(commands)
        ms = 1e3 * statistics.median(times) / n
        out[f"images_{n}"] = {
            "ms_per_image": round(ms, 2),
            "tflop_s": round(flops / (ms / 1e3) / 1e12, 2),
            "gpu_ms_total": round(ops.last_gpu["total_ns"] / 1e6, 2),
            "gpu_ms_by_kernel": kernels,
            "gpu_ms_by_part": gpu_ms_by_part(kernels),
            "commands": len(commands),
            "clocks": clk.summary,
        }
        print(
            f"encoder {n} images: {ms:.1f} ms an image, {out[f'images_{n}']['tflop_s']} TFLOP/s", flush=True
        )
    be.close()
    return {"flop_per_image": flops, **out}


def gpu_ms_by_kernel(commands: list[tuple[str, float]]) -> dict[str, float]:
    """GPU ms per label of ``last_gpu["commands"]`` (a kernel's full name, e.g. mul_mm_coopmat_f16_64x64,
    vision_attention_dh72, row_scale; "vision input" / "vision output" for the copies), largest first."""
    out: dict[str, float] = {}
    for label, ns in commands:
        out[label] = out.get(label, 0.0) + ns / 1e6
    return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


#: which part of the encoder a kernel label belongs to (the first prefix that matches)
PARTS = (
    (
        "gemm",
        ("mul_mm_coopmat_", "mul_mat_", "vision_linear_", "vision_matmul_", "row_scale", "split_reduce"),
    ),
    ("attention", ("vision_attention",)),
    ("norms", ("vision_layer_norm", "vision_rms_norm")),
    ("eltwise", ("vision_add", "vision_gelu", "vision_bias_gelu", "vision_im2col", "vision_pool")),
    ("copies", ("vision input", "vision output")),
)


def gpu_ms_by_part(kernels: dict[str, float]) -> dict[str, float]:
    """gpu_ms_by_kernel summed by PARTS (anything else: "other")."""
    out: dict[str, float] = {}
    for label, ms in kernels.items():
        part = next((p for p, prefixes in PARTS if label.startswith(prefixes)), "other")
        out[part] = round(out.get(part, 0.0) + ms, 3)
    return out


async def hmad_requests(sock: str, images: list[bytes]) -> list[tuple[float, object]]:
    from hmaclient import AsyncClient

    async def one(c, img):
        t0 = time.perf_counter()
        r = await c.generate(QUESTION, images=[img], max_tokens=1, temperature=0)
        return time.perf_counter() - t0, r

    async with AsyncClient(sock, timeout=600) as c:
        await c.connect()
        return await asyncio.gather(*(one(c, img) for img in images))


def bench_hmad(a, mmproj: Path, step_tokens: int = 512) -> dict:
    """hmad through hmaclient; ``step_tokens``: engine.step_tokens and engine.max_chunk (512: the default;
    2048: llama-server's logical batch here, ``-b 2048``)."""
    from hmaclient import Client

    with tempfile.TemporaryDirectory() as tmp:
        a.set = [f"mmproj={mmproj}", "engine.max_seqs=8"]
        a.set += [f"engine.step_tokens={step_tokens}", f"engine.max_chunk={step_tokens}"]
        proc, sock, ready = start_hmad(a, tmp)
        try:
            asyncio.run(hmad_requests(sock, [png(100)]))  # warm
            with ClockLog("hmad one image") as clk1:
                one = [asyncio.run(hmad_requests(sock, [png(200 + i)]))[0][0] for i in range(3)]
            imgs = [png(300 + i) for i in range(8)]
            with ClockLog("hmad 8 images") as clk8:
                t0 = time.perf_counter()
                res = asyncio.run(hmad_requests(sock, imgs))
                wall8 = time.perf_counter() - t0
            with Client(sock) as c:
                vision = c.status().get("vision", {})
        finally:
            proc.terminate()
            proc.wait(60)
    return {
        "ready_s": round(ready, 2),
        "step_tokens": step_tokens,
        "ttft_one_image_s": {"median": round(statistics.median(one), 4), "all": [round(x, 4) for x in one]},
        "eight_images_wall_s": round(wall8, 3),
        "eight_images_per_s": round(8 / wall8, 2),
        "prompt_tokens": res[0][1].prompt_tokens,
        "status_vision": vision,
        "clocks": [clk1.summary, clk8.summary],
    }


def peer_request(port: int, img: bytes) -> float:
    data_uri = "data:image/png;base64," + base64.b64encode(img).decode()
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image_url",
                        "image_url": {"url": data_uri},
                    },
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        "max_tokens": 1,
        "temperature": 0,
        "cache_prompt": False,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        json.loads(r.read())
    return time.perf_counter() - t0


def bench_peer(a, mmproj: Path) -> dict:
    port = free_port()
    log_path = Path(tempfile.mkdtemp()) / "peer.log"
    with open(log_path, "w") as log:
        flags = [*server_flags(8, 8 * 4096, 512, "on"), "--mmproj", str(mmproj)]
        proc = start_peer(Path(a.server_dir), a.model, port, flags, log)
        try:
            ready = wait_ready(proc, port, 600)
            peer_request(port, png(100))  # warm
            with ClockLog("peer one image") as clk1:
                one = [peer_request(port, png(200 + i)) for i in range(3)]
            imgs = [png(300 + i) for i in range(8)]
            with ClockLog("peer 8 images") as clk8, ThreadPoolExecutor(8) as pool:
                t0 = time.perf_counter()
                list(pool.map(lambda im: peer_request(port, im), imgs))
                wall8 = time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(60)
    text = log_path.read_text(errors="replace")
    encoded = [int(m) for m in re.findall(r"image slice encoded in (\d+) ms", text)]
    return {
        "ready_s": round(ready, 2),
        "ttft_one_image_s": {"median": round(statistics.median(one), 4), "all": [round(x, 4) for x in one]},
        "eight_images_wall_s": round(wall8, 3),
        "eight_images_per_s": round(8 / wall8, 2),
        "log_image_encoded_ms": encoded,
        "log_tail": text[-3000:],
        "clocks": [clk1.summary, clk8.summary],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the text model GGUF both servers load")
    ap.add_argument("--server-dir", required=True, help="llama-server and its libraries")
    ap.add_argument("--text-width", type=int, required=True, help="the text model's d_model")
    ap.add_argument("--mmproj", default="/tmp/syn-mmproj.gguf")
    ap.add_argument("--backend", default="vulkan")
    ap.add_argument("--max-seqs", type=int, default=8)
    ap.add_argument(
        "--parts", default="encoder,hmad,peer", help="also hmad@N: hmad with step_tokens = max_chunk = N"
    )
    ap.add_argument("--json")
    a = ap.parse_args()
    mmproj = Path(a.mmproj)
    if not mmproj.exists():
        t0 = time.perf_counter()
        write_mmproj(mmproj, a.text_width)
        print(
            f"mmproj written in {time.perf_counter() - t0:.1f} s ({mmproj.stat().st_size >> 20} MiB)",
            flush=True,
        )
    result = {"tower": GEMMA3_TOWER, "text_model": a.model, "text_width": a.text_width}
    for part in a.parts.split(","):
        t0 = time.perf_counter()
        try:
            name, _, steps = part.partition("@")
            fn = {"encoder": bench_encoder, "hmad": bench_hmad, "peer": bench_peer}[name]
            args = (mmproj,) if name == "encoder" else (a, mmproj)
            result[part] = fn(*args, *((int(steps),) if steps else ()))
        except Exception as e:  # noqa: BLE001 - one part's failure is reported, the others still run
            result[part] = {"error": f"{type(e).__name__}: {e}"}
        print(part, f"({time.perf_counter() - t0:.0f} s):", json.dumps(result[part])[:1500], flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
