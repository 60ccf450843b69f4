# the chunk's pages read and written heads major (no relayout of the pages or of the new keys): a GPT-J-6B mixed
# step's calls timed on the previous tree (54f7e13) and this one, this one profiled; the tpu tier's engine tests
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
export PYTHONPATH=$PYTHONPATH:.
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
lscpu | grep -E "Model name|^CPU\(s\)"; uptime
el "mixed_profile, 54f7e13"
PYTHONPATH=.tpu/old:$PYTHONPATH timeout 170 python3 .tpu/mixed_profile.py gptj-6b /tmp/mp_old 2>&1 | grep -v -E "Warn|warn|hugepages|libtpu" | tee $OUT/mixed_profile_6b_old.txt | tail -3
el "mixed_profile, this tree"
timeout 170 python3 .tpu/mixed_profile.py gptj-6b /tmp/mp 2>&1 | grep -v -E "Warn|warn|hugepages|libtpu" | tee $OUT/mixed_profile_6b_new.txt | tail -3
timeout 25 python3 benchmarks/profile_ops.py /tmp/mp --top 30 2>&1 | grep -v -E "Warn|warn|hugepages" | cut -c1-400 > $OUT/mixed_profile_6b_new_ops.txt; head -30 $OUT/mixed_profile_6b_new_ops.txt | cut -c1-180
timeout 25 python3 benchmarks/profile_ops.py /tmp/mp_old --top 30 2>&1 | grep -v -E "Warn|warn|hugepages" | cut -c1-400 > $OUT/mixed_profile_6b_old_ops.txt
el "tpu tier: engine tests"
JAX_PLATFORMS=tpu,cpu timeout 230 python3 -m pytest tests/test_tpu.py -p no:xdist -o addopts="-ra --strict-markers" -m tpu -k "mixed or int8 or greedy or paged_kernel" 2>&1 | tail -5 | tee $OUT/tpu_tier.txt
el done
