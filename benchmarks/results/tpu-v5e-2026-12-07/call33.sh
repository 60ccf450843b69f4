# the host's transfers batched (one device_put per call's inputs, every output's copy started before the first is
# awaited): GPT-J-6B's engine with requests arriving in-process, the previous tree (c08e2f0) against this one
set -o pipefail
# (.tpu/old held `git archive c08e2f0 meshlm benchmarks`: the tree before the batched transfers)
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --find-links .whl-tpu --target /tmp/site httpx fastapi uvicorn 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PYTHONPATH:.:/tmp/site
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
ARGS="--preset gptj-6b --quantize int8 --kv-cache-dtype int8 --max-batch 16 --max-len 512 --requests 128 --rate 32 --chunk 4"
el "engine_calls, c08e2f0 (transfers one array at a time)"
timeout 260 python3 .tpu/old/benchmarks/engine_calls.py $ARGS --mixed on 2>&1 | grep -v -E "Warn|warn|hugepages" | tee $OUT/engine_calls_6b_old.txt | head -8
el "engine_calls, this tree (batched transfers)"
timeout 300 python3 benchmarks/engine_calls.py $ARGS --mixed on,off 2>&1 | grep -v -E "Warn|warn|hugepages" | tee $OUT/engine_calls_6b_new.txt | grep -E "tokens/s|warm-up"
el done
