"""CPU decode attention over the paged KV cache: time per (sequence x context token), from 1k to 64k batch-tokens.

    python benchmarks/cpu_attention.py [--heads 8 --kv-heads 2 --head-dim 64] [--budgets 0,4096]
                                       [--baseline DIR] [--out FILE]

One decode step's attention of one layer (TorchAttention.forward after prepare, as the engine calls it), fp32,
one torch thread, with every sequence's blocks scattered over the cache. Each case is batch x context; budget 0 is
one gather of the whole batch (how the backend worked up to issue 37), others the decode rows gathered in groups
of at most that many keys. --baseline DIR (a checkout of another commit, e.g. `git worktree add DIR COMMIT`)
times that commit's backend too, run for run alternated with this one's in the same process, so both see the
same machine. Prints a table (ns per batch-token, and each case against the smallest) and writes the raw figures
as JSON. Each figure is the fastest of --repeats runs (the 2 cores are shared; the slowest runs measure the
neighbours).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

import fovea.attention.backend

CASES = [(1, 1024), (4, 1024), (16, 1024), (64, 1024), (128, 512), (32, 2048), (8, 8192), (128, 512), (2, 32768)]


def step_meta(module, backend, batch: int, context: int, heads_kv: int, dim: int, block: int = 16, seed: int = 0):
    blocks_per_seq = -(-context // block)
    num_blocks = batch * blocks_per_seq + 1
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, block, heads_kv, dim, generator=generator)
    tables = (torch.randperm(num_blocks - 1, generator=generator) + 1)[: batch * blocks_per_seq].view(batch, -1)
    lengths = torch.full((batch,), context, dtype=torch.int32)
    last = context - 1
    slots = (tables[:, last // block] * block + last % block).long()
    meta = module.PagedAttentionMetadata(
        backend,
        slots,
        torch.arange(batch + 1, dtype=torch.int32),
        lengths,
        tables.int(),
        1,
        context,
        block,
        [cache],
    )
    return meta, cache


def case_runner(module, budget: int, batch: int, context: int, args):
    """A function that runs the case's forward once (the backend of `module`, a version of
    fovea/attention/backend.py)."""
    backend_class = module.TorchAttention
    grouped = "decode_group_tokens" in inspect.signature(backend_class).parameters  # absent before issue 37
    backend = backend_class(decode_group_tokens=budget or None) if grouped else backend_class()
    meta, cache = step_meta(module, backend, batch, context, args.kv_heads, args.head_dim)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(batch, args.heads, args.head_dim, generator=generator)
    k, v = (torch.randn(batch, args.kv_heads, args.head_dim, generator=generator) for _ in range(2))
    backend.prepare(meta)
    return lambda: backend.forward(q, k, v, cache, meta, args.head_dim**-0.5)


def time_cases(runners: dict, repeats: int) -> dict[str, float]:
    """Seconds of each runner's least disturbed run (the machine is shared), the runners alternated run by run."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            for name, run in runners.items():
                start = time.perf_counter()
                run()
                if repeat:  # the first run warms up
                    times[name].append(time.perf_counter() - start)
    return {name: min(seconds) for name, seconds in times.items()}


def load_baseline(directory: str):
    """Another checkout's fovea/attention/backend.py as a module of its own (it imports torch only)."""
    spec = importlib.util.spec_from_file_location("baseline_backend", Path(directory) / "fovea/attention/backend.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--budgets", default="0,4096", help="decode group sizes in keys; 0: the whole batch at once")
    parser.add_argument("--baseline", default=None, help="a checkout of the commit to compare with")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    modules = {"": fovea.attention.backend}
    if args.baseline:
        modules = {"": fovea.attention.backend, "baseline ": load_baseline(args.baseline)}
    columns = [f"{label}{budget}" for label in modules for budget in args.budgets.split(",")]
    rows = []
    for batch, context in dict.fromkeys(CASES):
        runners = {
            f"{label}{budget}": case_runner(module, int(budget), batch, context, args)
            for label, module in modules.items()
            for budget in args.budgets.split(",")
        }
        seconds = time_cases(runners, args.repeats)
        row = {"batch": batch, "context": context, "batch_tokens": batch * context}
        row |= {
            f"ns_per_token_{column}".replace(" ", "_"): seconds[column] * 1e9 / (batch * context) for column in columns
        }
        rows.append(row)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    baseline = (
        args.baseline
        and subprocess.run(
            ["git", "-C", args.baseline, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    result = {
        "benchmark": "cpu_attention",
        "commit": commit,
        "baseline_commit": baseline,
        "machine": platform.processor() or platform.machine(),
        "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": "float32"},
        "rows": rows,
    }
    out = Path(args.out or f"benchmarks/results/cpu_attention_{commit}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    keys = [f"ns_per_token_{column}".replace(" ", "_") for column in columns]
    names = [
        f"{column.split()[0] + ' ' if ' ' in column else ''}budget {column.split()[-1]} ns/tok" for column in columns
    ]
    print(f"{'batch x context':>16}{'tokens':>9}" + "".join(f"{name:>32}" for name in names))
    first = rows[0]
    for row in rows:
        cells = "".join(f"{row[key]:>22.1f} ({row[key] / first[key]:.2f}x)" for key in keys)
        print(f"{row['batch']:>7} x {row['context']:<6}{row['batch_tokens']:>9}{cells}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
