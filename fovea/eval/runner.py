"""Runs a task on a model through a backend and writes what it found.

For each run: the run's samples -> chat messages -> one completion each -> the extracted option (or missing) ->
metrics. Outputs in the output directory: predictions.jsonl (run, id, target, raw output, parsed answer, latency,
tokens, and the error where a sample could not be answered), results.json (metrics per run, mean and std over
runs, model, task, backend, fovea version, timings, tokens/s) and report.md with confusion_matrix.png.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from fovea.eval.answers import extract_answer
from fovea.eval.metrics import classification_metrics
from fovea.eval.registry import ModelEntry
from fovea.eval.report import write_report
from fovea.eval.tasks import Task

SUMMARY_METRICS = ("accuracy", "balanced_accuracy", "macro_f1", "macro_precision", "macro_recall")


def evaluate(
    backend, task: Task, entry: ModelEntry, output_dir: str | Path, limit: int | None = None, progress: bool = True
) -> dict:
    """`backend`: InProcessBackend, OpenAIBackend or RayBackend. Returns results.json's content; runs with more
    missing answers than the task's max_missing allows are listed in its `failed_runs`."""
    from fovea import __version__

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    params = entry.sampling_params()
    if task.structured_answer:  # vLLM's request field too, so a --base-url vLLM server honours it
        params["structured_outputs"] = {"json": task.answer_schema()}
    runs, predictions = [], []
    for run in range(task.runs):
        samples = task.samples(run, limit)
        if not samples:
            raise ValueError(f"task {task.name} has no samples")
        conversations = [task.messages(s, entry.system_prompt) for s in samples]
        start = time.perf_counter()
        desc = f"{task.name} run {run + 1}/{task.runs}" if progress else None
        completions = backend.complete(conversations, params, desc)
        elapsed = time.perf_counter() - start
        run_predictions = [
            {
                "run": run,
                "id": s.id,
                "target": s.target,
                "output": c.text,
                "answer": extract_answer(c.text, s.options, task.synonyms),
                "latency": c.latency,
                "prompt_tokens": c.prompt_tokens,
                "output_tokens": c.output_tokens,
                **({"error": c.error} if c.error else {}),
            }
            for s, c in zip(samples, completions)
        ]
        labels = task.options + sorted({s.target for s in samples} - set(task.options))  # rows may bring options
        metrics = classification_metrics(
            [p["target"] for p in run_predictions], [p["answer"] for p in run_predictions], labels
        )
        runs.append(
            {**metrics, "num_errors": sum("error" in p for p in run_predictions), **timings(run_predictions, elapsed)}
        )
        predictions += run_predictions
    results = {
        "task": task.name,
        "model": entry.name,
        "model_path": entry.path,
        "backend": backend.description,
        "fovea_version": __version__,
        "num_predictions": len(predictions),
        "runs": runs,
        "summary": {
            name: {"mean": float(np.mean(values)), "std": float(np.std(values))}
            for name in SUMMARY_METRICS
            for values in [[r[name] for r in runs]]
        },
        "timings": timings(predictions, sum(r["elapsed_s"] for r in runs)),
        "failed_runs": [i for i, r in enumerate(runs) if r["num_missing"] > task.max_missing * r["num_samples"]],
        "max_missing": task.max_missing,
        "structured_answer": task.structured_answer,
    }
    with (output_dir / "predictions.jsonl").open("w") as f:
        f.writelines(json.dumps(p) + "\n" for p in predictions)
    (output_dir / "results.json").write_text(json.dumps(results, indent=2))
    write_report(results, output_dir)
    return results


def timings(predictions: list[dict], elapsed: float) -> dict:
    latencies = [p["latency"] for p in predictions]
    per_s = (lambda n: n / elapsed) if elapsed > 0 else (lambda n: 0.0)
    return {
        "elapsed_s": elapsed,
        "samples_per_s": per_s(len(predictions)),
        "prompt_tokens_per_s": per_s(sum(p["prompt_tokens"] for p in predictions)),
        "output_tokens_per_s": per_s(sum(p["output_tokens"] for p in predictions)),
        "latency_mean_s": float(np.mean(latencies)),
        "latency_p50_s": float(np.percentile(latencies, 50)),
        "latency_p99_s": float(np.percentile(latencies, 99)),
    }
