# GPT-J-6B, int8 weights, int8 KV pool, 2,048 tokens of context: engine in-process (16 rows) then served over a unix socket
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --find-links .whl-tpu --target /tmp/site httpx fastapi uvicorn 2>&1 | grep -v "already exists" | tail -1
python3 -c "import fastapi, uvicorn, httpx; print('fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__)"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
uptime; free -g | head -2; git log --oneline -1
el "serve_tpu: engine 16 rows x 2048, then served, int8 pool"
timeout 570 python3 benchmarks/serve_tpu.py --folder /tmp/g6 --quantize int8 --kv-cache-dtype int8 --rows 16 --context 1984 --new 64 --repeats 1 --max-len 2048 --requests 128 --rate 32 --time-limit 60 --out $OUT 2>&1 | grep -v -E "Warn|warn|writing:|hugepages" | tail -40 | tee $OUT/call18_output.txt
el done
