"""What a person reads after `fovea eval`: the summary table printed at the end, and report.md with the
confusion matrix drawn as confusion_matrix.png (matplotlib, from the eval extra; without it the table stays)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def summary_table(results: dict) -> str:
    runs = results["runs"]
    missing = sum(r["num_missing"] for r in runs)
    timing = results["timings"]
    lines = [
        f"{results['task']} on {results['model']} ({results['backend']}): {len(runs)} run(s), "
        f"{results['num_predictions']} predictions",
        "",
        f"{'metric':<20}{'mean':>10}{'std':>10}",
    ]
    lines += [f"{name:<20}{v['mean']:>10.4f}{v['std']:>10.4f}" for name, v in results["summary"].items()]
    lines += [
        "",
        f"{'missing answers':<20}{missing:>10} of {results['num_predictions']}"
        + (" (answers under the options' JSON schema)" if results.get("structured_answer") else "")
        + (f" ({sum(r['num_errors'] for r in runs)} failed requests)" if any(r["num_errors"] for r in runs) else ""),
        f"{'elapsed':<20}{timing['elapsed_s']:>10.1f} s  ({timing['samples_per_s']:.2f} samples/s, "
        f"{timing['output_tokens_per_s']:.1f} output tokens/s)",
        f"{'latency p50 / p99':<20}{timing['latency_p50_s']:>10.3f} / {timing['latency_p99_s']:.3f} s",
    ]
    return "\n".join(lines)


def write_report(results: dict, output_dir: Path) -> None:
    last = results["runs"][-1]
    picture = _draw_confusion(last, output_dir / "confusion_matrix.png")
    lines = [
        f"# {results['task']} on {results['model']}",
        "",
        f"Backend: {results['backend']}; fovea {results['fovea_version']}; {len(results['runs'])} run(s).",
        "",
        "| metric | mean | std |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {name} | {v['mean']:.4f} | {v['std']:.4f} |" for name, v in results["summary"].items()]
    lines += ["", f"Confusion matrix (last run; rows: target, columns: prediction; {last['num_missing']} missing):", ""]
    if picture:
        lines += ["![confusion matrix](confusion_matrix.png)", ""]
    lines += [
        "| target \\ prediction | " + " | ".join(last["labels"]) + " | missing |",
        "| --- |" + " --- |" * (len(last["labels"]) + 1),
    ]
    lines += [
        f"| {label} | " + " | ".join(map(str, row)) + f" | {missing} |"
        for label, row, missing in zip(last["labels"], last["confusion_matrix"], last["missing_per_label"])
    ]
    if results["failed_runs"]:
        lines += [
            "",
            f"**Failed runs** {results['failed_runs']}: more than {results['max_missing']:.0%} of the "
            "answers could not be parsed.",
        ]
    (output_dir / "report.md").write_text("\n".join(lines) + "\n")


def _draw_confusion(run: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = run["labels"] + ["missing"]
    counts = np.column_stack([np.array(run["confusion_matrix"]), run["missing_per_label"]])
    size = 1.2 + 0.8 * len(labels)
    figure, axes = plt.subplots(figsize=(size + 1, size))
    image = axes.imshow(counts, cmap="Blues")
    axes.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    axes.set_yticks(range(len(run["labels"])), run["labels"])
    axes.set_xlabel("prediction")
    axes.set_ylabel("target")
    for (row, column), count in np.ndenumerate(counts):
        axes.text(
            column, row, str(count), ha="center", va="center", color="white" if count > counts.max() / 2 else "black"
        )
    figure.colorbar(image, ax=axes)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True
