# w8a8 on the chip: the tpu tier's w8a8 test; a GPT-J-6B mixed step's calls with int8 and with w8a8 projections
# (both int8 pools), both profiled
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --find-links .whl-tpu --target /tmp/site httpx fastapi uvicorn 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PYTHONPATH:.:/tmp/site
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
uptime
el "tpu tier: w8a8"
JAX_PLATFORMS=tpu,cpu timeout 150 python3 -m pytest tests/test_tpu.py -p no:xdist -o addopts="-ra --strict-markers" -m tpu -k "w8a8" 2>&1 | tail -5 | tee $OUT/tpu_tier_w8a8.txt
for q in w8a8 int8; do
el "mixed_profile, $q"
timeout 170 python3 .tpu/mixed_profile.py gptj-6b /tmp/mp_$q $q 2>&1 | grep -v -E "Warn|warn|hugepages|libtpu" | tee $OUT/mixed_profile_6b_$q.txt | tail -3
timeout 25 python3 benchmarks/profile_ops.py /tmp/mp_$q --top 40 2>&1 | grep -v -E "Warn|warn|hugepages" | cut -c1-400 > $OUT/mixed_profile_6b_${q}_ops.txt; head -30 $OUT/mixed_profile_6b_${q}_ops.txt | cut -c1-180
done
el done
