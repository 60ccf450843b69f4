# where a GPT-J-6B decode call's wall time goes (put, dispatch, device, take; chunks 1, 2, 4; 16 rows and 1), one
# 16-row call profiled; then the stall of a long prompt arriving, mixed steps off and on, on this tree
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --find-links .whl-tpu --target /tmp/site httpx fastapi uvicorn 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PYTHONPATH:.:/tmp/site
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "decode phases gptj-6b"
timeout 230 python3 benchmarks/results/tpu-v5e-2026-12-07/decode_phases.py gptj-6b /tmp/dp 2>&1 | grep -v -E "Warn|warn|hugepages|libtpu" | tee $OUT/decode_phases_6b.txt | tail -10
timeout 30 python3 benchmarks/profile_ops.py /tmp/dp --top 25 2>&1 | grep -v -E "Warn|warn|hugepages" | cut -c1-400 > $OUT/decode_phases_6b_ops.txt; head -12 $OUT/decode_phases_6b_ops.txt | cut -c1-160
timeout 40 python3 - <<'PY' 2>&1 | tee $OUT/decode_phases_6b_host.txt | head -30
import collections, glob
from jax.profiler import ProfileData
f = sorted(glob.glob("/tmp/dp/**/*.xplane.pb", recursive=True))[-1]
d = ProfileData.from_file(f)
for p in d.planes:
    if p.name.startswith("/host"):
        tot = collections.Counter(); n = collections.Counter()
        for line in p.lines:
            for e in line.events:
                tot[(line.name, e.name)] += e.duration_ns; n[(line.name, e.name)] += 1
        print(p.name)
        for (ln, en), t in tot.most_common(25):
            print(f"{t/1e6:9.3f} ms {n[(ln, en)]:5d}  {ln[:30]:30s} {en[:110]}")
PY
el "prefill_stall"
timeout 280 python3 benchmarks/prefill_stall.py --model gptj-6b --quantize int8 --kv-cache-dtype int8 --rows 15 --context 64 --prompt 1792 --budgets 256 --chunk 8 --repeats 2 --mixed off,on 2>&1 | grep -v -E "Warn|warn|hugepages" | tail -12 | tee $OUT/prefill_stall_6b_mixed_256.txt
el done
