#!/usr/bin/env bash
# The whole GPU verdict in three runs of under 10 minutes each (one device call each), raw JSON and logs under OUT,
# a summary table printed last. Run from the repository root on the GPU machine:
#   bash benchmarks/gpu_check.sh tests   OUT   # the test suite on the GPU
#   bash benchmarks/gpu_check.sh serve   OUT   # gpu_fast_path.py with default serve flags (seed-001, 1000/1000 x256,
#                                              # random-mm 720p x500 with GPU utilisation, HF generate side by side;
#                                              # seed-001 and 1000/1000 again with --no-async-scheduling,
#                                              # and served by an earlier tree where BASELINE names one),
#                                              # the decode-step profile at batch 16 / 8k and 256 / 1k, our video
#                                              # patches against transformers' video processor, the LLaVA-7B CLIP
#                                              # tower on CUDA
#   bash benchmarks/gpu_check.sh host    OUT   # the decode step with and without the fused element-wise kernels;
#                                              # a served decode step's host phases (host_overhead.py), beside an
#                                              # earlier tree's when BASELINE names one (git archive of a commit),
#                                              # else beside this tree stepping in order; and the steps
#                                              # overlapped without scheduling ahead (--order overlapped)
#   bash benchmarks/gpu_check.sh kernels OUT   # attention kernels side by side (ours, FlashInfer where it installs,
#                                              # PyTorch SDPA) against measured bandwidth and matmul rate; 7B-shape
#                                              # fp32/bf16 greedy parity against transformers (gpu_parity.py)
#   bash benchmarks/gpu_check.sh qwen3   OUT   # Qwen3-VL-8B shapes: fp32/bf16 greedy parity against transformers
#   bash benchmarks/gpu_check.sh mmprofile OUT # random-mm 720p x500 served under py-spy: each process's and thread's
#                                              # samples (the engine's from its serving loop on), GPU utilisation
# Add --quick to any of them for a dry run on the CPU with the tiny model. Packages the GPU machine lacks travel as
# wheels in .whl/ (benchmarks/README.md says which and how to fetch them); they are installed here first.
set -uo pipefail
stage=${1:?usage: gpu_check.sh tests|serve|host|kernels|qwen3|mmprofile OUT [--quick]}
out=${2:?usage: gpu_check.sh tests|serve|host|kernels|qwen3|mmprofile OUT [--quick]}
quick=${3:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
[[ $quick == --quick ]] && export TRITON_INTERPRET=1  # on the CPU the Triton kernels run under the interpreter
if compgen -G ".whl*/*.whl" >/dev/null && ! python3 -c "import fastapi" 2>/dev/null; then  # the GPU machine
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl*/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
py=python3
# the device machine's copy of the tree may not hold this commit: FOVEA_COMMIT names it
commit=${FOVEA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
{ echo "commit $commit"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null
  $py -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)'
  $py -c 'import triton; print("triton", triton.__version__)' 2>/dev/null
  $py -c 'import transformers; print("transformers", transformers.__version__)'
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

model=/tmp/fovea-q7b
build_7b() {  # random bf16 weights with Qwen2.5-VL-7B's shapes; the tiny demo shapes for --quick
  if [[ $quick == --quick ]]; then model=/tmp/fovea-quick-tiny; [[ -d $model ]] || $py -m fovea.cli tiny $model; return; fi
  [[ -d $model ]] || $py -m fovea.cli tiny $model --config qwen2.5-vl-7b --dtype bfloat16 --device cuda
}
step() {  # step NAME SECONDS COMMAND...: runs under a time limit, logs under OUT, records the exit status
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$out/steps.txt"
}

case "$stage" in
  tests)
    if [[ $quick == --quick ]]; then
      step pytest 300 $py -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_cuda_graphs.py
    else  # Ray is not on the GPU machine (and too large to carry): its three tests are deselected there
      step pytest 480 $py -m pytest -v --tb=short -p no:cacheprovider --timeout 150 --durations=25 tests \
        --deselect tests/test_eval_backends.py::test_in_process_server_and_ray_give_identical_predictions \
        --deselect tests/test_eval_backends.py::test_tensor_parallel_registry_entry_in_process_and_on_ray \
        --deselect tests/test_parallel_serving.py::test_ray_replicas_are_actors_that_answer_like_one_engine_and_a_killed_one_comes_back
    fi
    grep -E "PASSED|FAILED|ERROR" "$out/pytest.log" | grep -vc PASSED | sed 's/^/tests not passed: /'
    grep -E "FAILED|ERROR" "$out/pytest.log" | grep "::" | head -40; tail -n 30 "$out/pytest.log" ;;
  serve)
    build_7b
    # FAST_PATH_STEPS=rates,serve leaves transformers' generate out where device time is short
    step fast_path 400 $py benchmarks/gpu_fast_path.py --model $model --out "$out" --commit "$commit" \
      --steps "${FAST_PATH_STEPS:-rates,serve,hf}" $quick
    rates=$($py -c "import json; r = json.load(open('$out/summary.json'))['rates']; \
print(f\"{r['matmul_tflops']},{r['copy_tb_s']}\")" 2>/dev/null || echo 798,3.0)
    text=(--steps serve --workloads seed-001,random-1000-1000-x256 --rates "$rates")
    # the text workloads again with --no-async-scheduling: each step scheduled once the previous one's tokens are
    # back (its outputs still built while the next runs), the default before scheduling ahead
    step fast_path_overlapped 200 $py benchmarks/gpu_fast_path.py --model $model --out "$out/overlapped" \
      --commit "$commit" "${text[@]}" --server-args=--no-async-scheduling $quick
    if [[ -n ${BASELINE:-} ]]; then  # and served by an earlier tree (git archive COMMIT fovea | tar -x -C BASELINE):
      # the server and the bench client start from BASELINE (python -m puts the working directory first)
      step fast_path_baseline 200 bash -c "cd '$BASELINE' && $py '$PWD/benchmarks/gpu_fast_path.py' --model $model \
        --out '$out/baseline' --commit '${BASELINE_COMMIT:-baseline}' ${text[*]} $quick"
    fi
    step decode_step 60 $py benchmarks/decode_step.py --model $model --out "$out" --rates "$rates" $quick
    step media 40 $py benchmarks/gpu_media_checks.py --out "$out" $quick
    cat "$out/media_checks.json"; tail -n 30 "$out/decode_step.log"
    cat "$out/summary.md" "$out/overlapped/summary.md" "$out/baseline/summary.md" 2>/dev/null ;;
  host)  # the step limits and the 7B build fit one 600 s device call
    # HOST_ARGS: host_overhead.py's own flags (--cases, --sampling), for the runs beside BASELINE and this tree's
    host_args=${HOST_ARGS:-}
    build_7b
    step decode_variants 100 $py benchmarks/decode_step.py --model $model --out "$out" --variants fused,unfused $quick
    if [[ -n ${BASELINE:-} ]]; then
      step host_baseline 150 env PYTHONPATH="$BASELINE:$PYTHONPATH" $py benchmarks/host_overhead.py --model $model \
        --out "$out/host-baseline.json" --label baseline $host_args $quick
    else  # the same tree stepping in order: what overlapping the outputs with the next step gains
      step host_in_order 150 $py benchmarks/host_overhead.py --model $model --out "$out/host-in-order.json" \
        --label "$commit in order" --order in-order $quick
    fi
    step host_overlapped 150 $py benchmarks/host_overhead.py --model $model --out "$out/host-overlapped.json" \
      --label "$commit overlapped" --order overlapped $quick
    step host 150 $py benchmarks/host_overhead.py --model $model --out "$out/host.json" --label "$commit" \
      $host_args $quick
    grep -h "decode step, batch" "$out/decode_variants.log"; grep -h "synchronized by phase" "$out"/host*.log ;;
  kernels)  # PARITY_DONE: a folder of parity runs taken earlier, copied in so that they are not repeated
    step kernels 250 $py -m fovea.cli bench kernels --out "$out/kernels.json" $quick
    build_7b
    [[ -n ${PARITY_DONE:-} ]] && cp "$PARITY_DONE"/parity-*.json "$out"/
    step parity 200 $py benchmarks/gpu_parity.py --model $model --out "$out" --prompts 17,250,1000,2500,80 $quick
    tail -n 9 "$out/parity.log"; grep "^|" "$out/kernels.log" ;;
  qwen3)  # random weights with Qwen3-VL-8B's shapes, drawn on the GPU (bf16 on disk); the tiny shapes for --quick
    q3=/tmp/fovea-q3-8b; config=(--config qwen3-vl-8b --dtype bfloat16 --device cuda)
    [[ $quick == --quick ]] && { q3=/tmp/fovea-quick-q3; config=(--config tiny-qwen3-vl); }
    [[ -d $q3 ]] || step build_qwen3 300 $py -m fovea.cli tiny $q3 "${config[@]}"
    mkdir -p "$out/qwen3"
    step parity_qwen3 280 $py benchmarks/gpu_parity.py --model $q3 --out "$out/qwen3" --prompts 17,250,1000,2500 $quick
    tail -n 9 "$out/parity_qwen3.log" ;;
  mmprofile)  # py-spy comes as a wheel too; its binary lands in /tmp/site/bin
    build_7b
    export PATH=/tmp/site/bin:$PATH
    step mm_profile 420 $py benchmarks/gpu_fast_path.py --model $model --out "$out" --commit "$commit" --steps serve \
      --workloads random-mm-720p-x500 --profile-server $quick
    $py benchmarks/pyspy_summary.py "$out/server-pyspy.txt" --within _serve --top 30 > "$out/server-pyspy.md"
    head -n 120 "$out/server-pyspy.md"; cat "$out/summary.md" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
cat "$out/steps.txt"
