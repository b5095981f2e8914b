#!/usr/bin/env bash
# The seed workloads, as ready `fovea bench serve` commands against a running server (fovea, vLLM, any
# OpenAI-compatible one). Usage:  bash benchmarks/seeds.sh NAME [more bench flags, e.g. --base-url URL --tokenizer DIR]
#   seed-001       random 8000 in / 1000 out, 16 prompts, EOS ignored (the seed headline)
#   seed-001-r     the reverse: 1000 in / 8000 out
#   seed-001-s     1000 in / 1000 out
#   seed-mm-720p   random-mm: 64 chats of 128 text tokens + one 1280x720 noise JPEG, 128 out
# Prefix caching should be off on the server for seed-001 (`fovea serve MODEL --no-enable-prefix-caching`), as
# in the seed's setup. Results go to benchmarks/results/ as JSON with vLLM's field names.
set -euo pipefail
name=${1:?usage: bash benchmarks/seeds.sh NAME [bench flags]}
shift
common=(--ignore-eos --save-result --result-dir benchmarks/results --label "$name")
case "$name" in
  seed-001)     fovea bench serve --dataset-name random --random-input-len 8000 --random-output-len 1000 \
                  --num-prompts 16 "${common[@]}" "$@" ;;
  seed-001-r)   fovea bench serve --dataset-name random --random-input-len 1000 --random-output-len 8000 \
                  --num-prompts 16 "${common[@]}" "$@" ;;
  seed-001-s)   fovea bench serve --dataset-name random --random-input-len 1000 --random-output-len 1000 \
                  --num-prompts 16 "${common[@]}" "$@" ;;
  seed-mm-720p) fovea bench serve --dataset-name random-mm --endpoint /v1/chat/completions \
                  --random-input-len 128 --random-output-len 128 --num-prompts 64 \
                  --random-mm-base-items-per-request 1 --random-mm-bucket-config '{(720, 1280, 1): 1.0}' \
                  --random-mm-limit-mm-per-prompt '{"image": 1}' "${common[@]}" "$@" ;;
  *) echo "unknown workload $name" >&2; exit 2 ;;
esac
