# the tpu tier whole (the w8a8 test's final form for the first time); then a serving step's attention, meshlm's
# kernels against JAX's ragged paged attention kernel (benchmarks/ragged_kernel.py)
set -o pipefail
source .whl-tpu/env.sh file:///opt/pypi/simple >/tmp/env.log 2>&1; tail -1 /tmp/env.log
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --find-links .whl-tpu --target /tmp/site httpx fastapi uvicorn 2>&1 | grep -v "already exists" | tail -1
export PYTHONPATH=$PYTHONPATH:.:/tmp/site
export JAX_COMPILATION_CACHE_DIR=/tmp/xla-cache
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
uptime; git log --oneline -1 2>/dev/null
el "ragged_kernel: 15 rows at 2048 (+ a chunk of 256 after 768)"
timeout 150 python3 benchmarks/ragged_kernel.py 2>&1 | grep -v -E "Warn|warn|hugepages|libtpu|E0000|InitGoogle" | tee $OUT/ragged_kernel_2048.txt | tail -30
el "ragged_kernel: 15 rows at 512"
timeout 100 python3 benchmarks/ragged_kernel.py --context 512 --layers 8 2>&1 | grep -v -E "Warn|warn|hugepages|libtpu|E0000|InitGoogle" | tee $OUT/ragged_kernel_512.txt | tail -24
el "tpu tier"
JAX_PLATFORMS=tpu,cpu timeout 330 python3 -m pytest tests/test_tpu.py -p no:xdist -o addopts="-ra --strict-markers" -m tpu --durations=10 2>&1 | tail -40 | cut -c1-400 | tee $OUT/tpu_tier.txt
el done
