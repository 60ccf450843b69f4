# requests arriving in-process into GPT-J-6B's engine (int8 projections and pool), mixed steps off and on
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --find-links .whl-tpu --target /tmp/site httpx fastapi uvicorn 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PYTHONPATH:.:/tmp/site
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "engine_calls gptj-6b"
timeout 540 python3 benchmarks/engine_calls.py --preset gptj-6b --quantize int8 --kv-cache-dtype int8 --max-batch 16 --max-len 512 --requests 128 --rate 32 --chunk 4 --mixed off,on 2>&1 | grep -v -E "Warn|warn|hugepages" | tee $OUT/engine_calls_6b_mixed.txt | tail -60
el done
