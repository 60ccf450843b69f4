# where a GPT-J-6B mixed step's time goes: each call kind timed over a prompt's 256-token chunks, one mixed call profiled
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1
export PYTHONPATH=$PYTHONPATH:.
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
timeout 170 python3 .tpu/mixed_profile.py gptj-6b /tmp/mp 2>&1 | grep -v -E "Warn|warn|hugepages|libtpu" | tee $OUT/mixed_profile_6b.txt | tail -5
el profiled
timeout 25 python3 benchmarks/profile_ops.py /tmp/mp --top 30 2>&1 | grep -v -E "Warn|warn|hugepages" | tee $OUT/mixed_profile_6b_ops.txt | head -40
el done
