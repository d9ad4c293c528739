#!/bin/bash
# One `device` run: the engine's steps of two versions of hmad alternated on one GPU (27B- and 270M-shaped
# synthetic files; prefill 512, decode at 1, 8, 16, 32 sequences), then bench/compare_ab.py's table.
#   bash bench/device_ab.sh OLD.tar.gz [rounds]     # OLD: `git archive <commit> | gzip`, carried
# Run from the new version's root, with OUT set; the files are written by the new version's bench.
set -uo pipefail
. bench/device_env.sh
OUT=${OUT:-/tmp/out}
old=$1 rounds=${2:-2}
mkdir -p "$OUT" /tmp/ab-old && tar xzf "$old" -C /tmp/ab-old
[ -f /tmp/syn-27b.gguf ] || python3 -c "
import sys; sys.path.insert(0, 'bench'); from pathlib import Path; from bench_vulkan_model import write_model
for n in ('270m', '27b'): write_model(Path(f'/tmp/syn-{n}.gguf'), n)"
args="--models 270m,27b --gguf 270m=/tmp/syn-270m.gguf --gguf 27b=/tmp/syn-27b.gguf --engine none --reps 10"
for i in $(seq "$rounds"); do
    for side in old new; do
        dir=$PWD; [ $side = old ] && dir=/tmp/ab-old
        echo "== $side round $i $(date +%T)"
        (cd "$dir" && PYTHONPATH=/tmp/site:$dir/daemon:$dir/client:$dir/bench timeout 280 python3 bench/bench_vulkan_model.py \
            $args --out "$OUT/ab_${side}_$i.json" 2>&1 | grep -E "tok/s" | cut -c1-160)
    done
done
python3 bench/compare_ab.py --a "$OUT"/ab_old_*.json --b "$OUT"/ab_new_*.json --names before,after
