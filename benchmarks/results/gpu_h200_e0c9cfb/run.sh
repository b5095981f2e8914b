#!/usr/bin/env bash
# One device call (session 10): Gemma 3 / InternVL on the compiled Triton kernels and CUDA graphs (tests), random-mm
# served by HEAD and by 73da39c on the same machine, then the top_p-only sampler's wait (host_overhead.py).
set -uo pipefail
q=${QUICK:-}; g=${G:-/tmp/g}; deadline=${DEADLINE:-560}; rm -rf $g; mkdir -p $g
if [[ -z $q ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
else export TRITON_INTERPRET=1 PYTHONPATH=$PWD; fi
export PYTHONUNBUFFERED=1
lim() { local left=$((deadline - SECONDS)); echo $(($1 < left ? $1 : left)); }
mark() { echo "$1 rc=$2 at ${SECONDS}s" | tee -a $g/steps.txt; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
} > $g/env.txt 2>&1; cat $g/env.txt
model=/tmp/fovea-q7b
quick=(); [[ -n $q ]] && quick=(--quick)
tests=(tests/test_kernels.py tests/test_cuda_graphs.py tests/test_gemma3.py tests/test_internvl.py)
[[ -n $q ]] && tests=(tests/test_kernels.py -k windows)
timeout $(lim 170) python3 -m pytest -v -n ${NPROC:-4} --dist loadfile -p no:cacheprovider --timeout 160 --durations=10 \
  "${tests[@]}" > $g/pytest.log 2>&1 &
tpid=$!
if [[ -n $q ]]; then model=/tmp/fovea-quick-tiny; [[ -d $model ]] || python3 -m fovea.cli tiny $model > $g/build.log 2>&1
else [[ -d $model ]] || timeout $(lim 120) python3 -m fovea.cli tiny $model --config qwen2.5-vl-7b --dtype bfloat16 --device cuda > $g/build.log 2>&1; fi
mark build $?
wait $tpid; mark tests $?
grep -E "passed|failed" $g/pytest.log | tail -n 2; grep -E "FAILED|ERROR" $g/pytest.log | head -20
mm=(--steps rates,serve --workloads random-mm-720p-x500)
timeout $(lim 170) python3 benchmarks/gpu_fast_path.py --model $model --out $g/head --commit "${HEAD_COMMIT:-head}" "${mm[@]}" "${quick[@]}" > $g/head.log 2>&1
mark head $?
rates=$(python3 -c "import json; r = json.load(open('$g/head/summary.json'))['rates']; print(f\"{r['matmul_tflops']},{r['copy_tb_s']}\")" 2>/dev/null || echo 786,4.26)
timeout $(lim 170) bash -c "cd .base/73da39c && python3 '$PWD/benchmarks/gpu_fast_path.py' --model $model --out $g/base --commit 73da39c --steps serve --workloads random-mm-720p-x500 --rates $rates ${quick[*]}" > $g/base.log 2>&1
mark base $?
timeout $(lim 120) python3 benchmarks/host_overhead.py --model $model --out $g/host-top-p.json --cases 256x1000 --steps 30 \
  --sampling top_p,top_k_top_p,greedy --label "${HEAD_COMMIT:-head}" "${quick[@]}" > $g/host.log 2>&1
mark host $?
cat $g/head/summary.md $g/base/summary.md 2>/dev/null; grep "synchronized by phase" $g/host.log
tar czf ${OUT:-/tmp}/gpu.tgz -C $g . && ls -la ${OUT:-/tmp}/gpu.tgz
