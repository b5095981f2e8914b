"""One decode step of the language model, measured beside its floor, and its top kernels (torch profiler).

    python benchmarks/decode_step.py --model DIR --out DIR [--cases 16x8192,256x1024] [--variants fused,unfused]
                                     [--quick]

For each case (batch x context) the KV cache is filled with random values and every sequence's blocks are
scattered over it; the step (the decoder layers, then the LM head over every row) is timed replayed from a CUDA
graph, as the engine runs it (median of 20, synchronized after each), and profiled eagerly once for the kernel
table. The floor is the
larger of the step's FLOPs over the matmul rate and its bytes (LM weights + the batch's KV cache) over the copy
bandwidth (fovea/bench/floors.py); the attention kernel's own floor is its KV bytes over the bandwidth. --rates
takes the measured rates ("TFLOPS,TBPS"); --variants: the model built with the fused element-wise kernels (as the
engine builds it on a GPU) and/or without, side by side in one run; writes decode_step.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fovea.attention.backend import PagedAttentionMetadata
from fovea.bench.floors import decode_step_bytes, lm_matmul_params
from fovea.config.model import ModelConfig
from fovea.models.base import ModelOptions
from fovea.models.loader import load_model

BLOCK = 16
ATTENTION_KERNELS = {"_decode", "_combine", "_attention"}  # fovea/attention/triton_paged_kernels.py


def make_step(config: ModelConfig, batch: int, context: int, device, dtype, backend):
    text = config.text
    blocks_per_seq = -(-(context + 1) // BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    gen = torch.Generator(device=device).manual_seed(0)
    caches = [
        torch.randn(2, num_blocks, BLOCK, text.num_kv_heads, text.head_dim, device=device, dtype=dtype, generator=gen)
        for _ in range(text.num_layers)
    ]
    order = torch.randperm(num_blocks - 1, device=device, generator=gen).to(torch.int32) + 1
    tables = order[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context + 1, dtype=torch.int32, device=device)
    slots = tables[:, context // BLOCK].long() * BLOCK + context % BLOCK
    meta = PagedAttentionMetadata(
        backend,
        slots,
        torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens,
        tables,
        1,
        context + 1,
        BLOCK,
        caches,
    )
    ids = torch.randint(0, 150000, (batch,), device=device, generator=gen)
    positions = torch.full((3, batch), context, dtype=torch.long, device=device)
    return ids, positions, meta


def top_kernels(prof, cuda: bool, count: int = 10) -> list[dict]:
    rows = []
    for event in prof.key_averages():
        device_us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if device_us > 0:
            rows.append({"kernel": event.key[:90], "calls": event.count, "us": device_us})
    total = sum(r["us"] for r in rows)
    rows.sort(key=lambda r: -r["us"])
    for r in rows:
        r["share"] = r["us"] / total
    return rows[:count]


def measure(model, config: ModelConfig, batch: int, context: int, rates: tuple[float, float], quick: bool) -> dict:
    from fovea.attention.triton_paged import TritonAttention

    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    text = config.text
    backend = TritonAttention(group=text.num_heads // text.num_kv_heads)
    ids, positions, meta = make_step(config, batch, context, device, dtype, backend)

    def step():
        backend.prepare(meta)
        hidden = model.text_forward(ids, positions, meta)
        return model.compute_logits(hidden)

    cuda = device.type == "cuda"
    with torch.inference_mode():
        for _ in range(3):
            step()
        replay = step  # without a GPU (--quick on the CPU) the step runs eagerly
        if cuda:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            replay = graph.replay
        times = []
        for _ in range(5 if quick else 20):
            start = time.perf_counter()
            replay()
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
        with torch.profiler.profile(activities=[activity]) as prof:
            step()
            if cuda:
                torch.cuda.synchronize()
    layers, lm_head = lm_matmul_params(config)
    flops = batch * (2 * (layers + lm_head) + 4 * text.num_layers * text.num_heads * text.head_dim * context)
    step_bytes = decode_step_bytes(config, batch, context + 1, dtype.itemsize)
    kv_bytes = batch * (context + 1) * 2 * text.num_layers * text.num_kv_heads * text.head_dim * dtype.itemsize
    matmul, bandwidth = rates
    floor_ms = max(flops / matmul, step_bytes / bandwidth) * 1e3
    kernels = top_kernels(prof, cuda)
    attention_us = sum(k["us"] for k in kernels if k["kernel"] in ATTENTION_KERNELS)
    return {
        "batch": batch,
        "context": context,
        "step_ms": statistics.median(times),
        "floor_ms": floor_ms,
        "attention_us_per_layer": attention_us / text.num_layers,
        "attention_floor_us_per_layer": kv_bytes / text.num_layers / bandwidth * 1e6,
        "top_kernels": kernels,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default="16x8192,256x1024")
    parser.add_argument("--rates", default="798,3.0", help="matmul TFLOP/s,copy TB/s (measured in the same run)")
    parser.add_argument("--variants", default="fused", help="fused, unfused or both (comma-separated)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tflops, tbps = (float(x) for x in args.rates.split(","))
    config = ModelConfig.from_dir(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = [(2, 64)] if args.quick else [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    results = []
    for variant in args.variants.split(","):
        options = ModelOptions(vision_kernel=True, fused_kernels=variant == "fused")
        model, _ = load_model(args.model, dtype="bfloat16", device=device, options=options)
        for b, c in cases:
            results.append(
                {"variant": variant, **measure(model, config, b, c, (tflops * 1e12, tbps * 1e12), args.quick)}
            )
        del model
        torch.cuda.empty_cache() if device == "cuda" else None
    (out / "decode_step.json").write_text(json.dumps(results, indent=2))
    for r in results:
        print(
            f"\n{r['variant']}: decode step, batch {r['batch']} x context {r['context']}: {r['step_ms']:.2f} ms (CUDA graph) against "
            f"a floor of {r['floor_ms']:.2f} ms = {r['step_ms'] / r['floor_ms']:.2f}x; attention "
            f"{r['attention_us_per_layer']:.1f} us/layer against {r['attention_floor_us_per_layer']:.1f}"
        )
        print("| kernel | calls | us | share |\n|---|---|---|---|")
        for k in r["top_kernels"]:
            print(f"| {k['kernel']} | {k['calls']} | {k['us']:.0f} | {k['share']:.1%} |")


if __name__ == "__main__":
    main()
