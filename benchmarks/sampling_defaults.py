"""What a request that leaves out its sampling fields costs per generated token, against greedy, same engine,
same run (alternated): the checkpoint's generation_config defaults (Qwen2.5-VL: temperature 0.1, top_p 0.001,
top_k 1, repetition_penalty 1.05) are what vLLM's bench client, guidellm and most curl lines get.

Offline engine on a tiny random Qwen2.5-VL with the real 151,936-token vocabulary (built in a temporary directory
unless MODEL_DIR is given), one torch thread, batch 1 and 256, prompts of 64 tokens, 32 tokens each (ignore_eos).

    python benchmarks/sampling_defaults.py [MODEL_DIR] [--batches 1 256] [--repeats 3] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from fovea import LLM, SamplingParams
from fovea.testing.tiny import write_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def ms_per_step(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    """Milliseconds per engine step (a prefill, then one decode step per token: every prompt runs to max_tokens)."""
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return (time.perf_counter() - start) / params.max_tokens * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = args.model or str(write_tiny_checkpoint(tempfile.mkdtemp(), "tiny-3b", seed=0))
    llm = LLM(model, max_model_len=128, max_num_seqs=max(args.batches), max_num_batched_tokens=8192)
    defaults = llm.get_default_sampling_params().clone(max_tokens=args.max_tokens, ignore_eos=True)
    cases = {
        "greedy": SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True),
        "generation_config defaults": defaults,
    }
    results = []
    for batch in args.batches:
        prompts = [[(31 * i + 7 * j) % 150000 + 100 for j in range(64)] for i in range(batch)]
        for params in cases.values():
            llm.generate([{"prompt_token_ids": prompts[0]}], params.clone(max_tokens=2), use_tqdm=False)  # warm-up
        times = {name: [] for name in cases}
        for _ in range(args.repeats):
            for name, params in cases.items():
                times[name].append(ms_per_step(llm, prompts, params))
        greedy = statistics.median(times["greedy"])
        for name, runs in times.items():
            results.append(
                {
                    "batch": batch,
                    "case": name,
                    "ms_per_step": statistics.median(runs),
                    "runs_ms": runs,
                    "vs_greedy": statistics.median(runs) / greedy,
                }
            )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    record = {
        "benchmark": "sampling_defaults",
        "commit": commit,
        "torch_threads": 1,
        "max_tokens": args.max_tokens,
        "cpu": platform.processor() or platform.machine(),
        "sampling_defaults": {k: getattr(defaults, k) for k in ("temperature", "top_p", "top_k", "repetition_penalty")},
        "results": results,
    }
    out = Path(args.out) / f"sampling_defaults_{commit}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print("| batch | case | ms per step | x greedy |\n| --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['batch']} | {r['case']} | {r['ms_per_step']:.2f} | {r['vs_greedy']:.2f}x |")
    print(f"raw: {out}")


if __name__ == "__main__":
    main()
