# where a GPT-J-6B int8 chunk step's extra 7 ms goes: profiles of a 16-token chunk's step and of a decode step
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
uptime
for n in 16 1; do
  el "decode_rows gptj-6b --new $n --profile"
  PYTHONPATH=$PYTHONPATH:. timeout 220 python3 benchmarks/decode_rows.py --preset gptj-6b --quantize int8 --kv-cache-dtype int8 --rows 1 --new $n --context 128 --steps 8 --repeats 3 --copy-mb 256 --profile /tmp/p$n 2>&1 | grep -v -E "Warn|warn|hugepages" | tail -3 | tee $OUT/decode_rows_6b_new${n}_profiled.txt
  PYTHONPATH=$PYTHONPATH:. timeout 60 python3 benchmarks/profile_ops.py /tmp/p$n --top 30 2>&1 | grep -v -E "Warn|warn|hugepages" | tee $OUT/profile_6b_new$n.txt | head -45
done
el done
