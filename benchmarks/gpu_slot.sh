#!/usr/bin/env bash
# What a lent GPU machine runs (about 15 minutes in all, its start included; no network, no install): from a copy of
# the repository, `bash benchmarks/gpu_slot.sh [gpudist bench gpu options]`. Writes into $OUT (default
# benchmarks/results): gpu.json (rewritten after every part), gpu.log, nvidia-smi.txt. The command bounds itself
# (--budget, 450 s by default); the outer timeout is a backstop that still lets it write its JSON (SIGINT first).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
# Not installed there: gpudist.kernels is the top-level kernels/ (pyproject.toml maps it when installing).
[ -e gpudist/kernels ] || ln -sfn ../kernels gpudist/kernels
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 30 nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
timeout -s INT -k 30 560 python3 -m benchmarks.gpu --require-gpu --out "$OUT/gpu.json" "$@" 2>&1 | tee "$OUT/gpu.log"
exit "${PIPESTATUS[0]}"
