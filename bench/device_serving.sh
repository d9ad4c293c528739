#!/bin/bash
# One `device` run (carry .gl .whl .peer) for the serving path: load time beside llama-server on the same
# file, hmad's load profile, and the daemon's throughput beside its engine, per model shape. Results in $OUT.
#   bash bench/device_serving.sh [write] [tests] [ready] [peer_load] [load_profile] [daemon_270m] [daemon_27b]
#       [peer_270m] [peer_27b] [prefix] [determinism] [copy] [compare_270m] [compare_27b] [steps]
#       [nopipe_270m] [nopipe_27b] [host_step] [sampled_270m] [sampled_27b] [limits]
# The like-for-like table of README and docs/performance.md: `bash bench/device_serving.sh compare_27b
# compare_270m` (each writes the synthetic files and runs `limits` first when they are missing).
# At most 8 files come back from $OUT: run with OUT=/tmp/r and tar it into the real $OUT.
set -uo pipefail
. bench/device_env.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/peer
mkdir -p /tmp/peer/bin; [ -x /tmp/peer/bin/llama-server ] || tar xzf .peer/llama-server-bin.tar.gz -C /tmp/peer/bin
write_models() {  # the synthetic 270M- and 27B-shaped files (bench_vulkan_model.write_model), page cache warmed
    python3 -c "
import sys, time; sys.path.insert(0, 'bench'); from pathlib import Path; from bench_vulkan_model import write_model
for n in ('270m', '27b'):
    t = time.time(); write_model(Path(f'/tmp/syn-{n}.gguf'), n); print(n, 'written in', round(time.time() - t, 1), 's')"
    cat /tmp/syn-27b.gguf > /dev/null; ls -la /tmp/syn-*.gguf
}
limits() {  # the memory's own bandwidth (cudaMemcpy, no kernel of ours) and the warm Vulkan read ceiling,
    # each with the GPU's clocks: the limits every decode figure is given against
    timeout 120 python3 bench/bench_memory_limit.py --json "$OUT/memory.json" | grep -v '^{'
    timeout 150 python3 bench/bench_vulkan_copy.py --mib 1024 --iters 20 \
        --variants read_vec4,read_vec4_x4,read_vec4_x8,copy_vec4_x4 --out "$OUT/copy.json" | tail -5
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw,temperature.gpu \
        --format=csv | tee "$OUT/gpu.csv"
}
for step in ${*:-write peer_load load_profile daemon_270m daemon_27b}; do
    echo "== $step $(date +%T)"
    case $step in
    write)  # the synthetic files
        write_models
        ;;
    peer_load)  # llama-server's load time on the 27B file, twice
        for i in 1 2; do
            timeout 120 python3 bench/bench_peer.py --server-dir /tmp/peer/bin --gguf /tmp/syn-27b.gguf --load-only \
                --streams 1 --json "$OUT/peer_load_$i.json" 2>&1 | grep ready
        done
        ;;
    ready)  # READY side by side on the 27B file: llama-server then hmad, three starts each (the first one
            # fills the drivers' shader caches), alternated
        for i in 1 2 3; do
            timeout 120 python3 bench/bench_peer.py --server-dir /tmp/peer/bin --gguf /tmp/syn-27b.gguf --load-only \
                --streams 1 --json "$OUT/peer_ready_$i.json" 2>&1 | grep "ready in"
            timeout 120 python3 bench/bench_daemon.py --model /tmp/syn-27b.gguf --backend vulkan --ready-only 1 \
                --json "$OUT/hmad_ready_$i.json" 2>&1 | grep "ready in" | cut -c1-400
        done
        ;;
    tests)  # every GPU-marked test on the GPU (the Vulkan kernels and backend, prefix cache, determinism)
        # the 270M-shaped synthetic file stands in for the embedded model (not carried: 253 MB): the tests that
        # compare it with the numpy backend are left out (random weights tie often), the determinism ones run
        HMAD_TEST_MODEL=/tmp/syn-270m.gguf timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu \
            -k "not embedded_model_greedy_equals_cpu" $(ls tests/test_vulkan_*.py tests/test_prefix_cache.py \
            tests/test_determinism*.py 2>/dev/null) >"$OUT/tests.log" 2>&1
        tail -8 "$OUT/tests.log" | cut -c1-200
        ;;
    prefix)  # time to first token with a ~2,000-token prefix computed, then cached (the 270M-shaped file)
        timeout 300 python3 bench/bench_prefix_cache.py --model /tmp/syn-270m.gguf --backend vulkan --runs 3 \
            --json "$OUT/prefix_cache.json" >"$OUT/prefix_cache.log" 2>&1
        tail -6 "$OUT/prefix_cache.log" | cut -c1-200
        ;;
    determinism)  # the price of engine.deterministic: decode 1/8/32 and prefill 512, off and on, both shapes
        timeout 400 python3 bench/bench_determinism.py --backend vulkan --models 270m,27b --dir /tmp \
            --out "$OUT/determinism.json" >"$OUT/determinism.log" 2>&1
        tail -14 "$OUT/determinism.log" | cut -c1-200
        ;;
    load_profile)  # hmad's load of the 27B file in-process under cProfile, and its buckets' recording
        timeout 200 python3 bench/bench_load.py --gguf /tmp/syn-27b.gguf --top 25 --json "$OUT/load_profile.json" \
            >"$OUT/load_profile.log" 2>&1
        head -120 "$OUT/load_profile.log" | cut -c1-150
        ;;
    daemon_270m | daemon_27b)  # through the daemon (first burst, steady 8 and 32) beside the engine in-process
        m=${step#daemon_}
        timeout 400 python3 bench/bench_daemon.py --model /tmp/syn-$m.gguf --backend vulkan --engine \
            --json "$OUT/daemon_$m.json" 2>&1 | tail -12 | cut -c1-300
        ;;
    copy)  # the Vulkan copy and read ceilings, warm (clocks up) and the first submit's, random bytes and zeros
        timeout 120 python3 bench/bench_vulkan_copy.py --mib 1024 --iters 20 --out "$OUT/copy.json" | tail -7
        timeout 120 python3 bench/bench_vulkan_copy.py --mib 1024 --iters 20 --fill zero | tail -1
        ;;
    limits)  # the memory's bandwidth and the Vulkan read ceiling, with clocks
        limits
        ;;
    steps)  # the engine's steps alone on both written files: prefill 512, decode at 1, 8, 32, the weights'
        # read rate against the read-only ceiling of random bytes, per-kernel GPU time
        timeout 400 python3 bench/bench_vulkan_model.py --models 270m,27b --gguf 270m=/tmp/syn-270m.gguf \
            --gguf 27b=/tmp/syn-27b.gguf --engine none --reps 10 --out "$OUT/steps.json" 2>&1 \
            | grep -E "ceiling|tok/s|GiB" | cut -c1-200
        ;;
    compare_270m | compare_27b)  # hmad through the daemon beside llama-server at its best on the same file:
        # prefill 512, 1, 8 and 32 streams of 128-token prompts, both idle and warmed (bench/compare_peer.py
        # pairs decode with decode, prefill with prefill, and prints the wall figures apart)
        m=${step#compare_}
        [ -f /tmp/syn-$m.gguf ] || write_models
        [ -f "$OUT/memory.json" ] || limits
        timeout 300 python3 bench/bench_peer.py --server-dir /tmp/peer/bin --gguf /tmp/syn-$m.gguf --prompt-len 128 \
            --ub-sweep 256,512,1024,2048 --json "$OUT/peer_$m.json" 2>&1 | grep -E "^llama-server" | cut -c1-250
        timeout 400 python3 bench/bench_daemon.py --model /tmp/syn-$m.gguf --backend vulkan --levels 1,8,32 \
            --prompt-tokens 128 --no-first-burst --json "$OUT/hmad_$m.json" 2>&1 \
            | grep -E "ready|steady|prefill|per step" | cut -c1-250
        python3 bench/compare_peer.py --hmad "$OUT/hmad_$m.json" --peer "$OUT/peer_$m.json" \
            --memory "$OUT/memory.json" --copy "$OUT/copy.json" --weights-bytes "$(stat -c %s /tmp/syn-$m.gguf)" \
            --json "$OUT/compare_$m.json"
        ;;
    nopipe_270m | nopipe_27b)  # hmad with engine.pipeline off, as compare_* runs it (after compare_*: the
        # same llama-server figures; the ratios of both settings in one call)
        m=${step#nopipe_}
        timeout 400 python3 bench/bench_daemon.py --model /tmp/syn-$m.gguf --backend vulkan --levels 1,8,32 \
            --prompt-tokens 128 --set engine.pipeline=false --json "$OUT/hmad_nopipe_$m.json" 2>&1 \
            | grep -E "steady|prefill|per step" | cut -c1-200
        python3 bench/compare_peer.py --hmad "$OUT/hmad_nopipe_$m.json" --peer "$OUT/peer_$m.json" \
            --copy "$OUT/copy.json" --weights-bytes "$(stat -c %s /tmp/syn-$m.gguf)"
        ;;
    sampled_270m | sampled_27b)  # Gemma's recommended sampling (temperature 1, top_k 64, top_p 0.95) on both
        # servers, 1, 8 and 32 streams; hmad with engine.pipeline on (the tokens drawn on the GPU) and off
        m=${step#sampled_}
        timeout 300 python3 bench/bench_peer.py --server-dir /tmp/peer/bin --gguf /tmp/syn-$m.gguf --prompt-len 128 \
            --sampling gemma --json "$OUT/peer_sampled_$m.json" 2>&1 | grep -E "ready|streams" | head -6
        for pipe in true false; do
            timeout 400 python3 bench/bench_daemon.py --model /tmp/syn-$m.gguf --backend vulkan --levels 1,8,32 \
                --prompt-tokens 128 --prefill 0 --sampling gemma --set engine.pipeline=$pipe \
                --json "$OUT/hmad_sampled_${pipe}_$m.json" 2>&1 | grep -E "steady|per step|steps so far" | cut -c1-200
            python3 bench/compare_peer.py --hmad "$OUT/hmad_sampled_${pipe}_$m.json" --peer "$OUT/peer_sampled_$m.json" \
                --copy "$OUT/copy.json" --weights-bytes "$(stat -c %s /tmp/syn-$m.gguf)"
        done
        ;;
    host_step)  # the engine's host work a step beside the device's, engine.pipeline on and off (270M shape)
        timeout 200 python3 bench/bench_host_step.py --model /tmp/syn-270m.gguf --reps 3 2>&1 | tee "$OUT/host_step.txt" \
            | grep -E "pipeline|rep "
        ;;
    peer_270m | peer_27b)  # llama-server's prefill, 1, 8 and 32 streams on the same file
        m=${step#peer_}
        timeout 300 python3 bench/bench_peer.py --server-dir /tmp/peer/bin --gguf /tmp/syn-$m.gguf \
            --json "$OUT/peer_$m.json" 2>&1 | grep -E "ready|prefill|streams" | head -8
        ;;
    esac
done
echo "== done $(date +%T)"
