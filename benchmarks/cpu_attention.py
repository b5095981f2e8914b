"""CPU decode attention over the paged KV cache: time per (sequence x context token), from 1k to 64k batch-tokens.

    python benchmarks/cpu_attention.py [--heads 8 --kv-heads 2 --head-dim 64] [--budgets 0,4096] [--out FILE]

One decode step's attention of one layer (TorchAttention.forward after prepare, as the engine calls it), fp32,
one torch thread, with every sequence's blocks scattered over the cache. Each case is batch x context; budget 0 is
one gather of the whole batch (how the backend worked up to issue 37), others the decode rows gathered in groups
of at most that many keys. Prints a table (ns per batch-token, and each case against the
smallest) and writes the raw figures as JSON. Each figure is the fastest of --repeats runs (the 2 cores are
shared; the slowest runs measure the neighbours).
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from fovea.attention.backend import PagedAttentionMetadata, TorchAttention

CASES = [(1, 1024), (4, 1024), (16, 1024), (64, 1024), (128, 512), (32, 2048), (8, 8192), (128, 512), (2, 32768)]


def step_meta(backend, batch: int, context: int, heads_kv: int, dim: int, block: int = 16, seed: int = 0):
    blocks_per_seq = -(-context // block)
    num_blocks = batch * blocks_per_seq + 1
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, block, heads_kv, dim, generator=generator)
    tables = (torch.randperm(num_blocks - 1, generator=generator) + 1)[: batch * blocks_per_seq].view(batch, -1)
    lengths = torch.full((batch,), context, dtype=torch.int32)
    last = context - 1
    slots = (tables[:, last // block] * block + last % block).long()
    meta = PagedAttentionMetadata(
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


def time_case(budget: int, batch: int, context: int, args, repeats: int) -> float:
    grouped = "decode_group_tokens" in inspect.signature(TorchAttention).parameters  # absent before issue 37
    backend = TorchAttention(decode_group_tokens=budget or None) if grouped else TorchAttention()
    meta, cache = step_meta(backend, batch, context, args.kv_heads, args.head_dim)
    q = torch.randn(batch, args.heads, args.head_dim)
    k, v = torch.randn(batch, args.kv_heads, args.head_dim), torch.randn(batch, args.kv_heads, args.head_dim)
    backend.prepare(meta)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            backend.forward(q, k, v, cache, meta, args.head_dim**-0.5)
            times.append(time.perf_counter() - start)
    return min(times[1:])  # the least disturbed run: the machine is shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--budgets", default="0,4096", help="decode group sizes in keys; 0: the whole batch at once")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    budgets = [int(b) for b in args.budgets.split(",")]
    rows = []
    for batch, context in dict.fromkeys(CASES):
        row = {"batch": batch, "context": context, "batch_tokens": batch * context}
        for budget in budgets:
            seconds = time_case(budget, batch, context, args, args.repeats)
            row[f"ns_per_token_{budget}"] = seconds * 1e9 / (batch * context)
        rows.append(row)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "benchmark": "cpu_attention",
        "commit": commit,
        "machine": platform.processor() or platform.machine(),
        "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": "float32"},
        "rows": rows,
    }
    out = Path(args.out or f"benchmarks/results/cpu_attention_{commit}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    names = [f"budget {b or 'all'} ns/tok" for b in budgets]
    header = f"{'batch x context':>16}{'tokens':>9}" + "".join(f"{name:>22}" for name in names)
    print(header)
    first = rows[0]
    for row in rows:
        cells = "".join(
            f"{row[f'ns_per_token_{b}']:>12.1f} ({row[f'ns_per_token_{b}'] / first[f'ns_per_token_{b}']:.2f}x)"
            for b in budgets
        )
        print(f"{row['batch']:>7} x {row['context']:<6}{row['batch_tokens']:>9}{cells}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
