# the stall of 15 decoding rows while a 1,792-token prompt arrives in chunks of 256, on this tree (heads-first codes,
# a prompt's pages moved heads major); call34 measured it before both
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
export PYTHONPATH=$PYTHONPATH:.
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "prefill_stall"; git log --oneline -1 2>/dev/null
timeout 400 python3 benchmarks/prefill_stall.py --model gptj-6b --quantize int8 --kv-cache-dtype int8 --rows 15 --context 64 --prompt 1792 --budgets 256 --chunk 8 --repeats 2 --mixed off,on 2>&1 | grep -v -E "Warn|warn|hugepages" | tail -12 | tee $OUT/prefill_stall_6b_mixed_256.txt
el done
