"""Offline throughput: fovea `LLM.generate` vs transformers `generate` (one padded batch), same prompts, same run.

64 prompts (half text-only, half with one image of varied size), greedy, a fixed number of new tokens each
(EOS ignored), on a tiny random Qwen2.5-VL checkpoint. Then the engine's host overhead at batch 256: the time
of a decode step spent outside the model forward (scheduling, input building, sampling, detokenizing).
Both timings include image decoding and preprocessing; medians of --repeats alternated runs. The two sides
come from fovea/bench/offline.py (the runners `fovea bench throughput` uses).
Run:  python benchmarks/offline_throughput.py [--model tiny-3b] [--prompts 64] [--max-tokens 32] [--repeats 3]
Writes the raw figures as JSON to benchmarks/results/ (or --out).
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

import numpy as np
import torch

from fovea.bench.datasets import BenchRequest, noise_jpeg_url
from fovea.bench.offline import fovea_runner, hf_runner

WORDS = "the sea boat red colour count gull mast harbour light wave stone sky cloud green net".split()


def make_requests(count: int, max_tokens: int, seed: int = 0) -> list[BenchRequest]:
    """Half text-only, half with one noise image of a varied size (multiples of 28 from 112 to 308)."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(count):
        text = " ".join(rng.choice(WORDS, int(rng.integers(10, 120))))
        images = [noise_jpeg_url(*(int(v) * 28 for v in rng.integers(4, 12, 2)), rng)] if i % 2 else []
        requests.append(BenchRequest(text, 0, max_tokens, images))
    return requests


def timed(fn, requests) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    tokens = fn(requests)[0]  # (the token ids; [1] counts the prompts)
    return time.perf_counter() - start, tokens


def host_overhead(model_dir, batch: int, steps: int) -> dict:
    """Decode steps at `batch` sequences: wall time per step split into the model (transformer + LM head), the
    sampler, and the host-side rest (scheduling, input building, detokenizing, stop checks, outputs)."""
    from fovea import LLM, SamplingParams
    from fovea.core.sampling_params import RequestOutputKind

    llm = LLM(str(model_dir), dtype="float32", max_model_len=1024, max_num_seqs=batch)
    engine = llm.engine
    spent = {"model": [], "sampler": []}

    def timed(part, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            spent[part].append(time.perf_counter() - start)
            return result

        return wrapper

    model = engine.runner.model
    model.forward = timed("model", model.forward)
    model.compute_logits = timed("model", model.compute_logits)
    engine.runner.sampler = timed("sampler", engine.runner.sampler)
    params = SamplingParams(
        temperature=0, max_tokens=steps + 10, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    for i in range(batch):
        engine.add_request(llm.inputs.make_request(f"o{i}", llm.inputs.process(f"{i} " + " ".join(WORDS)), params))
    while any(s.is_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    step_times = []
    for part in spent.values():
        part.clear()
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    engine.abort_request(list(engine.requests))
    engine.step()
    step = statistics.median(step_times)
    model_s = statistics.median([a + b for a, b in zip(spent["model"][::2], spent["model"][1::2])])
    sampler_s = statistics.median(spent["sampler"])
    return {
        "batch": batch,
        "steps": steps,
        "step_ms": step * 1e3,
        "model_ms": model_s * 1e3,
        "sampler_ms": sampler_s * 1e3,
        "host_overhead_ms": (step - model_s - sampler_s) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-3b", help="tiny config name, or a model directory")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--overhead-batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each, alternated; medians reported")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from fovea.testing.tiny import write_tiny_checkpoint
    from fovea.testing.tiny_configs import TINY_SHAPES

    model_dir = Path(args.model)
    if args.model in TINY_SHAPES:
        model_dir = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / args.model, args.model, seed=0)
    fovea_run = fovea_runner(str(model_dir), {"dtype": "float32", "max_model_len": 4096})
    hf_run = hf_runner(str(model_dir), "float32")
    fovea_times, hf_times = [], []
    same = 0
    # alternated, so both see the same machine noise; new prompts each repeat, so fovea's caches start empty
    for repeat in range(args.repeats):
        requests = make_requests(args.prompts, args.max_tokens, seed=repeat)
        fovea_s, fovea_tokens = timed(fovea_run, requests)
        hf_s, hf_tokens = timed(hf_run, requests)
        fovea_times.append(fovea_s)
        hf_times.append(hf_s)
        same += sum(a == b for a, b in zip(fovea_tokens, hf_tokens))
    fovea_s, hf_s = statistics.median(fovea_times), statistics.median(hf_times)
    generated = args.prompts * args.max_tokens
    overhead = host_overhead(model_dir, args.overhead_batch, steps=20)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "benchmark": "offline_throughput",
        "model": args.model,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "commit": commit,
        "fovea_s": fovea_s,
        "hf_s": hf_s,
        "fovea_runs_s": fovea_times,
        "hf_runs_s": hf_times,
        "fovea_tok_s": generated / fovea_s,
        "hf_tok_s": generated / hf_s,
        "speedup": hf_s / fovea_s,
        "identical_outputs": f"{same}/{args.prompts * args.repeats}",
        "host_overhead": overhead,
    }
    out = Path(args.out or f"benchmarks/results/offline_cpu_{args.model}_{commit}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(
        f"{'engine':<8}{'seconds':>10}{'out tok/s':>12}\n{'fovea':<8}{fovea_s:>10.2f}{generated / fovea_s:>12.1f}\n"
        f"{'hf':<8}{hf_s:>10.2f}{generated / hf_s:>12.1f}\nspeedup {hf_s / fovea_s:.2f}x, identical greedy "
        f"outputs {same}/{args.prompts * args.repeats}\ndecode step at batch {overhead['batch']}: {overhead['step_ms']:.1f} ms, "
        f"model {overhead['model_ms']:.1f} ms, sampler {overhead['sampler_ms']:.1f} ms, host overhead "
        f"{overhead['host_overhead_ms']:.1f} ms\n-> {out}"
    )


if __name__ == "__main__":
    main()
