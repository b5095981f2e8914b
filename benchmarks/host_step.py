"""Host time per decode step with a model that costs nothing (issue 54): the real engine (scheduler, step inputs,
sampler, recording, detokenizing, outputs, and served: the engine process's pipe to the front end) around a forward
replaced by fixed logits over the real 151,936-token vocabulary.

    python benchmarks/host_step.py --out FILE [--baseline TREE] [--batches 1,16,64,256] [--contexts 1000,8000]
        [--modes offline,served] [--samplings greedy,default,logprobs] [--steps 40] [--stream] [--repeats 1] [--vocab N]
        [--quick]

Each case (mode x sampling x batch x context, one fresh process per case and tree, the trees alternating) fills
the engine with `batch` prompts of random ids, then times the decode steps where every request decodes. Per step:

- critical path: host time from one step's samples being taken (the sampler's end) to the next forward's launch,
  the time a GPU would sit idle in an in-order engine (the median over the steps);
- device: the forward (the stub: a view of fixed logits) and the sampler. The sampler's tensor work runs on this
  CPU; on a GPU it is the device's, so it is reported apart, not as host time;
- host CPU: the engine process's CPU time per step less the device's, plus the front end's (served: the process
  that detokenizes, once the redesign moves it there), both from the processes' own clocks;
- phases of the critical path by the functions that exist in the tree (schedule, build the step's inputs, record
  the samples, report the outputs); the rest (the engine process's sends and polls, ...) is `other`;
- the engine process's garbage collector: its passes' time per step, and the longest pass (a full collection
  stops the step it falls in, which the medians above do not show).

The stub is installed in every process the case starts (the engine process too) through a sitecustomize module
on PYTHONPATH, so an earlier tree is measured the same way side by side: `--baseline DIR` (e.g. a `git archive`
of the baseline commit) runs every case on that tree as well, interleaved with this one. The checkpoint is
fovea.testing.tiny's tiny-3b (the real Qwen2 vocabulary and tokenizer, Qwen2.5-VL's generation_config: the
`default` sampling is repetition_penalty 1.05, temperature 0.1, top_p 0.001, top_k 1; `logprobs` is greedy with
logprobs=5, each token's five likeliest).

`--vocab N` has the stub return only the first N logit columns. On this CPU the sampler's pass over a step's
logits (256 x 151,936 fp32: 155 MB) evicts the host's caches, so the host work after it runs cold; on a GPU the
logits stay in device memory and the host's caches stay warm. A small N measures the host as a GPU leaves it.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FLUSH_EVERY = 32  # steps between log writes (each before a forward's clock starts: not on the critical path)

# ------------------------------------------------------------------------------- inside the measured processes


class StepLog:
    """One JSON line per step: when its forward started and ended, when its sampler ended, the process's CPU time
    at the forward's start, its token and logits-row counts, and the time spent per phase since the previous
    forward started."""

    def __init__(self, prefix: str):
        self.path = f"{prefix}.{os.getpid()}.jsonl"
        self.lines: list[str] = []
        self.current: dict | None = None
        self.phases: dict[str, float] = {}
        self.steps = 0
        atexit.register(self.flush)

    def flush(self) -> None:
        if self.current is not None:
            self.lines.append(json.dumps(self.current))
            self.current = None
        if self.lines:
            with open(self.path, "a") as f:
                f.write("\n".join(self.lines) + "\n")
            self.lines = []

    def forward(self, start: float, cpu: float, tokens: int, rows: int, end: float) -> None:
        if self.current is not None:
            self.lines.append(json.dumps(self.current))
        self.current = {"start": start, "end": end, "cpu": cpu, "tokens": tokens, "rows": rows, **self.phases}
        self.phases = {}
        self.steps += 1

    def sampled(self, start: float, end: float) -> None:
        if self.current is not None:
            self.current["sampler"] = end - start
            self.current["sampled"] = end

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def collected(self, seconds: float) -> None:
        """A pass of the cyclic garbage collector, wherever it fell in the step."""
        self.add("gc", seconds)
        self.phases["gc_longest"] = max(self.phases.get("gc_longest", 0.0), seconds)


def install() -> None:
    """Replaces ModelRunner.run_step by fixed logits and times the sampler and the phases (any tree with
    ModelRunner.run_step and a Sampler)."""
    import torch

    from fovea.runner import model_runner

    log = StepLog(os.environ["FOVEA_HOST_STEP"])
    fixed: list[torch.Tensor] = []
    collection_start = [0.0]

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            collection_start[0] = time.monotonic()
        else:
            log.collected(time.monotonic() - collection_start[0])

    gc.callbacks.append(on_collection)

    def run_step(self, step, mm_embeds, previous_tokens=None):
        if log.steps % FLUSH_EVERY == 0:
            log.flush()
        if not fixed:  # rows of random logits; each step takes a window that moves, so tokens vary
            vocab = int(os.environ.get("FOVEA_HOST_STEP_VOCAB") or self.config.model.text.vocab_size)
            fixed.append(torch.randn(768, vocab, generator=torch.Generator().manual_seed(0)).mul_(3).to(self.device))
        start, cpu = time.monotonic(), time.process_time()
        rows = len(step.logits_rows)
        offset = log.steps % 256
        logits = fixed[0][offset : offset + rows] if rows else None
        log.forward(start, cpu, len(step.token_ids), rows, time.monotonic())
        return logits, None

    model_runner.ModelRunner.run_step = run_step
    sampler_class = model_runner.Sampler
    sample = sampler_class.__call__

    def timed_sample(self, *args, **kwargs):
        start = time.monotonic()
        out = sample(self, *args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        log.sampled(start, time.monotonic())
        return out

    sampler_class.__call__ = timed_sample

    def timed(owner, name: str, phase: str) -> None:
        inner = getattr(owner, name, None)
        if inner is None:  # not in this tree
            return

        def wrapper(*args, **kwargs):
            start = time.monotonic()
            try:
                return inner(*args, **kwargs)
            finally:
                log.add(phase, time.monotonic() - start)

        setattr(owner, name, wrapper)

    from fovea.engine import engine, scheduler

    timed(scheduler.Scheduler, "schedule", "schedule")
    timed(model_runner, "build_step", "inputs")
    timed(engine.LLMEngine, "_record", "record")
    timed(engine.LLMEngine, "_report", "report")


# --------------------------------------------------------------------------------------------- one case


def prompts(batch: int, context: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(batch * 7919 + context)
    return [rng.integers(1000, 150000, context).tolist() for _ in range(batch)]


def engine_args(case: dict) -> dict:
    length = case["context"] + case["max_tokens"] + 16
    blocks = case["batch"] * -(-length // 16) + 8
    return dict(
        dtype="float32",
        max_model_len=length,
        max_num_seqs=max(case["batch"], 1),
        max_num_batched_tokens=8192,
        num_gpu_blocks_override=blocks,
        block_size=16,
        enable_prefix_caching=False,
    )


def params_for(case: dict, defaults):
    from fovea import SamplingParams
    from fovea.core.sampling_params import RequestOutputKind

    kind = RequestOutputKind.DELTA if case["stream"] else RequestOutputKind.FINAL_ONLY
    base = {
        "greedy": SamplingParams(temperature=0),
        "logprobs": SamplingParams(temperature=0, logprobs=5),  # an eval's: each token's five likeliest
    }.get(case["sampling"], defaults)
    return base.clone(max_tokens=case["max_tokens"], ignore_eos=True, output_kind=kind)


class CpuClock:
    """This process's CPU time, sampled every 5 ms with the monotonic clock the logs use."""

    def __init__(self):
        self.samples: list[tuple[float, float]] = []
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            self.samples.append((time.monotonic(), time.process_time()))
            time.sleep(0.005)

    def at(self, when: float) -> float:
        before = [cpu for t, cpu in self.samples if t <= when]
        return before[-1] if before else self.samples[0][1]


def run_one(case: dict) -> None:
    import torch

    torch.set_num_threads(1)
    ids = prompts(case["batch"], case["context"])
    clock = CpuClock()
    start = time.monotonic()
    if case["mode"] == "offline":
        from fovea import LLM

        llm = LLM(case["model"], **engine_args(case))
        params = params_for(case, llm.get_default_sampling_params())
        llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        llm.close()
    else:
        from fovea.frontend.async_llm import AsyncLLM

        llm = AsyncLLM.from_args(case["model"], **engine_args(case))
        params = params_for(case, llm.default_params)

        async def one(prompt):
            async for _ in llm.generate({"prompt_token_ids": prompt}, params):
                pass

        async def every():
            await asyncio.gather(*(one(p) for p in ids))

        asyncio.run(every())
        llm.shutdown()
    clock.running = False
    import fovea

    measured = {"samples": clock.samples, "wall_s": time.monotonic() - start, "fovea": fovea.__file__}
    Path(case["frontend_clock"]).write_text(json.dumps(measured))


# ----------------------------------------------------------------------------------------------- analysis


def summarize(case: dict, prefix: str) -> dict:
    logs = []
    for path in Path(prefix).parent.glob(Path(prefix).name + ".*.jsonl"):
        steps = [json.loads(line) for line in path.read_text().splitlines() if line]
        if steps:
            logs.append(steps)
    (steps,) = logs  # one engine process logged forwards
    front = json.loads(Path(case["frontend_clock"]).read_text())
    batch = case["batch"]
    decode = [i for i, s in enumerate(steps) if s["tokens"] == batch and s["rows"] == batch]
    window = [i for i in decode if i + 1 < len(steps) and i + 1 in decode][2:-2]
    if len(window) < 4:
        shapes = [(s["tokens"], s["rows"]) for s in steps]
        raise RuntimeError(f"only {len(window)} steps where every request decodes: raise --steps ({shapes})")
    gaps = [steps[i + 1]["start"] - steps[i]["sampled"] for i in window]
    walls = [steps[i + 1]["start"] - steps[i]["start"] for i in window]
    forward = [steps[i]["end"] - steps[i]["start"] for i in window]
    sampler = [steps[i]["sampler"] for i in window]
    first, last = window[0], window[-1] + 1
    count = last - first
    engine_cpu = (steps[last]["cpu"] - steps[first]["cpu"]) / count
    device = (sum(s["end"] - s["start"] + s["sampler"] for s in steps[first:last])) / count
    frontend_cpu = 0.0
    if case["mode"] == "served":  # the front end is another process: its own CPU clock over the same window
        samples = front["samples"]
        at = lambda when: max([cpu for t, cpu in samples if t <= when] or [samples[0][1]])  # noqa: E731
        frontend_cpu = (at(steps[last]["start"]) - at(steps[first]["start"])) / count
    phases = {}
    for name in ("schedule", "inputs", "record", "report"):
        values = [steps[i + 1].get(name, 0.0) for i in window]  # what ran before forward i + 1
        phases[name] = statistics.median(values) * 1e3
    critical = statistics.median(gaps) * 1e3
    phases["other"] = critical - sum(phases.values())
    # the garbage collector's passes, wherever they fell: a full one can stop a step for a long time, which the
    # median above does not show
    gc_seconds = [steps[i + 1].get("gc", 0.0) for i in window]
    return {
        **{k: case[k] for k in ("tree", "mode", "sampling", "batch", "context", "stream")},
        "steps": len(window),
        "step_ms": statistics.median(walls) * 1e3,
        "critical_path_ms": critical,
        "critical_path_p90_ms": sorted(gaps)[int(0.9 * (len(gaps) - 1))] * 1e3,
        "forward_ms": statistics.median(forward) * 1e3,
        "sampler_ms": statistics.median(sampler) * 1e3,
        "engine_cpu_ms": engine_cpu * 1e3,
        "frontend_cpu_ms": frontend_cpu * 1e3,
        "host_cpu_ms": (engine_cpu - device + frontend_cpu) * 1e3,
        "phases_ms": phases,
        "gc_ms_per_step": sum(gc_seconds) / len(window) * 1e3,
        "gc_longest_ms": max(steps[i + 1].get("gc_longest", 0.0) for i in window) * 1e3,
        "wall_s": front["wall_s"],
        "fovea": front["fovea"],
    }


def hook_dir(work: Path) -> Path:
    """A sitecustomize that installs the stub in every Python process started with FOVEA_HOST_STEP set."""
    hooks = work / "hook"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if os.environ.get('FOVEA_HOST_STEP'):\n"
        f"    sys.path.insert(0, {str(HERE)!r})\n"
        "    import host_step\n"
        "    host_step.install()\n"
    )
    return hooks


def run_case(case: dict, tree: Path, work: Path) -> dict:
    tag = f"{case['tree']}-{case['mode']}-{case['sampling']}-{case['batch']}x{case['context']}-{case['repeat']}"
    prefix = str(work / tag)
    case = dict(case, frontend_clock=prefix + ".frontend.json")
    env = dict(os.environ, FOVEA_HOST_STEP=prefix, PYTHONPATH=f"{hook_dir(work)}:{tree}", OMP_NUM_THREADS="1")
    env["FOVEA_HOST_STEP_VOCAB"] = str(case["vocab"] or "")
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(case)],
        env=env,
        cwd=str(work),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{tag} failed:\n{done.stderr[-3000:]}")
    return summarize(case, prefix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--baseline", help="another tree (a git archive of a commit) measured side by side")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--contexts", default="1000,8000")
    parser.add_argument("--modes", default="offline,served")
    parser.add_argument("--samplings", default="greedy,default")
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per case")
    parser.add_argument("--stream", action="store_true", help="served requests stream (DELTA outputs)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each case, the trees alternating")
    parser.add_argument("--vocab", type=int, help="logit columns the stub returns (default: the whole vocabulary)")
    parser.add_argument("--quick", action="store_true", help="a dry run: batch 2, context 64, 8 steps")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return run_one(json.loads(args.one))
    if not args.out:
        parser.error("--out is required")
    batches = [2] if args.quick else [int(b) for b in args.batches.split(",")]
    contexts = [64] if args.quick else [int(c) for c in args.contexts.split(",")]
    steps = 12 if args.quick else args.steps
    trees = [("current", ROOT)] + ([("baseline", Path(args.baseline).resolve())] if args.baseline else [])
    with tempfile.TemporaryDirectory(prefix="host-step-") as tmp:
        work = Path(tmp)
        from fovea.testing.tiny import write_tiny_checkpoint

        model = write_tiny_checkpoint(work / "tiny-3b", "tiny-3b", seed=0)
        results = []
        for mode in args.modes.split(","):
            for sampling in args.samplings.split(","):
                for batch in batches:
                    for context in contexts:
                        # served requests arrive while the first ones prefill, and so end that many steps apart
                        prefill_steps = -(-batch * context // 8192) + 2
                        runs = [(name, tree, repeat) for repeat in range(args.repeats) for name, tree in trees[::-1]]
                        for name, tree, repeat in runs:  # the baseline first, then this tree, and again
                            case = dict(tree=name, mode=mode, sampling=sampling, batch=batch, context=context,
                                        stream=args.stream, model=str(model), max_tokens=steps + 12 + prefill_steps,
                                        repeat=repeat, vocab=args.vocab)  # fmt: skip
                            try:
                                result = run_case(case, tree, work)
                            except RuntimeError as error:  # a case this workload cannot measure: noted, not fatal
                                results.append(dict(case, error=str(error)[:300]))
                                print(f"{name:8} {mode:7} {sampling:7} {batch:3}x{context:<5} {str(error)[:100]}")
                                continue
                            results.append(result)
                            print(
                                f"{name:8} {mode:7} {sampling:7} {batch:3}x{context:<5} step {result['step_ms']:7.2f}"
                                f" critical {result['critical_path_ms']:6.2f} sampler {result['sampler_ms']:6.2f}"
                                f" host cpu {result['host_cpu_ms']:6.2f} ms  "
                                + " ".join(f"{k} {v:.2f}" for k, v in result["phases_ms"].items())
                                + f"  gc {result['gc_ms_per_step']:.2f} (longest {result['gc_longest_ms']:.1f})",
                                flush=True,
                            )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    out = {
        "commit": commit.stdout.strip(),
        "baseline": args.baseline,
        "machine": f"{os.cpu_count()} CPUs, torch threads 1",
        "results": results,
    }
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
