"""What the tensor-parallel code path costs per step with one rank: the plain engine against the same engine
on a torch.distributed group of one (`distributed_executor_backend="mp"`, tensor_parallel_size 1: the step plan
is broadcast over the control group, every row-parallel layer and the vocab-parallel embedding and LM head call
their collectives), same prompts, same run, alternated. NCCL on a GPU, gloo on the CPU.

Run:  python benchmarks/tp_overhead.py MODEL_DIR [--prompts 64] [--max-tokens 64] [--repeats 3]
      (MODEL_DIR from `fovea tiny DIR --config tiny-3b`, or `--config qwen2.5-vl-7b --dtype bfloat16` on a GPU)
Writes the raw figures as JSON to benchmarks/results/ (or --out).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from fovea import LLM, SamplingParams


def measure(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params.clone(max_tokens=2), use_tqdm=False)  # warm up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    prompts = [[(7 * i + 13 * j) % 30000 + 100 for j in range(args.prompt_len)] for i in range(args.prompts)]
    engines = {"plain": {}, "group of one": {"distributed_executor_backend": "mp"}}
    llms = {
        name: LLM(args.model, max_model_len=args.prompt_len + args.max_tokens + 8, **options)
        for name, options in engines.items()
    }
    times = {name: [] for name in engines}
    tokens = {}
    for _ in range(args.repeats):
        for name, llm in llms.items():
            elapsed, tokens[name] = measure(llm, prompts, args.max_tokens)
            times[name].append(elapsed)
    # one prefill step per prompt chunk, then max_tokens - 1 decode steps of the whole batch
    steps = args.max_tokens
    rows = {
        name: {"median_s": statistics.median(t), "per_step_ms": statistics.median(t) / steps * 1e3, "runs_s": t}
        for name, t in times.items()
    }
    overhead = rows["group of one"]["per_step_ms"] - rows["plain"]["per_step_ms"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    result = {
        "commit": commit,
        "device": device,
        "torch": torch.__version__,
        "args": vars(args),
        "rows": rows,
        "overhead_per_step_ms": overhead,
        "identical_tokens": tokens["plain"] == tokens["group of one"],
    }
    kind = "gpu" if torch.cuda.is_available() else "cpu"
    out = Path(args.out or Path(__file__).parent / "results" / f"tp_overhead_{kind}_{commit}.json")
    out.write_text(json.dumps(result, indent=2))
    print("| engine | median s | ms per step |\n|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['median_s']:.3f} | {row['per_step_ms']:.2f} |")
    print(f"overhead {overhead:+.2f} ms per step; identical tokens: {result['identical_tokens']}; wrote {out}")
    for llm in llms.values():
        llm.engine.close()


if __name__ == "__main__":
    main()
