#!/bin/bash
# One `device` tool run (carry .gl and .whl): the Vulkan tests on the GPU, the matmul kernels, the models;
# logs and JSON under $OUT, short tails printed.
#   bash bench/device_all.sh [tests] [stats] [matmul] [types] [model] [model_cm2]
set -uo pipefail
. bench/device_env.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for step in ${*:-tests matmul model}; do
    echo "== $step $(date +%T)"
    case $step in
    tests)
        timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_vulkan_*.py >"$OUT/tests.log" 2>&1
        tail -5 "$OUT/tests.log"
        ;;
    stats)
        timeout 60 python3 bench/kernel_stats.py mul_mat_vec_x3_q4_k mul_mat_vec_q8x_q4_k_t1 mul_mm_coopmat_q4_k \
            quantize_x3 --out "$OUT/stats.json" 2>&1 | cut -c1-110
        ;;
    matmul)
        timeout 200 python3 bench/bench_vulkan_matmul.py --iters 20 --prefill 0 --coopmat 8,16,32,512 --blocks 128 \
            --out "$OUT/matmul_q4_k.json" >"$OUT/matmul.log" 2>&1
        grep -E "copy_vec4|T=1:|T=8:|mul_mm" "$OUT/matmul.log" | cut -c1-125
        ;;
    types)  # the coopmat GEMM on the other weight types
        for t in q6_k q5_0 q8_0; do
            timeout 90 python3 bench/bench_vulkan_matmul.py --type $t --iters 10 --prefill 0 --coopmat 32,512 \
                --tokens 1 --blocks 128 --out "$OUT/matmul_$t.json" >"$OUT/matmul_$t.log" 2>&1
            grep -E "mul_mm" "$OUT/matmul_$t.log" | cut -c1-100
        done
        ;;
    model_cm2)  # 27B with decode batches of 2..8 tokens on the GEMM too (float16 products)
        timeout 300 python3 bench/bench_vulkan_model.py --models 27b --reps 10 --gen 32 --coopmat-min-tokens 2 \
            --out "$OUT/model_cm2.json" >"$OUT/model_cm2.log" 2>&1
        grep -E "27b (prefill|decode)|engine [0-9]" "$OUT/model_cm2.log" | cut -c1-120
        ;;
    model)
        timeout 520 python3 bench/bench_vulkan_model.py --models 270m,27b --reps 10 --gen 32 --watchdog-s 500 \
            --out "$OUT/model.json" >"$OUT/model.log" 2>&1
        tail -40 "$OUT/model.log" | cut -c1-160
        ;;
    esac
done
echo "== done $(date +%T)"
