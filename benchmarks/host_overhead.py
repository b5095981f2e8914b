"""Where a served decode step's time goes: the engine stepped in-process, its decode steps split into phases.

    python benchmarks/host_overhead.py --model DIR --out FILE [--cases 16x8000,256x1000] [--steps 60] [--quick]
        [--order auto|in-order|overlapped|ahead]

For each case (batch x prompt tokens of random ids), the engine is filled (prefill done), then `--steps` decode
steps are timed whole, then as many again by phase: scheduling, building the step's inputs, the model on the GPU
(run_step, synchronized after), the sampler (synchronized after), and the rest (recording tokens, detokenizing,
stop checks, outputs). The phases' synchronizations keep the host from queuing the sampler behind the forward, so
the whole-step time comes from the first, unwrapped steps. Sampling uses the checkpoint's defaults (Qwen2.5-VL's generation_config: repetition_penalty 1.05,
top_k 1), as a request that names no sampling fields gets them from `fovea serve`; a greedy run (temperature 0,
no penalties) of the same case follows for comparison. Then a cProfile of some steps lists the top host
functions.

Only stable entry points are used (LLM, engine.step, runner.run_step / sampler / scheduler.schedule), so the same
script times an earlier commit's tree side by side: PYTHONPATH=that_tree python benchmarks/host_overhead.py ...
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from fovea import LLM, SamplingParams
from fovea.core.sampling_params import RequestOutputKind

ORDERS = {
    "auto": {},
    "in-order": {"overlap_outputs": False, "async_scheduling": False},
    "overlapped": {"overlap_outputs": True, "async_scheduling": False},
    "ahead": {"async_scheduling": True},
}
SAMPLINGS = {
    "defaults": None,  # the checkpoint's generation_config, read once the model is loaded
    "greedy": SamplingParams(temperature=0),
    "top_p": SamplingParams(temperature=0.7, top_p=0.9),
    "top_k_top_p": SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Phases:
    """Wraps the engine's parts in timers (their calls' wall time, a synchronization after GPU work)."""

    def __init__(self, engine):
        self.spent: dict[str, float] = {}
        self.on = False
        runner = engine.runner
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(runner, "run_step", "model", sync=True)
        self._wrap(runner, "sampler", "sampler", sync=True)
        self._wrap(runner, "execute", "execute")

    def _wrap(self, owner, name: str, phase: str, sync: bool = False) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.on:
                return inner(*args, **kwargs)
            start = time.perf_counter()
            result = inner(*args, **kwargs)
            if sync:
                _sync()
            self.spent[phase] = self.spent.get(phase, 0.0) + time.perf_counter() - start
            return result

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        spent, self.spent = self.spent, {}
        return spent


def run_case(
    llm: LLM, phases: Phases, batch: int, prompt_len: int, steps: int, params: SamplingParams, profile_steps: int
) -> dict:
    engine = llm.engine
    rng = np.random.default_rng(batch * 7919 + prompt_len)
    params = params.clone(
        max_tokens=2 * steps + profile_steps + 8, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    for i in range(batch):
        ids = rng.integers(0, 150000, prompt_len).tolist()
        engine.add_request(
            llm.inputs.make_request(
                f"{batch}x{prompt_len}-{i}-{time.monotonic()}", llm.inputs.process({"prompt_token_ids": ids}), params
            )
        )
    start = time.perf_counter()
    while any(s.is_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    _sync()
    prefill_s = time.perf_counter() - start
    for _ in range(3):  # settle (first sampled rows, caches)
        engine.step()
    times, split = [], []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    phases.on = True
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        split.append({"step": time.perf_counter() - start, **phases.take()})
    phases.on = False
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(profile_steps):
        engine.step()
    profiler.disable()
    engine.abort_request(list(engine.requests))
    engine.step()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    median = {
        k: statistics.median(s.get(k, 0.0) for s in split) * 1e3
        for k in ("step", "schedule", "execute", "model", "sampler")
    }
    step_ms = statistics.median(times) * 1e3
    build_ms = median["execute"] - median["model"] - median["sampler"]
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "steps": steps,
        "prefill_s": prefill_s,
        "step_ms": step_ms,
        "schedule_ms": median["schedule"],
        "build_ms": build_ms,
        "model_ms": median["model"],
        "sampler_ms": median["sampler"],
        "phased_step_ms": median["step"],
        "rest_ms": median["step"] - median["schedule"] - median["execute"],
        "profile": text.getvalue(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--label", default="")
    # the engine's step order (LLMEngine.step), for a side-by-side: auto (ahead on a GPU), in-order (each step's
    # outputs built before the next is queued, as a CPU engine does), overlapped (the next step queued before the
    # last one's outputs are built, after its tokens are back), ahead (--async-scheduling: before they are back)
    parser.add_argument("--order", choices=tuple(ORDERS), default="auto")
    parser.add_argument("--cases", default="16x8000,256x1000")
    parser.add_argument("--steps", type=int, default=60)
    # defaults: the checkpoint's (Qwen2.5-VL: repetition_penalty 1.05, top_k 1); top_p: what most OpenAI clients
    # send (no top_k, so whether a row's best candidates covered its top_p is read back from the device each step);
    # top_k_top_p: Qwen3-VL's card (settled by the top_k on the host)
    parser.add_argument("--sampling", default="defaults,greedy", help=f"comma-separated: {', '.join(SAMPLINGS)}")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    cases = [(2, 40)] if args.quick else [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    steps, profile_steps = (4, 2) if args.quick else (args.steps, 20)
    largest = max(b for b, _ in cases)
    llm = LLM(
        args.model,
        max_num_seqs=max(largest, 16),
        max_model_len=max(p for _, p in cases) + steps + 64,
        enable_prefix_caching=False,
        **ORDERS[args.order],
    )
    phases = Phases(llm.engine)
    samplings = {**SAMPLINGS, "defaults": llm.get_default_sampling_params()}
    results = []
    for batch, prompt_len in cases:
        for name in args.sampling.split(","):
            params = samplings[name]
            result = run_case(llm, phases, batch, prompt_len, steps, params, profile_steps)
            result["sampling"] = name
            results.append(result)
            print(
                f"{args.label} {batch}x{prompt_len} {name}: step {result['step_ms']:.2f} ms; synchronized by phase "
                f"{result['phased_step_ms']:.2f} ms = model {result['model_ms']:.2f} + sampler "
                f"{result['sampler_ms']:.2f} + build {result['build_ms']:.2f} + schedule "
                f"{result['schedule_ms']:.2f} + rest {result['rest_ms']:.2f}",
                flush=True,
            )
            print(result["profile"][:3000], flush=True)
    llm.close()
    Path(args.out).write_text(json.dumps({"label": args.label, "model": args.model, "results": results}, indent=2))


if __name__ == "__main__":
    main()
