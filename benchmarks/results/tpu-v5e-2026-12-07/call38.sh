# the engine with requests arriving in-process on the previous tree (54f7e13: heads-first codes, batched transfers)
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
export PYTHONPATH=$PYTHONPATH:.:/tmp/site
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "engine_calls, 54f7e13"; uptime
ARGS="--preset gptj-6b --quantize int8 --kv-cache-dtype int8 --max-batch 16 --max-len 512 --requests 128 --rate 32 --chunk 4"
timeout 330 python3 .tpu/old/benchmarks/engine_calls.py $ARGS --mixed on 2>&1 | grep -v -E "Warn|warn|hugepages" | tee $OUT/engine_calls_6b_old.txt | grep -E "tokens/s|warm-up|mixed:|decode:|prefill:"
el done
