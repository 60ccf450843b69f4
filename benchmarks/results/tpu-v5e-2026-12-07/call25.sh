# the whole-prompt baseline of chunked prefill on the chip (a 1,792-token prompt within a 2,048 budget now runs whole),
# against chunks of 1,024 and 256, while 15 rows of GPT-J-6B (int8, int8 pool) decode; then the whole tpu tier
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --find-links .whl-tpu --target /tmp/site httpx fastapi uvicorn 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PYTHONPATH:/tmp/site
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
uptime; python3 -c "import jax; print(jax.__version__, jax.devices())"
el "prefill_stall gptj-6b"
timeout 330 python3 benchmarks/prefill_stall.py --model gptj-6b --quantize int8 --kv-cache-dtype int8 --rows 15 --context 64 --prompt 1792 --budgets 2048,1024,256 --chunk 8 --repeats 2 2>&1 | grep -v -E "Warn|warn|hugepages" | tail -14 | tee $OUT/prefill_stall_6b.txt
el "tpu tier"
JAX_PLATFORMS=tpu,cpu timeout 240 python3 -m pytest tests/test_tpu.py -p no:xdist -o addopts="-ra --strict-markers" -m tpu -q --durations=10 2>&1 | tail -22 | tee $OUT/tpu_tier.txt
el done
