"""The sampler on the CPU: milliseconds per step for a batch of 151,936-wide logit rows, this tree's sampler
beside the one of a baseline commit, in the same process.

    python benchmarks/cpu_sampler.py [--baseline 50b4a5d] [--batch 64,256] [--repeats 5] [--out FILE]

Each setting gives every row the same sampling parameters: greedy, plain temperature, top_k, top_p on peaked
logits (a language model's: the mass in a few tokens, settled among the candidates), top_p on flat logits (a
random checkpoint's: the cut falls far outside them), min_p. Medians of --repeats, one torch thread. The
baseline's fovea/runner/sampler.py is read from git and loaded beside ours (its imports are this tree's).
Writes the raw figures as JSON (default benchmarks/results/cpu_sampler_COMMIT.json).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fovea.core.sampling_params import SamplingParams

VOCAB = 151936
SETTINGS = {
    "greedy": (dict(temperature=0), "peaked"),
    "temperature 1": (dict(temperature=1.0), "peaked"),
    "top_k 50": (dict(temperature=0.8, top_k=50), "peaked"),
    "top_p 0.9, peaked": (dict(temperature=0.8, top_p=0.9), "peaked"),
    "top_p 0.9, flat": (dict(temperature=0.8, top_p=0.9), "flat"),
    "min_p 0.05": (dict(temperature=0.8, min_p=0.05), "peaked"),
}


def baseline_sampler(commit: str):
    source = subprocess.run(
        ["git", "show", f"{commit}:fovea/runner/sampler.py"], capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / f"sampler_{commit}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def logits_of(kind: str, batch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, VOCAB, generator=generator)
    if kind == "peaked":  # a language model's row: the mass in ~20 tokens
        logits[:, torch.randperm(VOCAB, generator=generator)[:20]] += 12
    else:
        logits *= 0.1
    return logits


def step_ms(module, logits: torch.Tensor, params: SamplingParams, repeats: int) -> float:
    sampler = module.Sampler(seed=0)
    rows = [module.SampleRow(params, [1, 2], 1, None, ()) for _ in range(logits.shape[0])]
    sampler(logits, rows)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler(logits, rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="50b4a5d")
    parser.add_argument("--batch", default="64,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import fovea.runner.sampler as ours

    theirs = baseline_sampler(args.baseline)
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        for name, (kwargs, kind) in SETTINGS.items():
            logits, params = logits_of(kind, batch), SamplingParams(**kwargs)
            row = {"batch": batch, "setting": name, "params": kwargs, "logits": kind}
            row["baseline_ms"] = step_ms(theirs, logits, params, args.repeats)
            row["ours_ms"] = step_ms(ours, logits, params, args.repeats)
            rows.append(row)
            print(f"batch {batch:<5}{name:<20}{row['baseline_ms']:>10.1f} ms{row['ours_ms']:>10.1f} ms", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "benchmark": "cpu_sampler",
        "commit": commit,
        "baseline": args.baseline,
        "machine": platform.processor() or platform.machine(),
        "threads": 1,
        "vocab": VOCAB,
        "rows": rows,
    }
    out = Path(args.out or f"benchmarks/results/cpu_sampler_{commit}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"{'batch':<7}{'setting':<20}{args.baseline + ' ms':>14}{'this tree ms':>14}{'speed-up':>10}")
    for row in rows:
        speedup = row["baseline_ms"] / row["ours_ms"]
        print(
            f"{row['batch']:<7}{row['setting']:<20}{row['baseline_ms']:>14.1f}{row['ours_ms']:>14.1f}{speedup:>9.1f}x"
        )
    print(f"-> {out}")


if __name__ == "__main__":
    main()
