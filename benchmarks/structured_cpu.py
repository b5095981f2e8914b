"""Output throughput with a JSON schema against none, same engine, same run (alternated): what structured outputs
cost per generated token. Offline engine on a tiny random Qwen2.5-VL with the real 151,936-token vocabulary (built in
a temporary directory unless MODEL_DIR is given), one torch thread, 64 prompts at once, temperature 1.

    python benchmarks/structured_cpu.py [MODEL_DIR] [--prompts 64] [--repeats 3] [--out benchmarks/results]
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

from fovea import LLM, SamplingParams, StructuredOutputsParams
from fovea.testing.tiny import write_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["label", "box", "note"],
    "properties": {
        "label": {"enum": ["cat", "dog", "boat"]},
        "box": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 1000},
            "minItems": 4,
            "maxItems": 4,
        },
        "note": {"type": "string", "maxLength": 40},
    },
}


def output_tokens_per_s(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / elapsed, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = args.model or str(write_tiny_checkpoint(tempfile.mkdtemp(), "tiny-3b", seed=0))
    llm = LLM(model, max_model_len=256, max_num_seqs=args.prompts, max_num_batched_tokens=8192)
    prompts = [[(37 * i + 11 * j) % 150000 + 100 for j in range(48)] for i in range(args.prompts)]
    base = SamplingParams(temperature=1.0, seed=0, max_tokens=args.max_tokens)
    cases = {"free": base, "json_schema": base.clone(structured_outputs=StructuredOutputsParams(json=SCHEMA))}
    for params in cases.values():
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up (grammar compiled)
    runs = {name: [] for name in cases}
    tokens = {}
    for _ in range(args.repeats):
        for name, params in cases.items():
            rate, tokens[name] = output_tokens_per_s(llm, prompts, params)
            runs[name].append(rate)
    rows = {
        name: {"output_tokens_per_s": statistics.median(r), "runs": r, "output_tokens": tokens[name]}
        for name, r in runs.items()
    }
    slower = 1 - rows["json_schema"]["output_tokens_per_s"] / rows["free"]["output_tokens_per_s"]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    record = {
        "benchmark": "structured_cpu",
        "commit": commit,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "torch_threads": 1,
        "cpu": platform.processor() or platform.machine(),
        "results": rows,
        "json_schema_slower_by": slower,
    }
    out = Path(args.out) / f"structured_cpu_{commit}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print("| case | output tokens/s | output tokens |\n| --- | --- | --- |")
    for name, row in rows.items():
        print(f"| {name} | {row['output_tokens_per_s']:.1f} | {row['output_tokens']} |")
    print(f"json_schema is {100 * slower:.1f} % slower\nraw: {out}")


if __name__ == "__main__":
    main()
