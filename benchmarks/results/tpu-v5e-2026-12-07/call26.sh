# how many tokens a GPT-J-6B int8 step (int8 pool) takes before it costs more than one: the prompt tokens a
# decode step could carry beside its rows (issue 38's single ragged step, weighed)
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
uptime; python3 -c "import jax; print(jax.__version__, jax.devices())"
el "decode_rows gptj-6b --new"
PYTHONPATH=$PYTHONPATH:. timeout 420 python3 benchmarks/decode_rows.py --preset gptj-6b --quantize int8 --kv-cache-dtype int8 --rows 1 --new 1,16,32,64,128,256 --context 128 --steps 8 --repeats 3 --copy-mb 1024 2>&1 | grep -v -E "Warn|warn|hugepages" | tail -14 | tee $OUT/decode_rows_6b_new.txt
el "decode_rows gptj-1b --new"
PYTHONPATH=$PYTHONPATH:. timeout 120 python3 benchmarks/decode_rows.py --preset gptj-1b --rows 1 --new 1,16,64,256 --context 128 --steps 8 --repeats 3 --copy-mb 1024 2>&1 | grep -v -E "Warn|warn|hugepages" | tail -10 | tee $OUT/decode_rows_1b_new.txt
el done
