# JAX's ragged kernel at heads of 128 (Pythia-6.9B's 32 x 128: GPT-J's 256 does not compile in JAX 0.10.2); then the
# stall with w8a8 projections
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
export PYTHONPATH=$PYTHONPATH:.
export JAX_COMPILATION_CACHE_DIR=/tmp/xla-cache
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
for c in 2048 512; do
el "ragged_kernel: 32 heads of 128, 15 rows at $c"
timeout 120 python3 benchmarks/ragged_kernel.py --heads 32 --head-dim 128 --context $c 2>&1 | grep -v -E "Warn|warn|hugepages|libtpu|E0000|InitGoogle" | tee $OUT/ragged_kernel_h128_$c.txt | tail -24
done
el "prefill_stall w8a8"
timeout 330 python3 benchmarks/prefill_stall.py --model gptj-6b --quantize w8a8 --kv-cache-dtype int8 --rows 15 --context 64 --prompt 1792 --budgets 256 --chunk 8 --repeats 2 --mixed on 2>&1 | grep -v -E "Warn|warn|hugepages" | tail -12 | tee $OUT/prefill_stall_6b_w8a8.txt
el done
