"""Runs a task on a model in process (fovea's `LLM`) and writes what it found.

For each sample: the task's chat messages -> greedy answer -> extracted option (or missing). Outputs in
--output-dir: predictions.jsonl (id, target, raw output, parsed answer, latency), results.json (metrics per run,
mean and std over runs, model, task, fovea version, timings, tokens/s) and report.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from fovea.eval.answers import extract_answer
from fovea.eval.metrics import classification_metrics
from fovea.eval.tasks import Sample, Task

SUMMARY_METRICS = ("accuracy", "balanced_accuracy", "macro_f1", "macro_precision", "macro_recall")


def predict_in_process(llm, task: Task, samples: list[Sample], max_tokens: int = 32) -> list[dict]:
    from fovea import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    outputs = llm.chat([task.messages(s) for s in samples], params)
    elapsed = time.perf_counter() - start
    return [{"id": s.id, "target": s.target, "output": o.outputs[0].text,
             "answer": extract_answer(o.outputs[0].text, s.options, task.synonyms),
             "latency": (o.metrics.finished_time - o.metrics.arrival_time) if o.metrics else elapsed / len(samples),
             "prompt_tokens": len(o.prompt_token_ids), "output_tokens": len(o.outputs[0].token_ids)}
            for s, o in zip(samples, outputs)]


def evaluate(llm, task: Task, model_name: str, output_dir: str | Path, limit: int | None = None,
             max_tokens: int = 32) -> dict:
    from fovea import __version__

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    runs, all_predictions = [], []
    start = time.perf_counter()
    for run in range(task.runs):
        samples = task.samples(run)[:limit]
        predictions = predict_in_process(llm, task, samples, max_tokens)
        metrics = classification_metrics([p["target"] for p in predictions], [p["answer"] for p in predictions],
                                         task.options)
        if metrics["num_missing"] > task.max_missing * len(predictions):
            raise ValueError(f"run {run}: {metrics['num_missing']} of {len(predictions)} answers could not be "
                             f"parsed (max_missing is {task.max_missing:.0%})")
        runs.append(metrics)
        all_predictions += [{"run": run, **p} for p in predictions]
    elapsed = time.perf_counter() - start
    output_tokens = sum(p["output_tokens"] for p in all_predictions)
    summary = {name: {"mean": float(np.mean([r[name] for r in runs])), "std": float(np.std([r[name] for r in runs]))}
               for name in SUMMARY_METRICS}
    results = {"task": task.name, "model": model_name, "fovea_version": __version__, "runs": runs,
               "summary": summary, "num_predictions": len(all_predictions), "elapsed_s": elapsed,
               "output_tokens_per_s": output_tokens / elapsed if elapsed else 0.0}
    with (output_dir / "predictions.jsonl").open("w") as f:
        for prediction in all_predictions:
            f.write(json.dumps(prediction) + "\n")
    (output_dir / "results.json").write_text(json.dumps(results, indent=2))
    (output_dir / "report.md").write_text(report(results))
    return results


def report(results: dict) -> str:
    lines = [f"# {results['task']} on {results['model']}", "", "| metric | mean | std |", "| --- | --- | --- |"]
    lines += [f"| {name} | {v['mean']:.4f} | {v['std']:.4f} |" for name, v in results["summary"].items()]
    last = results["runs"][-1]
    lines += ["", f"Confusion matrix (last run; rows: target, columns: prediction; {last['num_missing']} missing):",
              "", "| target \\ prediction | " + " | ".join(last["labels"]) + " | missing |",
              "| --- |" + " --- |" * (len(last["labels"]) + 1)]
    lines += [f"| {label} | " + " | ".join(map(str, row)) + f" | {missing} |"
              for label, row, missing in zip(last["labels"], last["confusion_matrix"], last["missing_per_label"])]
    return "\n".join(lines) + "\n"
