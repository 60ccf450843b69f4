# why the served part failed (meshlm serve alone, its log kept), then heads of 64 through the TPU paged kernel
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
ls /tmp/g6 | head -3
el "meshlm serve alone, int8 pool, max-len 2048"
python3 -m meshlm serve /tmp/g6 --uds /tmp/m.sock --max-batch 16 --max-len 2048 --chunk 8 --max-queue 136 --dtype bfloat16 --quantize int8 --kv-cache-dtype int8 > $OUT/serve_log.txt 2>&1 &
pid=$!
for i in $(seq 1 190); do
  sleep 1
  if ! kill -0 $pid 2>/dev/null; then el "server exited"; break; fi
  if curl -s --unix-socket /tmp/m.sock http://meshlm/health >/dev/null 2>&1; then el "server healthy"; break; fi
done
kill $pid 2>/dev/null; sleep 2; kill -9 $pid 2>/dev/null
grep -v -E "Warn|warn|hugepages" $OUT/serve_log.txt | tail -25
el "kernel level: 16 heads of 64"
timeout 100 python3 .tpu/head64.py --heads 16 --head-dim 64 --layers 8 --rows 16,64 --pools bfloat16,int8,float32 --repeats 5 2>&1 | grep -v -E "Warn|warn|hugepages" | tail -12 | tee $OUT/head64_kernel.txt
for pool in auto int8; do
  for side in forced xla; do
    el "pythia-410m bf16, pool $pool, $side"
    if [ $side = forced ]; then env="FORCE_PAGED=1"; att=auto; else env="FORCE_PAGED=0"; att=xla; fi
    timeout 45 env $env python3 .tpu/forced.py --preset pythia-410m --kv-cache-dtype $pool --attention $att --rows 1,16,32 --context 2048 --steps 8 --repeats 3 --copy-mb 256 2>&1 | grep -v -E "Warn|warn|hugepages" | tail -6 | tee $OUT/decode_410m_${pool}_${side}.txt
  done
done
el "kernel level: 16 heads of 128 (control)"
timeout 40 python3 .tpu/head64.py --heads 16 --head-dim 128 --layers 8 --rows 16 --pools bfloat16,int8 --repeats 5 2>&1 | grep -v -E "Warn|warn|hugepages" | tail -4 | tee $OUT/head128_kernel.txt
el done
