# GPT-J-6B, int8 weights, int8 KV pool: the engine in-process (scheduler, sampler, host loop), 16 rows of 1,792 prompt tokens + 256 new (rows end at 2,048), steady step
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --find-links .whl-tpu --target /tmp/site httpx fastapi uvicorn 2>&1 | grep -v "already exists" | tail -1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
uptime; git log --oneline -1
el "serve_tpu engine part: 16 rows x (1792 + 256), int8 weights, int8 pool, random weights in place"
timeout 380 python3 benchmarks/serve_tpu.py --quantize int8 --kv-cache-dtype int8 --rows 16 --context 1792 --new 256 --repeats 1 --requests 0 --out $OUT 2>&1 | grep -v -E "Warn|warn|hugepages" | tail -30 | tee $OUT/call21_output.txt
el done
