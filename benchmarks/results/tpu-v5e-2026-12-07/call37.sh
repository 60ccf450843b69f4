# the tpu tier's engine tests on this tree (heads-major chunk pages), then the engine with requests arriving in-process
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --find-links .whl-tpu --target /tmp/site httpx fastapi uvicorn 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PYTHONPATH:.:/tmp/site
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "tpu tier: engine tests"
JAX_PLATFORMS=tpu,cpu timeout 240 python3 -m pytest tests/test_tpu.py -p no:xdist -o addopts="-ra --strict-markers" -m tpu -k "mixed or int8 or greedy or paged_kernel" 2>&1 | tail -5 | tee $OUT/tpu_tier.txt
el "engine_calls, this tree"
ARGS="--preset gptj-6b --quantize int8 --kv-cache-dtype int8 --max-batch 16 --max-len 512 --requests 128 --rate 32 --chunk 4"
timeout 330 python3 benchmarks/engine_calls.py $ARGS --mixed on 2>&1 | grep -v -E "Warn|warn|hugepages" | tee $OUT/engine_calls_6b_new.txt | grep -E "tokens/s|warm-up|mixed:|decode:|prefill:"
el done
