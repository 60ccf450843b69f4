# the tpu tier's w8a8 test, printing its measures; then the engine with requests arriving in-process, GPT-J-6B w8a8
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
export PYTHONPATH=$PYTHONPATH:.
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
uptime
el "tpu tier: w8a8"
JAX_PLATFORMS=tpu,cpu timeout 150 python3 -m pytest tests/test_tpu.py -s -p no:xdist -o addopts="-ra --strict-markers" -m tpu -k "w8a8" 2>&1 | grep -v -E "Warn|warn|hugepages|libtpu" | tail -40 | cut -c1-300 | tee $OUT/tpu_tier_w8a8.txt
el "engine_calls, w8a8"
ARGS="--preset gptj-6b --quantize w8a8 --kv-cache-dtype int8 --max-batch 16 --max-len 512 --requests 128 --rate 32 --chunk 4"
timeout 330 python3 benchmarks/engine_calls.py $ARGS --mixed on 2>&1 | grep -v -E "Warn|warn|hugepages" | tee $OUT/engine_calls_6b_w8a8.txt | grep -E "tokens/s|warm-up|mixed:|decode:|prefill:"
el done
