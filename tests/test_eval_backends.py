"""`fovea eval` end to end with the tiny model: in process, against a live server (--base-url) and over Ray with
two CPU replicas, on the same generated dataset, must give the same greedy predictions."""

from __future__ import annotations

import json

import pytest
from conftest import random_image
from serving import running_server

from fovea.cli import main
from fovea.eval.answers import extract_answer
from fovea.eval.backends import OpenAIBackend
from fovea.eval.registry import ModelEntry

SAME_FIELDS = ("run", "id", "target", "output", "answer", "prompt_tokens", "output_tokens")
ENGINE = ["--dtype", "float32", "--max-model-len", "1024"]


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    """Two classes of differently sized images, and one file in `yes` that is not an image."""
    root = tmp_path_factory.mktemp("eval")
    sizes = [(56, 56), (84, 56), (112, 84), (56, 112)]
    for label in ("no", "yes"):
        (root / "data" / label).mkdir(parents=True)
        for i, (width, height) in enumerate(sizes[: 4 if label == "no" else 3]):
            random_image(width, height, seed=10 * (label == "yes") + i).save(root / "data" / label / f"{i}.png")
    (root / "data" / "yes" / "broken.png").write_bytes(b"not an image at all")
    (root / "task.yaml").write_text(
        "name: tumour\ndataset: {type: image_folder, path: data}\n"
        'question: "Is there a tumour?"\noptions: ["no", "yes"]\nruns: 2\n'
    )
    return root / "task.yaml"


@pytest.fixture(scope="module")
def served(tiny_dirs):
    """The tiny model served under another name (the one model a server serves is the one meant): the base URL."""
    with running_server(tiny_dirs["tiny-3b"], *ENGINE, "--served-model-name", "tiny") as (base, _):
        yield base


def read_outputs(out):
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    return predictions, json.loads((out / "results.json").read_text())


def test_in_process_server_and_ray_give_identical_predictions(tiny_dirs, task_file, tmp_path, capsys, served):
    model = str(tiny_dirs["tiny-3b"])
    common = ["eval", "--model", model, "--task", str(task_file), "--max-tokens", "6"]
    main([*common, *ENGINE, "--output-dir", str(tmp_path / "in-process")])
    assert "tumour on tiny-3b (in-process): 2 run(s), 16 predictions" in capsys.readouterr().out
    main([*common, "--base-url", f"{served}/v1", "--concurrency", "3", "--output-dir", str(tmp_path / "server")])
    with pytest.raises(ValueError, match=r"the server serves \['tiny'\], not 'other/model'"):
        OpenAIBackend(f"{served}/v1", ModelEntry("other", "other/model"))  # never the one served instead
    main([*common, *ENGINE, "--ray", "--num-replicas", "2", "--output-dir", str(tmp_path / "ray")])

    expected, results = read_outputs(tmp_path / "in-process")
    assert len(expected) == 16 and [p["id"] for p in expected] == [f"{i:06d}" for i in range(8)] * 2
    assert [p["target"] for p in expected[:8]] == ["no"] * 4 + ["yes"] * 4
    broken = [p for p in expected if "error" in p]
    assert [p["id"] for p in broken] == ["000007", "000007"]  # yes/broken.png, the only failure
    assert all(p["answer"] is None and p["output"] == "" for p in broken)
    answered = [p for p in expected if "error" not in p]
    assert all(p["output_tokens"] == 6 and p["answer"] == extract_answer(p["output"], ["no", "yes"]) for p in answered)
    assert len({p["prompt_tokens"] for p in answered}) == 4  # each image size its own number of image tokens
    for run in results["runs"]:  # every sample counted once: in the matrix or missing
        assert run["num_samples"] == 8 and run["num_errors"] == 1
        assert sum(map(sum, run["confusion_matrix"])) + run["num_missing"] == 8
        assert run["num_missing"] == sum(p["answer"] is None for p in expected[:8])

    for backend, description in (("server", "(tiny)"), ("ray", "ray: 2 replicas x 1 CPU")):
        predictions, other = read_outputs(tmp_path / backend)
        assert description in other["backend"]
        assert [{k: p.get(k) for k in SAME_FIELDS} for p in predictions] == [
            {k: p.get(k) for k in SAME_FIELDS} for p in expected
        ], backend
        assert ["error" in p for p in predictions] == ["error" in p for p in expected]
        assert other["runs"] == [
            {**run, **{k: other_run[k] for k in run if k.endswith("_s")}}
            for run, other_run in zip(results["runs"], other["runs"])
        ]
        assert (tmp_path / backend / "report.md").is_file() and (tmp_path / backend / "confusion_matrix.png").is_file()


def test_shipped_patch_camelyon_task_on_a_parquet_copy(tiny_dirs, tmp_path, capsys):
    import pyarrow
    import pyarrow.parquet

    images = []
    for i in range(10):
        random_image(96, 96, seed=i).save(tmp_path / "patch.png")
        images.append({"bytes": (tmp_path / "patch.png").read_bytes(), "path": None})
    labels = [i % 2 == 1 for i in range(10)]
    pyarrow.parquet.write_table(pyarrow.table({"image": images, "label": labels}), tmp_path / "test.parquet")
    with pytest.raises(SystemExit, match="more than 5% missing answers"):  # a random model cannot answer in JSON
        main(
            [
                "eval",
                "--model",
                str(tiny_dirs["tiny-3b"]),
                "--task",
                "patch_camelyon",
                *ENGINE,
                "--max-tokens",
                "4",
                "--data",
                str(tmp_path / "test.parquet"),
                "--limit",
                "4",
                "--output-dir",
                str(tmp_path / "out"),
            ]
        )
    predictions, results = read_outputs(tmp_path / "out")
    assert [p["id"] for p in predictions] == ["000000", "000003", "000006", "000009"]  # spread over the rows
    assert [p["target"] for p in predictions] == ["no", "yes", "no", "yes"]
    assert results["failed_runs"] == [0] and "Failed runs" in (tmp_path / "out" / "report.md").read_text()
    assert "missing answers" in capsys.readouterr().out


def test_eval_command_errors_name_the_problem(tiny_dirs, task_file):
    from serving import free_port

    with pytest.raises(ValueError, match="cannot reach the server at http://127.0.0.1:"):
        OpenAIBackend(f"http://127.0.0.1:{free_port()}/v1", ModelEntry("m", "m"))
    for argv, message in (
        (["--task", str(task_file)], "--model and --task are required"),
        (["--model", "m", "--task", "nope"], "no task file 'nope'"),
        (["--model", "m", "--task", str(task_file), "--ray", "--base-url", "http://x"], "two different backends"),
        (["--model", "m", "--task", str(task_file), "--runs", "0"], "runs and samples_per_class"),
    ):
        with pytest.raises(SystemExit, match=message):
            main(["eval", *argv])


def test_tensor_parallel_registry_entry_in_process_and_on_ray(tiny_dirs, task_file, tmp_path, capsys, monkeypatch):
    """A registry entry with tensor_parallel_size 2 (as the 32B and 72B ones have) runs in process and as a Ray
    replica whose ranks start inside it, with the single-rank predictions."""
    from fovea.eval import registry

    monkeypatch.setattr(registry, "MODELS", dict(registry.MODELS))
    (tmp_path / "models.yaml").write_text(
        f"models:\n  tiny-tp2:\n    path: {tiny_dirs['tiny-3b']}\n    tensor_parallel_size: 2\n"
    )
    common = ["eval", "--task", str(task_file), "--max-tokens", "6", *ENGINE, "--limit", "4"]
    main([*common, "--model", str(tiny_dirs["tiny-3b"]), "--output-dir", str(tmp_path / "tp1")])
    main(
        [
            *common,
            "--registry",
            str(tmp_path / "models.yaml"),
            "--model",
            "tiny-tp2",
            "--output-dir",
            str(tmp_path / "tp2"),
        ]
    )
    main(
        [
            *common,
            "--registry",
            str(tmp_path / "models.yaml"),
            "--model",
            "tiny-tp2",
            "--ray",
            "--output-dir",
            str(tmp_path / "ray-tp2"),
        ]
    )
    capsys.readouterr()
    expected, _ = read_outputs(tmp_path / "tp1")
    for run in ("tp2", "ray-tp2"):
        predictions, results = read_outputs(tmp_path / run)
        assert [{k: p.get(k) for k in SAME_FIELDS} for p in predictions] == [
            {k: p.get(k) for k in SAME_FIELDS} for p in expected
        ], run
    assert "ray: 1 replicas x" in results["backend"]


def test_structured_answer_leaves_only_failed_requests_missing(tiny_dirs, task_file, tmp_path, capsys):
    """The random model never writes {"answer": ...} by itself; under the options' JSON schema every answered
    sample parses (the broken image stays an error)."""
    model = str(tiny_dirs["tiny-3b"])
    common = ["eval", "--model", model, "--task", str(task_file), "--max-tokens", "24", "--runs", "1", *ENGINE]
    main([*common, "--output-dir", str(tmp_path / "free")])
    main([*common, "--structured-answer", "--output-dir", str(tmp_path / "structured")])
    printed = capsys.readouterr().out
    free, free_results = read_outputs(tmp_path / "free")
    structured, results = read_outputs(tmp_path / "structured")
    assert free_results["runs"][0]["num_missing"] == 8 and not free_results["structured_answer"]
    assert results["structured_answer"] and results["runs"][0]["num_missing"] == 1  # only the broken image
    assert all(json.loads(p["output"])["answer"] in ("no", "yes") for p in structured if "error" not in p)
    assert "(answers under the options' JSON schema)" in printed


def test_video_samples_in_process_and_against_a_server(tiny_dirs, tmp_path, capsys, served):
    """A jsonl dataset mixing video rows (files next to it), an image row and a video that does not decode."""
    import numpy as np
    from conftest import video_file

    from fovea.config.video import VideoOptions, frame_size

    data = tmp_path / "data"
    data.mkdir()
    rows = []
    for i, (frames, label) in enumerate(((8, "no"), (12, "yes"))):  # 2 s and 3 s at 4 fps: 4 and 6 frames kept
        clip = np.random.default_rng(i).integers(0, 256, (frames, 56, 84, 3), dtype=np.uint8)
        (data / f"{i}.mkv").write_bytes(video_file(clip, 4))
        rows.append({"video": f"{i}.mkv", "answer": label})
    random_image(56, 56).save(data / "still.png")
    (data / "broken.mp4").write_bytes(b"not a video")
    rows += [{"image": "still.png", "answer": "no"}, {"video": "broken.mp4", "answer": "yes"}]
    (data / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = tmp_path / "task.yaml"
    task.write_text(
        'name: clips\ndataset: {path: data/rows.jsonl}\nquestion: "Is it moving?"\noptions: ["no", "yes"]\n'
    )
    model = str(tiny_dirs["tiny-3b"])
    common = ["eval", "--model", model, "--task", str(task), "--max-tokens", "4"]
    main([*common, *ENGINE, "--output-dir", str(tmp_path / "in-process")])
    main([*common, "--base-url", f"{served}/v1", "--output-dir", str(tmp_path / "server")])
    capsys.readouterr()

    expected, _ = read_outputs(tmp_path / "in-process")
    from_server, _ = read_outputs(tmp_path / "server")
    same = [{k: p.get(k) for k in SAME_FIELDS} for p in expected]
    assert [{k: p.get(k) for k in SAME_FIELDS} for p in from_server] == same
    assert ["error" in p for p in expected] == [False, False, False, True]
    assert "could not be read" in expected[3]["error"] and "could not be read" in from_server[3]["error"]
    sizes = [frame_size(56, 84, kept, VideoOptions()) for kept in (4, 6)]  # the published sizes (test_video.py)
    video_tokens = [kept // 2 * h * w // 28**2 for kept, (h, w) in zip((4, 6), sizes)]
    image_tokens = 4  # 56 x 56: 4 x 4 patches, merged 2 x 2
    assert [p["prompt_tokens"] - expected[2]["prompt_tokens"] for p in expected[:2]] == [
        tokens - image_tokens for tokens in video_tokens
    ]
