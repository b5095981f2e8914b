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
    precision, recall, f1, _ = sklearn.precision_recall_fscore_support(
        targets, theirs_pred, labels=labels, average="macro", zero_division=0
    )
    assert ours["accuracy"] == pytest.approx(sklearn.accuracy_score(targets, theirs_pred))
    with warnings.catch_warnings():  # sklearn may note the <missing> class that never occurs in the targets
        warnings.simplefilter("ignore")
        balanced = sklearn.balanced_accuracy_score(targets, theirs_pred)
    assert ours["balanced_accuracy"] == pytest.approx(balanced)
    assert (ours["macro_precision"], ours["macro_recall"], ours["macro_f1"]) == pytest.approx((precision, recall, f1))
    assert ours["confusion_matrix"] == sklearn.confusion_matrix(targets, theirs_pred, labels=labels).tolist()
    assert ours["num_missing"] == sum(p is None for p in predictions) == sum(ours["missing_per_label"])
    never_predicted = classification_metrics(["a", "b"], ["a", "a"], ["a", "b", "c"])
    precision, recall, f1, _ = sklearn.precision_recall_fscore_support(
        ["a", "b"], ["a", "a"], labels=["a", "b", "c"], average="macro", zero_division=0
    )
    assert (
        never_predicted["macro_precision"],
        never_predicted["macro_recall"],
        never_predicted["macro_f1"],
    ) == pytest.approx((precision, recall, f1))


def make_image_folder(root, counts: dict[str, int]):
    from conftest import random_image

    for label, count in counts.items():
        (root / label).mkdir(parents=True)
        for i in range(count):
            random_image(56, 56, seed=hash((label, i)) % 1000).save(root / label / f"{i}.png")


def test_smallest_task_file_and_balanced_sampling(tmp_path):
    from fovea.eval.tasks import Task

    make_image_folder(tmp_path / "data", {"no": 5, "yes": 3})
    (tmp_path / "t.yaml").write_text(
        'name: t\ndataset: {type: image_folder, path: data}\nquestion: "Is there a tumour?"\noptions: ["no", "yes"]\n'
    )
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
    bad_files = [
        ("name: t\ndataset: {type: image_folder, path: data}\noptions: [a, b]\n", "missing.*question"),
        (
            'name: t\ndataset: {type: image_folder, path: data}\nquestion: q\noptions: ["a", "b"]\n',
            "label 'no' is not one of the options",
        ),
        ("name: t\ndataset: {path: data}\nquestion: q\noptions: [no, yes]\n", "unquoted yes/no"),
        ("name: t\ndataset: {path: data\n", "bad.yaml is not valid YAML"),
        (
            "name: t\ndataset: {path: data}\nquestion: q\noptions: [a, b]\nlabel_map: {no: a, yes: b}\n",
            "unquoted yes/no",
        ),
    ]
    for text, message in bad_files:
        (tmp_path / "bad.yaml").write_text(text)
        with pytest.raises(ValueError, match=message):
            Task.from_yaml(tmp_path / "bad.yaml").samples()
    (tmp_path / "ok.yaml").write_text(
        "name: t\ndataset: {path: data}\nquestion: q\noptions: [a, b]\nlabel_map: {'no': a, 'yes': b}\n"
    )
    assert [s.target for s in Task.from_yaml(tmp_path / "ok.yaml").samples()] == ["a"] * 5 + ["b"] * 3


def test_table_datasets_bytes_images_and_data_override(tmp_path, monkeypatch):
    import pyarrow
    import pyarrow.parquet
    from conftest import random_image

    from fovea.eval.tasks import Task

    pngs = []
    for i in range(4):
        random_image(56, 56, seed=i).save(tmp_path / f"{i}.png")
        pngs.append((tmp_path / f"{i}.png").read_bytes())
    (tmp_path / "d.jsonl").write_text(
        "\n".join(
            json.dumps(row)
            for row in [
                {"image": "0.png", "answer": "yes"},
                {"image": "1.png", "answer": "no"},
                {"image": "2.png", "answer": "b", "question": "Which?", "options": ["a", "b"]},
            ]
        )
        + "\n"
    )
    task = Task("t", {"type": "jsonl", "path": str(tmp_path / "d.jsonl")}, "Tumour?", ["no", "yes"])
    samples = task.samples()
    assert [(s.target, s.question, s.options) for s in samples] == [
        ("yes", "Tumour?", ["no", "yes"]),
        ("no", "Tumour?", ["no", "yes"]),
        ("b", "Which?", ["a", "b"]),
    ]
    assert samples[0].image == str(tmp_path / "0.png")  # relative to the file
    assert '{"answer": "a"}' in task.messages(samples[2])[0]["content"][1]["text"]
    (tmp_path / "d.csv").write_text("img,label\n3.png,1\n0.png,0\n")
    task = Task(
        "t",
        {"type": "csv", "path": str(tmp_path / "d.csv"), "image": "img", "answer": "label"},
        "Tumour?",
        ["no", "yes"],
        label_map={"0": "no", "1": "yes"},
    )
    assert [(s.target, s.image) for s in task.samples()] == [
        ("yes", str(tmp_path / "3.png")),
        ("no", str(tmp_path / "0.png")),
    ]
    # parquet as Hugging Face datasets writes it: image structs holding the bytes, boolean labels
    table = pyarrow.table(
        {"image": [{"bytes": raw, "path": None} for raw in pngs], "label": [False, True, True, False]}
    )
    pyarrow.parquet.write_table(table, tmp_path / "pcam.parquet")
    monkeypatch.delenv("PCAM_DIR", raising=False)
    shipped = Task.find("patch_camelyon")
    with pytest.raises(ValueError, match="unset environment variable.*--data"):
        shipped.samples()
    samples = shipped.with_data(tmp_path / "pcam.parquet").samples()
    assert [s.target for s in samples] == ["no", "yes", "yes", "no"] and samples[1].image == pngs[1]
    url = shipped.messages(samples[1], system_prompt="You are a pathologist.")
    assert url[0] == {"role": "system", "content": "You are a pathologist."}
    assert url[1]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
    monkeypatch.setenv("PCAM_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="nowhere does not exist"):
        Task.find("patch_camelyon").samples()
    pyarrow.parquet.write_table(pyarrow.table({"image": pngs[:2], "label": [0, 1]}), tmp_path / "raw.parquet")
    assert [s.image for s in Task.find("patch_camelyon").with_data(tmp_path / "raw.parquet").samples()] == pngs[:2]
    (tmp_path / "bad.jsonl").write_text('{"image": "0.png", "answer": "no"}\n{"image": "1.png"}\n')
    with pytest.raises(ValueError, match="row 2 needs the columns 'image' \\(or 'video'\\) and 'answer'"):
        Task("t", {"path": str(tmp_path / "bad.jsonl"), "type": "jsonl"}, "q", ["no", "yes"]).samples()
    with pytest.raises(ValueError, match="cannot tell the dataset type"):
        shipped.with_data(tmp_path / "0.png")
    with pytest.raises(ValueError, match="no task file 'nope'.*patch_camelyon"):
        Task.find("nope")


def test_limit_spreads_over_classes(tmp_path):
    from fovea.eval.tasks import Task

    make_image_folder(tmp_path / "data", {"a": 6, "b": 6, "c": 6})
    task = Task("t", {"type": "image_folder", "path": str(tmp_path / "data")}, "q", ["a", "b", "c"])
    assert [s.target for s in task.samples(limit=3)] == ["a", "b", "c"]
    assert len(task.samples(limit=100)) == 18


def test_model_registry_yaml_decorator_and_defaults(tmp_path, monkeypatch):
    from fovea.eval import registry

    monkeypatch.setattr(registry, "MODELS", dict(registry.MODELS))
    (tmp_path / "models.yaml").write_text(
        "models:\n  my-vlm:\n    path: /ckpt/my-vlm\n    max_pixels: 401408\n"
        "    engine_kwargs: {max_num_seqs: 8, mm_processor_kwargs: {min_pixels: 3136}}\n"
        "    system_prompt: You are a pathologist.\n    max_tokens: 16\n"
    )
    registry.load_registry(tmp_path / "models.yaml")
    entry = registry.find_model("my-vlm")
    assert (entry.path, entry.system_prompt, entry.max_tokens, entry.temperature) == (
        "/ckpt/my-vlm",
        "You are a pathologist.",
        16,
        0.0,
    )
    assert entry.llm_kwargs() == {"max_num_seqs": 8, "mm_processor_kwargs": {"min_pixels": 3136, "max_pixels": 401408}}
    (tmp_path / "models.py").write_text(
        "from fovea.eval.registry import register_model\n\n"
        "@register_model('other')\ndef other():\n"
        "    return {'path': '/ckpt/other', 'tensor_parallel_size': 2}\n"
    )
    registry.load_registry(tmp_path / "models.py")
    assert registry.find_model("other").llm_kwargs() == {"tensor_parallel_size": 2}
    plain = registry.find_model("/some/dir/ckpt")
    assert (plain.name, plain.path, plain.llm_kwargs(), plain.temperature) == ("ckpt", "/some/dir/ckpt", {}, 0.0)
    assert entry.sampling_params() == {"repetition_penalty": 1.0, "temperature": 0.0, "max_tokens": 16}
    (tmp_path / "bad.yaml").write_text("models:\n  x: {path: /a, max_pixel: 3}\n")
    with pytest.raises(ValueError, match="unknown keys \\['max_pixel'\\]"):
        registry.load_registry(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text("models:\n  x: {path: /a, sampling: {top_p: 0.9, topk: 3}}\n")
    with pytest.raises(ValueError, match="unknown sampling parameters \\['topk'\\]"):
        registry.load_registry(tmp_path / "bad.yaml")


def test_builtin_qwen_entries_fit_their_gpus():
    from conftest import QWEN_SHAPES, published_param_count

    from fovea.eval.registry import MODELS

    for size in QWEN_SHAPES:
        weights_gb = 2 * published_param_count(size) / 1e9  # bf16
        fewest = next(tp for tp in (1, 2, 4, 8) if weights_gb / tp <= 0.6 * 80)
        entry = MODELS[f"qwen2.5-vl-{size}"]
        assert entry.tensor_parallel_size == fewest, (size, weights_gb)
        assert entry.path == f"Qwen/Qwen2.5-VL-{size.upper()}-Instruct" and entry.temperature == 0
        assert entry.llm_kwargs()["mm_processor_kwargs"]["max_pixels"] == 1280 * 28 * 28


def test_builtin_qwen3_entries_fit_their_gpus():
    """Every size by the same rule as Qwen2.5-VL, from the released shapes' exact parameter counts (the MoE's
    experts split over the ranks too)."""
    from fovea.config.model import ModelConfig
    from fovea.eval.registry import MODELS
    from fovea.plan import count_parameters
    from fovea.testing.tiny_qwen3_vl import hf_config

    for name, path in (("8b", "8B"), ("32b", "32B"), ("30b-a3b", "30B-A3B")):
        config = ModelConfig.from_dict(hf_config(f"qwen3-vl-{name}").to_dict())  # model_type only, as from_dict
        weights_gb = 2 * count_parameters(config) / 1e9
        moe = config.text.moe is not None
        fewest = next(tp for tp in (1, 2, 4, 8) if weights_gb / tp <= 0.6 * 80)
        entry = MODELS[f"qwen3-vl-{name}"]
        assert entry.tensor_parallel_size == fewest and weights_gb < 80, (name, weights_gb)
        assert entry.path == f"Qwen/Qwen3-VL-{path}-Instruct"
        assert entry.llm_kwargs()["mm_processor_kwargs"]["max_pixels"] == 1280 * 32 * 32
        assert config.architecture == (
            "Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"
        )


def test_in_process_run_writes_predictions_results_and_report(tiny_dirs, tmp_path):
    from fovea.eval.backends import InProcessBackend
    from fovea.eval.registry import ModelEntry
    from fovea.eval.runner import evaluate
    from fovea.eval.tasks import Task

    make_image_folder(tmp_path / "data", {"no": 3, "yes": 2})
    task = Task(
        "t", {"type": "image_folder", "path": str(tmp_path / "data")}, "Is there a tumour?", ["no", "yes"], runs=2
    )
    entry = ModelEntry("tiny", str(tiny_dirs["tiny-3b"]), max_tokens=6)
    results = evaluate(InProcessBackend(entry, dtype="float32", max_model_len=1024), task, entry, tmp_path / "out")
    predictions = [json.loads(line) for line in (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 10 and [p["target"] for p in predictions[:5]] == ["no"] * 3 + ["yes"] * 2
    for run in results["runs"]:  # counts add up: every sample is in the matrix or missing
        assert sum(map(sum, run["confusion_matrix"])) + run["num_missing"] == run["num_samples"] == 5
    assert predictions[:5] == [
        {**p, "run": 0, "latency": q["latency"]} for p, q in zip(predictions[5:], predictions[:5])
    ]
    assert all(p["answer"] == extract_answer(p["output"], ["no", "yes"]) for p in predictions)
    assert all(p["output_tokens"] == 6 and p["prompt_tokens"] > 4 and p["latency"] > 0 for p in predictions)
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["summary"]["accuracy"]["std"] == 0.0  # greedy: both runs answer the same
    assert saved["timings"]["output_tokens_per_s"] > 0 and saved["backend"] == "in-process"
    assert "| no |" in (tmp_path / "out" / "report.md").read_text()
    assert (tmp_path / "out" / "confusion_matrix.png").read_bytes()[:4] == b"\x89PNG"


def test_builtin_internvl_entries_fit_their_gpus():
    """InternVL3.5's released shapes (Qwen3-8B, -14B and -32B decoders; InternViT-300M, and InternViT-6B under the
    38B) by the Qwen rule; the 38B's tower (25 heads, its q/k norm over all of them) cannot be split over its ranks:
    the engine runs it whole on each."""
    from fovea.config.engine import tower_split_obstacles
    from fovea.config.model import ModelConfig
    from fovea.eval.registry import MODELS
    from fovea.plan import count_parameters

    vit_300m = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
                "attention_bias": True}  # fmt: skip
    vit_6b = {"hidden_size": 3200, "num_hidden_layers": 45, "num_attention_heads": 25, "intermediate_size": 12800,
              "use_qk_norm": True, "norm_type": "rms_norm"}  # fmt: skip
    shapes = {  # hidden, layers, heads, MLP width, tower
        "8b": (4096, 36, 32, 12288, vit_300m),
        "14b": (5120, 40, 40, 17408, vit_300m),
        "38b": (5120, 64, 64, 25600, vit_6b),
    }
    for name, (hidden, layers, heads, mlp, tower) in shapes.items():
        text = {"model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": layers, "head_dim": 128,
                "num_attention_heads": heads, "num_key_value_heads": 8, "intermediate_size": mlp, "vocab_size": 151936}  # fmt: skip
        config = ModelConfig.from_dict(
            {"architectures": ["InternVLForConditionalGeneration"], "text_config": text, "vision_config": tower}
        )
        weights_gb = 2 * count_parameters(config) / 1e9
        entry = MODELS[f"internvl3.5-{name}"]
        assert entry.tensor_parallel_size == next(tp for tp in (1, 2, 4, 8) if weights_gb / tp <= 0.6 * 80), name
        assert entry.path == f"OpenGVLab/InternVL3_5-{name.upper()}-HF"
        assert bool(tower_split_obstacles(config.vision, entry.tensor_parallel_size)) == (name == "38b")
    # the GPT-OSS one, as OpenGVLab uploads it (GPT-OSS-20B's shapes): 21.2B parameters, as its model card says
    gpt_oss = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": 2880,
               "num_hidden_layers": 24, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
               "intermediate_size": 2880, "num_local_experts": 32, "vocab_size": 201088}  # fmt: skip
    tower = {**vit_300m, "qkv_bias": True, "image_size": 448, "patch_size": 14, "hidden_act": "gelu"}
    config = ModelConfig.from_dict(
        {"architectures": ["InternVLChatModel"], "llm_config": gpt_oss, "vision_config": tower, "ps_version": "v2"}
    )
    assert round(count_parameters(config) / 1e9, 1) == 21.2
    entry = MODELS["internvl3.5-gpt-oss-20b-a4b"]
    assert entry.tensor_parallel_size == 1 and 2 * count_parameters(config) / 1e9 <= 0.6 * 80
