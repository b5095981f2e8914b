#!/usr/bin/env bash
# Second device call (session 10): the six tests fixed after the first call, the encoder workers and the sampler's
# no-wait test on the GPU, then random-mm served under py-spy at HEAD (gpu_check.sh mmprofile).
set -uo pipefail
g=${G:-/tmp/g}; deadline=${DEADLINE:-300}; rm -rf $g; mkdir -p $g
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit 1
export PYTHONUNBUFFERED=1
lim() { local left=$((deadline - SECONDS)); echo $(($1 < left ? $1 : left)); }
mark() { echo "$1 rc=$2 at ${SECONDS}s" | tee -a $g/steps.txt; }
timeout $(lim 110) python3 -m pytest -v -n 3 --dist loadfile -p no:cacheprovider --timeout 100 --durations=8 \
  tests/test_gemma3.py::test_auto_attention_is_the_kernels_that_have_its_features \
  tests/test_gemma3.py::test_tensor_parallel_gives_the_same_tokens \
  tests/test_gemma3.py::test_pan_and_scan_prompt_and_pixels_are_the_processors \
  tests/test_internvl.py::test_tensor_parallel_gives_the_same_tokens \
  tests/test_encoder_workers.py tests/test_sampler.py > $g/pytest.log 2>&1 &
tpid=$!
[[ -d /tmp/fovea-q7b ]] || timeout $(lim 100) python3 -m fovea.cli tiny /tmp/fovea-q7b --config qwen2.5-vl-7b --dtype bfloat16 --device cuda > $g/build.log 2>&1
mark build $?
wait $tpid; mark tests $?
grep -E "passed|failed" $g/pytest.log | tail -n 2; grep -E "FAILED|ERROR" $g/pytest.log | head -20
FOVEA_COMMIT=${HEAD_COMMIT:-head} timeout $(lim 220) bash benchmarks/gpu_check.sh mmprofile $g/mm > $g/mmprofile.out 2>&1
mark mmprofile $?
head -n 50 $g/mm/server-pyspy.md 2>/dev/null; cat $g/mm/summary.md 2>/dev/null
tar czf ${OUT:-/tmp}/gpu2.tgz -C $g . && ls -la ${OUT:-/tmp}/gpu2.tgz
