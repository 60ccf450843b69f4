# the tpu tier's mixed-steps test and its engine tests (httpx for the conftest); then the stall at 128-token chunks
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --find-links .whl-tpu --target /tmp/site httpx fastapi uvicorn 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PYTHONPATH:.:/tmp/site
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "tpu tier: mixed"
JAX_PLATFORMS=tpu,cpu timeout 200 python3 -m pytest tests/test_tpu.py -p no:xdist -o addopts="-ra --strict-markers" -m tpu -q -k "mixed or engine_on_the_chip or int8_pool" --durations=5 2>&1 | tail -30 | tee $OUT/tpu_mixed.txt
el "prefill_stall gptj-6b 128"
timeout 280 python3 benchmarks/prefill_stall.py --model gptj-6b --quantize int8 --kv-cache-dtype int8 --rows 15 --context 64 --prompt 1792 --budgets 128 --chunk 8 --repeats 2 --mixed off,on 2>&1 | grep -v -E "Warn|warn|hugepages" | tail -12 | tee $OUT/prefill_stall_6b_mixed_128.txt
el done
