# mixed steps on the chip: the stall of a 1,792-token prompt arriving while 15 rows of GPT-J-6B (int8, int8 pool)
# decode, mixed off and on in the same run; then the tpu tier's mixed-steps test and the engine test
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
export PYTHONPATH=$PYTHONPATH:.
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
uptime; python3 -c "import jax; print(jax.__version__, jax.devices())"
el "prefill_stall gptj-6b 256"
timeout 300 python3 benchmarks/prefill_stall.py --model gptj-6b --quantize int8 --kv-cache-dtype int8 --rows 15 --context 64 --prompt 1792 --budgets 256 --chunk 8 --repeats 2 --mixed off,on 2>&1 | grep -v -E "Warn|warn|hugepages" | tail -12 | tee $OUT/prefill_stall_6b_mixed.txt
el "tpu tier: mixed"
JAX_PLATFORMS=tpu,cpu timeout 200 python3 -m pytest tests/test_tpu.py -p no:xdist -o addopts="-ra --strict-markers" -m tpu -q -k "mixed or engine_on_the_chip or int8_pool" --durations=5 2>&1 | tail -30 | tee $OUT/tpu_mixed.txt
el done
