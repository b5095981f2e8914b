"""The sampler on the CPU, side by side with an earlier version of it (taken from git) in the same run.

One step of 1, 64 and 256 rows over Qwen2's 151,936-token vocabulary, each row with a 600-token prompt and 50
generated tokens (random ids), for seven kinds of sampling parameters; "x greedy" is each case's time over
greedy's (same sampler, same batch):
  greedy                   temperature 0
  qwen-generation-config   Qwen2.5-VL's generation_config.json (temperature 0.1, top_p 0.001, top_k 1,
                           repetition_penalty 1.05): what every server request without sampling fields gets
  top_p 0.8 (peaked)       temperature 0.7, top_p 0.8, repetition_penalty 1.05 on language-model-like logits
  top_p 0.8 (flat)         the same on flat logits (a random checkpoint's), whose top_p cut lies outside the
                           candidates: the whole-row path
  plain                    temperature 1.0, no filters, no penalties
  top_k 50                 temperature 0.8, top_k 50
  min_p 0.05               temperature 0.8, min_p 0.05 (the whole-row path)

    python benchmarks/sampler_cpu.py [--baseline 50b4a5d] [--rows 1 64 256] [--out benchmarks/results]

The baseline's fovea/runner/sampler.py, fovea/runner/penalties.py (where it has one) and
fovea/core/sampling_params.py are read from git and loaded beside this tree's (the other modules they import are
this tree's).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fovea.core.sampling_params import SamplingParams  # noqa: E402
from fovea.runner import sampler as current  # noqa: E402

VOCAB = 151936
CASES = {
    "greedy": (dict(temperature=0.0), "peaked"),
    "qwen-generation-config": (dict(temperature=0.1, top_p=0.001, top_k=1, repetition_penalty=1.05), "peaked"),
    "top_p 0.8 (peaked)": (dict(temperature=0.7, top_p=0.8, repetition_penalty=1.05), "peaked"),
    "top_p 0.8 (flat)": (dict(temperature=0.7, top_p=0.8, repetition_penalty=1.05), "flat"),
    "plain": (dict(temperature=1.0), "peaked"),
    "top_k 50": (dict(temperature=0.8, top_k=50), "peaked"),
    "min_p 0.05": (dict(temperature=0.8, min_p=0.05), "peaked"),
}


def load_baseline(ref: str, source_path: str, uses: dict | None = None):
    """The file `source_path` as it was at `ref`, as a module of its own (None where it did not exist);
    `uses`: modules it imports, by name, to take instead of this tree's while it loads."""
    shown = subprocess.run(["git", "show", f"{ref}:{source_path}"], cwd=ROOT, capture_output=True, text=True)
    if shown.returncode:
        return None
    source = shown.stdout
    name = Path(source_path).stem
    path = Path(tempfile.mkdtemp()) / f"baseline_{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"baseline_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    swapped = {name: sys.modules.get(name) for name in uses or {}}
    sys.modules.update({name: used for name, used in (uses or {}).items() if used is not None})
    try:
        spec.loader.exec_module(module)
    finally:
        for name, own in swapped.items():
            if own is not None:
                sys.modules[name] = own
    return module


def make_logits(kind: str, rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, VOCAB, generator=generator) * (0.3 if kind == "flat" else 2.0)
    if kind == "peaked":  # a few tokens carry most of the mass, as in a trained model
        logits.scatter_add_(1, torch.randint(0, VOCAB, (rows, 8), generator=generator), torch.full((rows, 8), 14.0))
    return logits


def time_step(module, logits: torch.Tensor, params: SamplingParams, repeats: int) -> float:
    # prompt ids spread over the vocabulary as a real prompt's are: the penalties' reads and writes of a row's
    # seen tokens then each land in another cache line, as they do in serving
    generator = torch.Generator().manual_seed(1)
    rows = [
        module.SampleRow(params, torch.randint(0, VOCAB, (650,), generator=generator).tolist(), 600, None, ())
        for _ in range(logits.shape[0])
    ]
    sampler = module.Sampler(seed=0)
    sampler(logits, rows)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler(logits, rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="50b4a5d", help="git ref of the sampler to compare with")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256], help="batch sizes")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    # the baseline's parameters too: which rows count as greedy is decided there
    penalties = load_baseline(args.baseline, "fovea/runner/penalties.py")
    baseline = load_baseline(args.baseline, "fovea/runner/sampler.py", {"fovea.runner.penalties": penalties})
    baseline_params = load_baseline(args.baseline, "fovea/core/sampling_params.py")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    results = []
    for rows in args.rows:
        for name, (fields, kind) in CASES.items():
            logits = make_logits(kind, rows)
            before = time_step(baseline, logits, baseline_params.SamplingParams(max_tokens=100, **fields), args.repeats)
            after = time_step(current, logits, SamplingParams(max_tokens=100, **fields), args.repeats)
            results.append(
                {"rows": rows, "case": name, "baseline_s": before, "fovea_s": after, "speedup": before / after}
            )
    greedy = {r["rows"]: r["fovea_s"] for r in results if r["case"] == "greedy"}
    for r in results:
        r["vs_greedy"] = r["fovea_s"] / greedy[r["rows"]]
    record = {
        "benchmark": "sampler_cpu",
        "vocab": VOCAB,
        "commit": commit,
        "baseline": args.baseline,
        "torch_threads": 1,
        "cpu": platform.processor() or platform.machine(),
        "results": results,
    }
    out = Path(args.out) / f"sampler_cpu_{commit}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"| rows | case | {args.baseline} ms/step | {commit} ms/step | speed-up | x greedy |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['rows']} | {r['case']} | {r['baseline_s'] * 1e3:.2f} | {r['fovea_s'] * 1e3:.2f} | "
            f"{r['speedup']:.1f}x | {r['vs_greedy']:.2f}x |"
        )
    print(f"raw: {out}")


if __name__ == "__main__":
    main()
