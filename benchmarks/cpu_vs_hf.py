"""fovea against transformers on the CPU: offline generation of the same prompts, text and one image each.

    python benchmarks/cpu_vs_hf.py [--models tiny-3b,cpu-512] [--prompts 64] [--input-len 128] [--output-len 64]
                                   [--repeats 3] [--out FILE]

For each model (a tiny config written by `fovea tiny --config NAME`: tiny-3b is the demo model's shape, cpu-512 a
512-wide 6-layer decoder with the real Qwen vocabulary) and each workload (text only, or one 448x448 noise image
per prompt), fovea's `LLM.chat` and transformers' `generate` on one padded batch (fovea/bench/offline.py) run the
same prompts greedily with EOS ignored, alternated --repeats times in one process; the table gives the medians,
fovea's speed-up and how many outputs are identical. "LM head" is what both must spend at least: one matmul of
the batch's hidden states with the vocabulary's weights per output token (the largest matmul of these models),
timed alone; hf / LM head is the speed-up a runner doing nothing else would reach. fp32, one torch thread (the 2-core machine is shared).
Writes the raw figures as JSON (default benchmarks/results/cpu_vs_hf_COMMIT.json).
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

from fovea.bench.datasets import random_mm_requests, random_requests
from fovea.bench.offline import fovea_runner, hf_runner


def workloads(model_dir: Path, args) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    shape = (args.image_size, args.image_size, 1)
    return {
        "text": random_requests(tokenizer, args.prompts, args.input_len, args.output_len),
        "image": random_mm_requests(tokenizer, args.prompts, args.input_len, args.output_len, buckets={shape: 1.0}),
    }


def lm_head_floor(model_dir: Path, batch: int, steps: int, repeats: int = 5) -> float:
    """Seconds of `steps` LM-head matmuls at `batch` rows (the decode steps' share that no runner can skip)."""
    from fovea.models.loader import load_model

    model, _ = load_model(model_dir, dtype="float32")
    hidden = torch.randn(batch, model.config.text.hidden_size)
    out = torch.empty(batch, model.config.text.vocab_size)
    with torch.inference_mode():
        model.compute_logits(hidden, out)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model.compute_logits(hidden, out)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * steps


def measure(model_dir: Path, requests, repeats: int) -> dict:
    engines = {
        "fovea": fovea_runner(str(model_dir), requests, {"dtype": "float32", "max_model_len": 4096}),
        "hf": hf_runner(str(model_dir), requests, "float32"),
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    outputs = {}
    for _ in range(repeats):  # alternated, so both see the same machine
        for name, run in engines.items():
            start = time.perf_counter()
            outputs[name] = run()
            times[name].append(time.perf_counter() - start)
    fovea_s, hf_s = statistics.median(times["fovea"]), statistics.median(times["hf"])
    same = sum(a == b for a, b in zip(outputs["fovea"], outputs["hf"]))
    floor_s = lm_head_floor(model_dir, len(requests), requests[0].output_len)
    return {
        "fovea_s": fovea_s,
        "hf_s": hf_s,
        "speedup": hf_s / fovea_s,
        "lm_head_s": floor_s,
        "runs_s": times,
        "identical": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-3b,cpu-512")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from fovea.testing.tiny import write_tiny_checkpoint

    rows = []
    for name in args.models.split(","):
        model_dir = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / name, name, seed=0)
        for workload, requests in workloads(model_dir, args).items():
            row = {"model": name, "workload": workload, **measure(model_dir, requests, args.repeats)}
            rows.append(row)
            print(f"{name:<10}{workload:<7}fovea {row['fovea_s']:7.2f} s  hf {row['hf_s']:7.2f} s  "
                  f"{row['speedup']:.2f}x  identical {row['identical']}/{args.prompts}  "
                  f"LM head {row['lm_head_s']:.2f} s", flush=True)  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "benchmark": "cpu_vs_hf",
        "commit": commit,
        "machine": platform.processor() or platform.machine(),
        "threads": 1,
        "settings": vars(args),
        "rows": rows,
    }
    out = Path(args.out or f"benchmarks/results/cpu_vs_hf_{commit}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"{'model':<10}{'workload':<10}{'fovea s':>9}{'hf s':>9}{'speed-up':>10}{'identical':>11}{'LM head s':>11}")
    for row in rows:
        print(
            f"{row['model']:<10}{row['workload']:<10}{row['fovea_s']:>9.2f}{row['hf_s']:>9.2f}"
            f"{row['speedup']:>9.2f}x{row['identical']:>8}/{args.prompts}{row['lm_head_s']:>11.2f}"
        )
    print(f"-> {out}")


if __name__ == "__main__":
    main()
