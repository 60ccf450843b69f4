# the spans' parts apart (an optimization barrier after the packed row's split): a GPT-J-6B mixed step's calls timed
# on the previous tree (906ef68) and this one, both profiled; the tpu tier's engine tests on this tree
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --find-links .whl-tpu --target /tmp/site httpx fastapi uvicorn 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PYTHONPATH:.:/tmp/site
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
uptime
el "mixed_profile, 906ef68"
PYTHONPATH=.tpu/old:$PYTHONPATH timeout 170 python3 .tpu/mixed_profile.py gptj-6b /tmp/mp_old 2>&1 | grep -v -E "Warn|warn|hugepages|libtpu" | tee $OUT/mixed_profile_6b_old.txt | tail -3
el "mixed_profile, this tree"
timeout 170 python3 .tpu/mixed_profile.py gptj-6b /tmp/mp 2>&1 | grep -v -E "Warn|warn|hugepages|libtpu" | tee $OUT/mixed_profile_6b_new.txt | tail -3
timeout 25 python3 benchmarks/profile_ops.py /tmp/mp --top 30 2>&1 | grep -v -E "Warn|warn|hugepages" | cut -c1-400 > $OUT/mixed_profile_6b_new_ops.txt; head -24 $OUT/mixed_profile_6b_new_ops.txt | cut -c1-180
timeout 25 python3 benchmarks/profile_ops.py /tmp/mp_old --top 30 2>&1 | grep -v -E "Warn|warn|hugepages" | cut -c1-400 > $OUT/mixed_profile_6b_old_ops.txt; head -24 $OUT/mixed_profile_6b_old_ops.txt | cut -c1-180
el "int8 matmul: dequantized vs int8 x int8"
timeout 120 python3 benchmarks/int8_matmul.py 2>&1 | grep -v -E "Warn|warn|hugepages|libtpu" | tee $OUT/int8_matmul.txt
el "tpu tier: engine tests"
JAX_PLATFORMS=tpu,cpu timeout 200 python3 -m pytest tests/test_tpu.py -p no:xdist -o addopts="-ra --strict-markers" -m tpu -k "mixed or int8 or greedy" 2>&1 | tail -5 | tee $OUT/tpu_tier.txt
el done
