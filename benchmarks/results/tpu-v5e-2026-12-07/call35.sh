# int8 projections stored heads first: where a GPT-J-6B decode call's wall time goes now (call34 measured before)
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
export PYTHONPATH=$PYTHONPATH:.
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "decode phases gptj-6b"
timeout 200 python3 benchmarks/results/tpu-v5e-2026-12-07/decode_phases.py gptj-6b /tmp/dp 2>&1 | grep -v -E "Warn|warn|hugepages|libtpu" | tee $OUT/decode_phases_6b_heads_first.txt | tail -10
timeout 30 python3 benchmarks/profile_ops.py /tmp/dp --top 25 2>&1 | grep -v -E "Warn|warn|hugepages" | cut -c1-400 > $OUT/decode_phases_6b_heads_first_ops.txt; head -16 $OUT/decode_phases_6b_heads_first_ops.txt | cut -c1-160
el done
