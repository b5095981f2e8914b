"""fovea against transformers on the CPU: offline generation of the same prompts, text and one image each.

    python benchmarks/cpu_vs_hf.py [--models tiny-3b,cpu-512] [--prompts 64] [--input-len 128] [--output-len 64]
                                   [--repeats 3] [--out FILE]

For each model (a tiny config written by `fovea tiny --config NAME`: tiny-3b is the demo model's shape, cpu-512 a
512-wide 6-layer decoder with the real Qwen vocabulary) and each workload (text only, or one 448x448 noise image
per prompt), fovea's `LLM.chat` and transformers' `generate` on one padded batch (fovea/bench/offline.py) run the
same prompts greedily with EOS ignored, alternated --repeats times in one process, each repeat with new prompts
and images (the same ones again would find fovea's prefix and encoder caches full, which transformers does not
have); the table gives the medians, fovea's speed-up and how many outputs of all repeats are identical. "floor"
is what both must spend at least: the workload's matrix products alone, each timed at its size (matmul_floor; the
LM head's in fovea's vocabulary slices, faster than one matmul);
hf / floor ("at most") is the largest speed-up an exact fp32 engine could show here. fp32, one torch thread (the
2-core machine is shared).
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
from fovea.layers.basic import vocab_product


def workloads(model_dir: Path, args) -> dict:
    """Each workload's request maker: a repeat's seed -> its requests (new prompts and images every repeat)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    buckets = {(args.image_size, args.image_size, 1): 1.0}
    size = (args.prompts, args.input_len, args.output_len)
    return {
        "text": lambda seed: random_requests(tokenizer, *size, seed=seed),
        "image": lambda seed: random_mm_requests(tokenizer, *size, buckets=buckets, seed=seed),
    }


def timed_matmul(rows: int, inner: int, outer: int, product=None) -> float:
    """Seconds of one fp32 (rows x inner) @ (inner x outer) product into a kept buffer, the fastest of three (the
    floor is a bound: the other two are the shared machine's noise). `product(x, w, out)`: how it is computed
    (default one torch.matmul)."""
    x, w, out = torch.randn(rows, inner), torch.randn(outer, inner), torch.empty(rows, outer)
    product = product or (lambda x, w, out: torch.matmul(x, w.t(), out=out))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        product(x, w, out)
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_floor(model_dir: Path, requests) -> dict:
    """Seconds the workload's matrix products take alone at torch's fp32 speed (MKL, this core), in the fewest,
    largest products: every prompt token through each decoder weight in one product (the chat template's
    tokens not even counted), every patch through the vision tower's, then per decode step the batch's rows
    through the decoder's weights and the LM head. Attention, norms and everything else are left out, so no
    exact fp32 engine on this CPU can take less: hf / floor is the largest speed-up there is to show."""
    from fovea.config.model import ModelConfig

    config = ModelConfig.from_dir(model_dir)
    t, v = config.text, config.vision
    q, kv = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
    decoder = [(t.hidden_size, q + 2 * kv), (q, t.hidden_size), (t.hidden_size, 2 * t.intermediate_size)]
    decoder += [(t.intermediate_size, t.hidden_size)]
    tower = [(v.frame_patch_dim, v.hidden_size)] + [(v.hidden_size, n) for n in (3 * v.hidden_size, v.hidden_size)]
    tower += [(v.hidden_size, 2 * v.intermediate_size), (v.intermediate_size, v.hidden_size)]
    patch = config.image.patch_size
    patches = sum((h // patch) * (w // patch) for r in requests for h, w in map(image_size, r.images))
    merged = patches // v.spatial_merge_size**2
    prompt_tokens = sum(r.prompt_len for r in requests) + merged
    batch, steps = len(requests), requests[0].output_len
    floor = {
        "prefill_s": t.num_layers * sum(timed_matmul(prompt_tokens, k, n) for k, n in decoder),
        "vision_s": 0.0,
        "decode_s": (steps - 1) * t.num_layers * sum(timed_matmul(batch, k, n) for k, n in decoder),
        # the head's product the faster way fovea has (vocabulary slices that fit the L2 cache), the bound being
        # for any exact engine
        "lm_head_s": steps * timed_matmul(batch, t.hidden_size, t.vocab_size, vocab_product),
    }
    if patches:
        merger = [(4 * v.hidden_size, 4 * v.hidden_size), (4 * v.hidden_size, v.out_hidden_size)]
        floor["vision_s"] = v.depth * sum(timed_matmul(patches, k, n) for k, n in tower[1:])
        floor["vision_s"] += timed_matmul(patches, *tower[0]) + sum(timed_matmul(merged, k, n) for k, n in merger)
    floor["total_s"] = sum(floor.values())
    return floor


def image_size(url: str) -> tuple[int, int]:
    from fovea.multimodal.image import load_image

    width, height = load_image(url).size
    return height, width


def measure(model_dir: Path, make_requests, repeats: int) -> dict:
    engines = {
        "fovea": fovea_runner(str(model_dir), {"dtype": "float32", "max_model_len": 4096}),
        "hf": hf_runner(str(model_dir), "float32"),
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    same = 0
    for repeat in range(repeats):  # alternated, so both see the same machine; fresh prompts, so no cache helps
        requests = make_requests(seed=repeat)
        outputs = {}
        for name, run in engines.items():
            start = time.perf_counter()
            outputs[name] = run(requests)[0]  # (the token ids; [1] counts the prompts)
            times[name].append(time.perf_counter() - start)
        same += sum(a == b for a, b in zip(outputs["fovea"], outputs["hf"]))
    fovea_s, hf_s = statistics.median(times["fovea"]), statistics.median(times["hf"])
    floor = matmul_floor(model_dir, requests)
    return {
        "fovea_s": fovea_s,
        "hf_s": hf_s,
        "speedup": hf_s / fovea_s,
        "floor_s": floor["total_s"],
        "max_speedup": hf_s / floor["total_s"],
        "floor": floor,
        "runs_s": times,
        "identical": same,  # of prompts x repeats
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
        for workload, make_requests in workloads(model_dir, args).items():
            row = {"model": name, "workload": workload, **measure(model_dir, make_requests, args.repeats)}
            rows.append(row)
            print(f"{name:<10}{workload:<7}fovea {row['fovea_s']:7.2f} s  hf {row['hf_s']:7.2f} s  "
                  f"{row['speedup']:.2f}x  identical {row['identical']}/{args.prompts * args.repeats}  "
                  f"matmul floor {row['floor_s']:.2f} s (at most {row['max_speedup']:.2f}x)", flush=True)  # fmt: skip
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
    print(
        f"{'model':<10}{'workload':<10}{'fovea s':>9}{'hf s':>9}{'speed-up':>10}{'identical':>11}{'floor s':>9}{'at most':>9}"
    )
    for row in rows:
        print(
            f"{row['model']:<10}{row['workload']:<10}{row['fovea_s']:>9.2f}{row['hf_s']:>9.2f}"
            f"{row['speedup']:>9.2f}x{row['identical']:>8}/{args.prompts * args.repeats}{row['floor_s']:>9.2f}"
            f"{row['max_speedup']:>8.2f}x"
        )
    print(f"-> {out}")


if __name__ == "__main__":
    main()
