"""`fovea eval` building blocks: answer extraction on real-looking outputs, metrics equal to scikit-learn's."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from fovea.eval.answers import extract_answer
from fovea.eval.metrics import classification_metrics

BINARY = ["no", "yes"]
OUTPUTS = [
    ('{"answer": "yes"}', "yes"),
    ('{"answer": "No"}', "no"),
    ('```json\n{"answer": "yes"}\n```', "yes"),
    ('Sure! Here is my answer:\n```json\n{\n  "answer": "no"\n}\n```\nThe tissue looks normal.', "no"),
    ('{"label": "yes"}', "yes"),  # one field, another name
    ('{"answer": "maybe"} Actually, yes.', "yes"),  # JSON with no option, then a bare word
    ("yes", "yes"),
    ("No.", "no"),
    ("  YES  ", "yes"),
    ("The answer is yes, there is metastatic tissue.", "yes"),
    ("true", "yes"),  # synonyms
    ("Negative for metastasis.", "no"),
    ("Yes and no.", None),  # two options: ambiguous
    ("I cannot tell from this image.", None),
    ("", None),
    ('{"answer": }', None),  # broken JSON, no option words
    ("<|im_end|>", None),
]


@pytest.mark.parametrize("text, expected", OUTPUTS)
def test_answer_extraction(text, expected):
    assert extract_answer(text, BINARY) == expected


def test_answer_extraction_with_several_options():
    options = ["adipose", "lymphocytes", "tumor epithelium"]
    assert extract_answer('{"answer": "Tumor epithelium"}', options) == "tumor epithelium"
    assert extract_answer("It looks like tumor epithelium to me.", options) == "tumor epithelium"
    assert extract_answer("adipose", options, synonyms={}) == "adipose"
    assert extract_answer("fat cells", options, synonyms={"adipose": ["fat cells"]}) == "adipose"


def test_metrics_equal_scikit_learn():
    from sklearn import metrics as sklearn
    rng = np.random.default_rng(0)
    labels = ["a", "b", "c"]
    targets = [labels[i] for i in rng.integers(0, 3, 200)]
    predictions = [None if rng.random() < 0.1 else labels[i] for i in rng.integers(0, 3, 200)]
    predictions[:40] = targets[:40]  # better than chance
    ours = classification_metrics(targets, predictions, labels)
    theirs_pred = ["<missing>" if p is None else p for p in predictions]
    precision, recall, f1, _ = sklearn.precision_recall_fscore_support(targets, theirs_pred, labels=labels,
                                                                        average="macro", zero_division=0)
    assert ours["accuracy"] == pytest.approx(sklearn.accuracy_score(targets, theirs_pred))
    with warnings.catch_warnings():  # sklearn may note the <missing> class that never occurs in the targets
        warnings.simplefilter("ignore")
        balanced = sklearn.balanced_accuracy_score(targets, theirs_pred)
    assert ours["balanced_accuracy"] == pytest.approx(balanced)
    assert (ours["macro_precision"], ours["macro_recall"], ours["macro_f1"]) == pytest.approx((precision, recall, f1))
    assert ours["confusion_matrix"] == sklearn.confusion_matrix(targets, theirs_pred, labels=labels).tolist()
    assert ours["num_missing"] == sum(p is None for p in predictions) == sum(ours["missing_per_label"])
    never_predicted = classification_metrics(["a", "b"], ["a", "a"], ["a", "b", "c"])
    precision, recall, f1, _ = sklearn.precision_recall_fscore_support(["a", "b"], ["a", "a"], labels=["a", "b", "c"],
                                                                        average="macro", zero_division=0)
    assert (never_predicted["macro_precision"], never_predicted["macro_recall"],
            never_predicted["macro_f1"]) == pytest.approx((precision, recall, f1))


def make_image_folder(root, counts: dict[str, int]):
    from conftest import random_image

    for label, count in counts.items():
        (root / label).mkdir(parents=True)
        for i in range(count):
            random_image(56, 56, seed=hash((label, i)) % 1000).save(root / label / f"{i}.png")


def test_smallest_task_file_and_balanced_sampling(tmp_path):
    from fovea.eval.tasks import Task

    make_image_folder(tmp_path / "data", {"no": 5, "yes": 3})
    (tmp_path / "t.yaml").write_text('name: t\ndataset: {type: image_folder, path: data}\n'
                                     'question: "Is there a tumour?"\noptions: ["no", "yes"]\n')
    task = Task.from_yaml(tmp_path / "t.yaml")
    samples = task.samples()
    assert [s.target for s in samples] == ["no"] * 5 + ["yes"] * 3 and len({s.id for s in samples}) == 8
    content = task.messages(samples[0])[0]["content"]
    assert content[0]["type"] == "image_url" and content[0]["image_url"]["url"].startswith("file://")
    assert content[1]["text"].startswith("Is there a tumour?\n") and '{"answer": "no"}' in content[1]["text"]
    task.samples_per_class, task.image_position = 2, "after"
    first, again, other = task.samples(0), task.samples(0), task.samples(1)
    assert [s.target for s in first] == ["no", "no", "yes", "yes"] and first == again and first != other
    assert task.messages(first[0])[0]["content"][1]["type"] == "image_url"
    (tmp_path / "bad.yaml").write_text("name: t\ndataset: {type: image_folder, path: data}\noptions: [a, b]\n")
    with pytest.raises(ValueError, match="missing.*question"):
        Task.from_yaml(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text('name: t\ndataset: {type: image_folder, path: data}\nquestion: q\n'
                                       'options: ["a", "b"]\n')
    with pytest.raises(ValueError, match="label 'no' is not one of the options"):
        Task.from_yaml(tmp_path / "bad.yaml").samples()


def test_in_process_run_writes_predictions_results_and_report(tiny_dirs, tmp_path):
    from fovea import LLM
    from fovea.eval.runner import evaluate
    from fovea.eval.tasks import Task

    make_image_folder(tmp_path / "data", {"no": 3, "yes": 2})
    task = Task("t", {"type": "image_folder", "path": str(tmp_path / "data")}, "Is there a tumour?", ["no", "yes"],
                runs=2)
    llm = LLM(str(tiny_dirs["tiny-3b"]), dtype="float32", max_model_len=1024)
    results = evaluate(llm, task, "tiny", tmp_path / "out", max_tokens=6)
    predictions = [json.loads(line) for line in (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 10 and [p["target"] for p in predictions[:5]] == ["no"] * 3 + ["yes"] * 2
    for run in results["runs"]:  # counts add up: every sample is in the matrix or missing
        assert sum(map(sum, run["confusion_matrix"])) + run["num_missing"] == run["num_samples"] == 5
    assert predictions[:5] == [{**p, "run": 0, "latency": q["latency"]} for p, q in zip(predictions[5:], predictions[:5])]
    assert all(p["answer"] == extract_answer(p["output"], ["no", "yes"]) for p in predictions)
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["summary"]["accuracy"]["std"] == 0.0  # greedy: both runs answer the same
    assert "| no |" in (tmp_path / "out" / "report.md").read_text()
