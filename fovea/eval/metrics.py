"""Classification metrics over the task's labels: accuracy, balanced accuracy, macro precision / recall / F1 and
the confusion matrix. A missing (unparseable) answer counts as wrong: it is a prediction outside every class, so
it lowers recall of its true class and adds to no class's precision. Definitions follow scikit-learn's (a class
with no predictions has precision 0; macro averages are unweighted means over the labels).
"""

from __future__ import annotations

import numpy as np


def classification_metrics(targets: list[str], predictions: list[str | None], labels: list[str]) -> dict:
    index = {label: i for i, label in enumerate(labels)}
    missing = len(labels)  # an extra column for answers that matched no label
    confusion = np.zeros((len(labels), len(labels) + 1), dtype=int)
    for target, prediction in zip(targets, predictions, strict=True):
        confusion[index[target], index.get(prediction, missing)] += 1
    true_positives = np.diag(confusion[:, :missing]).astype(float)
    per_true = confusion.sum(axis=1).astype(float)
    per_predicted = confusion[:, :missing].sum(axis=0).astype(float)
    recall = np.divide(true_positives, per_true, out=np.zeros_like(true_positives), where=per_true > 0)
    precision = np.divide(true_positives, per_predicted, out=np.zeros_like(true_positives), where=per_predicted > 0)
    denominator = precision + recall
    f1 = np.divide(2 * precision * recall, denominator, out=np.zeros_like(denominator), where=denominator > 0)
    present = per_true > 0  # balanced accuracy averages recall over the classes that occur
    total = int(confusion.sum())
    return {
        "num_samples": total,
        "num_missing": int(confusion[:, missing].sum()),
        "accuracy": float(true_positives.sum() / total) if total else 0.0,
        "balanced_accuracy": float(recall[present].mean()) if present.any() else 0.0,
        "macro_precision": float(precision.mean()),
        "macro_recall": float(recall.mean()),
        "macro_f1": float(f1.mean()),
        "labels": labels,
        "confusion_matrix": confusion[:, :missing].tolist(),  # rows: targets, columns: predictions
        "missing_per_label": confusion[:, missing].tolist(),
    }
