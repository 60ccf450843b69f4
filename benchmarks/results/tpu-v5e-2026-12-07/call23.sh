# GPT-J-6B served over the unix socket at max-len 2048, int8 weights and int8 pool, from a random bf16 HF folder (server alone)
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --find-links .whl-tpu --target /tmp/site httpx fastapi uvicorn 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PYTHONPATH:/tmp/site
python3 -c "import httpx, fastapi, uvicorn; print('httpx ok')"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
uptime; git log --oneline -1
el "serve_tpu --served-only: the folder, then the server"
timeout 540 python3 benchmarks/serve_tpu.py --folder /tmp/g6 --served-only --quantize int8 --kv-cache-dtype int8 --rows 16 --requests 192 --rate 32 --max-len 2048 --time-limit 60 --out $OUT 2>&1 | grep -v -E "Warn|warn|hugepages|writing:" | tail -60 | tee $OUT/call23_output.txt
el done
