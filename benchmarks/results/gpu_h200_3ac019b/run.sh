#!/usr/bin/env bash
# Second device call: the sampler's no-wait GPU test, then random-mm served by HEAD and by 73da39c, same machine.
set -uo pipefail
q=${QUICK:-}; g=${G:-/tmp/g2}; deadline=${DEADLINE:-330}; rm -rf $g; mkdir -p $g
if [[ -z $q ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit 1
else export TRITON_INTERPRET=1 PYTHONPATH=$PWD; fi
export PYTHONUNBUFFERED=1
lim() { local left=$((deadline - SECONDS)); echo $(($1 < left ? $1 : left)); }
mark() { echo "$1 rc=$2 at ${SECONDS}s" | tee -a $g/steps.txt; }
timeout $(lim 60) python3 -m pytest -v -p no:cacheprovider tests/test_sampler.py -k "without_waiting or penalt" > $g/pytest-sampler.log 2>&1
mark sampler $?; grep -E "PASS|FAIL|SKIP|Error" $g/pytest-sampler.log | head -12
model=/tmp/fovea-q7b
if [[ -n $q ]]; then model=/tmp/fovea-quick-tiny
else [[ -d $model ]] || timeout $(lim 120) python3 -m fovea.cli tiny $model --config qwen2.5-vl-7b --dtype bfloat16 --device cuda > $g/build.log 2>&1; fi
mark build $?
mm=(--steps rates,serve --workloads random-mm-720p-x500)
timeout $(lim 120) python3 benchmarks/gpu_fast_path.py --model $model --out $g/head --commit "${HEAD_COMMIT:-head}" "${mm[@]}" $q > $g/head.log 2>&1
mark head $?
timeout $(lim 120) bash -c "cd .base/73da39c && python3 '$PWD/benchmarks/gpu_fast_path.py' --model $model --out $g/base --commit 73da39c ${mm[*]} $q" > $g/base.log 2>&1
mark base $?
cat $g/head/summary.md $g/base/summary.md 2>/dev/null; tail -n 3 $g/head.log $g/base.log
tar czf ${OUT:-/tmp}/gpu2.tgz -C $g . && ls -la ${OUT:-/tmp}/gpu2.tgz
