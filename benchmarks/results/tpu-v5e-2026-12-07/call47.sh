# JAX's ragged kernel at heads of 128 with smaller blocks (its defaults for head 128 overflow VMEM at 2048); head 256
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
export PYTHONPATH=$PYTHONPATH:.
export JAX_COMPILATION_CACHE_DIR=/tmp/xla-cache
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
for b in 4,32 8,16; do
el "ragged_kernel: 32 heads of 128, 15 rows at 2048, blocks $b"
timeout 90 python3 benchmarks/ragged_kernel.py --heads 32 --head-dim 128 --context 2048 --blocks $b 2>&1 | grep -v -E "Warn|warn|hugepages|libtpu|E0000|InitGoogle" | tee $OUT/ragged_kernel_h128_2048_$b.txt | tail -24
done
el "ragged_kernel: 32 heads of 128, 15 rows at 512, blocks 4,32"
timeout 90 python3 benchmarks/ragged_kernel.py --heads 32 --head-dim 128 --context 512 --layers 8 --blocks 4,32 2>&1 | grep -v -E "Warn|warn|hugepages|libtpu|E0000|InitGoogle" | tee $OUT/ragged_kernel_h128_512.txt | tail -24
el "ragged_kernel: GPT-J's 16 heads of 256 at 2048, blocks 4,32"
timeout 60 python3 benchmarks/ragged_kernel.py --context 2048 --blocks 4,32 2>&1 | grep -v -E "Warn|warn|hugepages|libtpu|E0000|InitGoogle" | tee $OUT/ragged_kernel_2048.txt | tail -24
el done
