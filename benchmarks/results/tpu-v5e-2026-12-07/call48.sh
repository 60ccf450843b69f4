# how long JAX's ragged kernel takes to compile at heads of 128 (benchmarks/ragged_kernel.py timed out compiling)
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "16 heads x 128, 4 rows of 512, blocks 4,8"
timeout 100 python3 .tpu/ragged_compile.py 16 128 4 4 4,8 2>&1 | grep -E "compiled|GB/s|Error|error" | tail -3 | tee $OUT/ragged_compile_small.txt
el "32 heads x 128, 16 rows of 2048, blocks 4,16"
timeout 150 python3 .tpu/ragged_compile.py 32 128 16 16 4,16 2>&1 | grep -E "compiled|GB/s|Error|error" | tail -3 | tee $OUT/ragged_compile_large.txt
el done
