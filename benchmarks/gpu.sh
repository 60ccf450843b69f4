#!/usr/bin/env bash
# meshlm's speed on one GPU against the hardware's limits (see benchmarks/gpu.py for what is measured).
# Needs no network: JAX with CUDA, numpy, optax and orbax installed; meshlm is taken from this checkout.
# Writes $OUT/gpu.json and $OUT/gpu.md (OUT defaults to benchmarks/results/gpu-run). Extra arguments go
# to gpu.py, e.g. `bash benchmarks/gpu.sh --tiny` or `--train-batches 4,2 --attention xla`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export OUT="${OUT:-$root/benchmarks/results/gpu-run}"
mkdir -p "$OUT"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# One process owns the GPU: let XLA take most of its memory up front rather than the default 75%.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}"
python "$root/benchmarks/gpu.py" --out "$OUT" "$@"
cat "$OUT/gpu.md"
