# where benchmarks/ragged_kernel.py waits at heads of 128 (a Python traceback on SIGABRT)
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1
export PYTHONPATH=$PYTHONPATH:. PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "small"
timeout -s ABRT 60 python3 -X faulthandler benchmarks/ragged_kernel.py --heads 32 --head-dim 128 --context 512 --rows 3 --layers 1 --kv bfloat16 --blocks 4,16 2>&1 | grep -v -E "Warn|warn|hugepages|libtpu|E0000|InitGoogle|symbolize|^    @" | tail -30 | tee $OUT/small.txt
el "large"
timeout -s ABRT 100 python3 -X faulthandler benchmarks/ragged_kernel.py --heads 32 --head-dim 128 --context 2048 --kv bfloat16 --blocks 4,16 2>&1 | grep -v -E "Warn|warn|hugepages|libtpu|E0000|InitGoogle|symbolize|^    @" | tail -30 | tee $OUT/large.txt
el done
