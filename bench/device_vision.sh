#!/bin/bash
# One `device` run (carry .gl .whl .peer) for image input: the GPU tests of the image paths, then
# bench_vision.py on the 27B-shaped synthetic file with a synthetic tower of Gemma 3's real shape, beside
# llama-server --mmproj; the memory's own bandwidth and the cooperative-matrix peak in the same call.
#   OUT=... bash bench/device_vision.sh
set -uo pipefail
. bench/device_env.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/peer/bin
[ -x /tmp/peer/bin/llama-server ] || tar xzf .peer/llama-server-bin.tar.gz -C /tmp/peer/bin
echo "== tests $(date +%T)"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_vulkan_images.py tests/test_vulkan_vision.py \
    tests/test_vision_daemon.py tests/test_vulkan_ops.py tests/test_vulkan_backend.py \
    -k "not embedded_model_greedy" >"$OUT/tests.log" 2>&1
tail -5 "$OUT/tests.log" | cut -c1-300
echo "== limits $(date +%T)"
timeout 60 python3 bench/bench_memory_limit.py --seconds 1 --json "$OUT/memory.json" | grep -v '^{' | tail -3
timeout 60 python3 bench/bench_vulkan_coopmat_peak.py --blocks 128 --per-sm 4 --out "$OUT/peak.json" | tail -2
echo "== write $(date +%T)"
python3 -c "
import sys, time; sys.path.insert(0, 'bench'); from pathlib import Path; from bench_vulkan_model import write_model
t = time.time(); write_model(Path('/tmp/syn-27b.gguf'), '27b'); print('27b written in', round(time.time() - t, 1), 's')"
cat /tmp/syn-27b.gguf >/dev/null
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw,temperature.gpu \
    --format=csv | tee "$OUT/gpu.csv"
echo "== vision $(date +%T)"
timeout 420 python3 bench/bench_vision.py --model /tmp/syn-27b.gguf --server-dir /tmp/peer/bin --text-width 5376 \
    --parts encoder,hmad,hmad@2048,peer --json "$OUT/vision.json" 2>&1 | cut -c1-1500 | tail -30
echo "== done $(date +%T)"
