#!/usr/bin/env bash
# One device call: test_overlap, mmprofile, serve (text + mm, defaults), seed-001 again; all under a deadline.
set -uo pipefail
q=${QUICK:-}; g=${G:-/tmp/g}; deadline=${DEADLINE:-560}; rm -rf $g; mkdir -p $g
if [[ -z $q ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit 1
else export PATH=/tmp/spy/bin:$PATH TRITON_INTERPRET=1; fi
export FOVEA_COMMIT=${FOVEA_COMMIT:-73da39c} PYTHONUNBUFFERED=1
lim() { local left=$((deadline - SECONDS)); echo $(($1 < left ? $1 : left)); }
mark() { echo "$1 rc=$2 at ${SECONDS}s" | tee -a $g/steps.txt; }
model=/tmp/fovea-q7b; [[ -n $q ]] && model=/tmp/fovea-quick-tiny
timeout $(lim 100) python3 -m pytest -q -p no:cacheprovider --durations=5 tests/test_overlap.py > $g/pytest-overlap.log 2>&1
mark overlap $?; tail -n 4 $g/pytest-overlap.log
timeout $(lim 300) bash benchmarks/gpu_check.sh mmprofile $g/mm $q > $g/mmprofile.out 2>&1
mark mmprofile $?
timeout $(lim 240) python3 benchmarks/gpu_fast_path.py --model $model --out $g/serve --steps rates,serve \
  --workloads seed-001,random-1000-1000-x256,random-mm-720p-x500 $q > $g/serve.log 2>&1
mark serve $?
rates=$(python3 -c "import json; r = json.load(open('$g/serve/summary.json'))['rates']; print(f\"{r['matmul_tflops']},{r['copy_tb_s']}\")" 2>/dev/null || echo 786,4.26)
timeout $(lim 90) python3 benchmarks/gpu_fast_path.py --model $model --out $g/seed2 --steps serve --workloads seed-001 \
  --rates $rates $q > $g/seed2.log 2>&1
mark seed2 $?
cat $g/mm/env.txt 2>/dev/null; head -n 60 $g/mm/server-pyspy.md 2>/dev/null
cat $g/mm/summary.md $g/serve/summary.md $g/seed2/summary.md 2>/dev/null
tar czf ${OUT:-/tmp}/gpu.tgz -C $g . && ls -la ${OUT:-/tmp}/gpu.tgz
