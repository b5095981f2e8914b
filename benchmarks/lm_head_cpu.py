"""The LM head's product on the CPU: one fp32 matmul of the rows with the whole (vocabulary x hidden) weight, as
transformers and fovea before it do, against fovea's `vocab_product` (the same product in vocabulary slices whose
weights fit the L2 cache), side by side in one run.

    python benchmarks/lm_head_cpu.py [--widths 64 512 2048] [--rows 1 8 64 256] [--repeats 7] [--out FILE]

Qwen2's 151,936-token vocabulary, one torch thread, random weights; both write into a kept buffer. The two are
alternated, --repeats times each, and the medians reported; "same" says whether the two products were equal to
the bit. Writes the raw times as JSON (default benchmarks/results/lm_head_cpu_COMMIT.json).
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

from fovea.layers.basic import vocab_product

VOCAB = 151_936


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    products = {
        "whole": lambda x, w, out: torch.mm(x, w.t(), out=out),
        "sliced": vocab_product,
    }
    results = []
    for width in args.widths:
        weight = torch.randn(VOCAB, width) / width**0.5
        for rows in args.rows:
            x, outs = torch.randn(rows, width), {name: torch.empty(rows, VOCAB) for name in products}
            times: dict[str, list[float]] = {name: [] for name in products}
            for _ in range(args.repeats + 1):  # the first round warms up and is not counted
                for name, product in products.items():
                    start = time.perf_counter()
                    product(x, weight, outs[name])
                    times[name].append(time.perf_counter() - start)
            row = {"width": width, "rows": rows, "runs_s": {name: t[1:] for name, t in times.items()}}
            row.update({f"{name}_ms": 1e3 * statistics.median(t[1:]) for name, t in times.items()})
            row["speedup"] = row["whole_ms"] / row["sliced_ms"]
            row["same"] = bool(torch.equal(outs["whole"], outs["sliced"]))
            results.append(row)
            print(
                f"width {width:5} rows {rows:4}  whole {row['whole_ms']:8.1f} ms  sliced {row['sliced_ms']:8.1f} ms"
                f"  {row['speedup']:.2f}x  same {row['same']}",
                flush=True,
            )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = Path(args.out or f"benchmarks/results/lm_head_cpu_{commit}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "lm_head_cpu", "commit": commit, "machine": platform.processor() or platform.machine()}
    out.write_text(
        json.dumps({**record, "threads": 1, "vocab": VOCAB, "settings": vars(args), "rows": results}, indent=2)
    )
    print(f"{'width':>6}{'rows':>6}{'whole ms':>10}{'sliced ms':>11}{'speed-up':>10}{'same':>6}")
    for row in results:
        print(
            f"{row['width']:>6}{row['rows']:>6}{row['whole_ms']:>10.1f}{row['sliced_ms']:>11.1f}"
            f"{row['speedup']:>9.2f}x{row['same']!s:>6}"
        )
    print(f"-> {out}")


if __name__ == "__main__":
    main()
