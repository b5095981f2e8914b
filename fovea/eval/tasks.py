"""Evaluation tasks from YAML: where the samples come from, how each is asked, and what counts as its answer.

The smallest task file:
    name: t
    dataset: {type: image_folder, path: DIR}     # one sub-folder per class; labels = sub-folder names
    question: "Does this image show metastatic breast tissue?"
    options: ["no", "yes"]
Everything else has a default (see Task). jsonl / csv datasets give one sample per row: an image path (relative
to the file) in `image`, the answer in `answer`, and optionally a per-row `question` and `options`.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".gif"}
DEFAULT_INSTRUCTION = 'Answer with JSON only, for example {{"answer": "{first}"}}, choosing one of: {options}.'


@dataclass
class Sample:
    id: str
    image: str  # a path or URL
    target: str
    question: str
    options: list[str]


@dataclass
class Task:
    name: str
    dataset: dict
    question: str
    options: list[str]
    instruction: str = DEFAULT_INSTRUCTION
    image_position: str = "before"  # the image before or after the text
    label_map: dict[str, str] = field(default_factory=dict)  # dataset label -> option, where they differ
    synonyms: dict[str, list[str]] | None = None  # option -> other words meaning it (None: the yes/no defaults)
    samples_per_class: int | None = None  # balanced sampling
    seed: int = 0
    runs: int = 1  # repeated runs (sampled differently when seeded sampling applies) for mean and std
    max_missing: float = 1.0  # fraction of unparseable answers above which the run fails

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Task":
        import yaml

        raw = yaml.safe_load(Path(path).read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a task file must be a mapping")
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{path}: unknown task keys {sorted(unknown)}")
        missing = {"name", "dataset", "question", "options"} - set(raw)
        if missing:
            raise ValueError(f"{path}: task is missing {sorted(missing)}")
        task = cls(**raw)
        dataset_path = Path(task.dataset.get("path", ""))
        if not dataset_path.is_absolute():  # relative to the task file
            task.dataset = {**task.dataset, "path": str(Path(path).parent / dataset_path)}
        task.validate()
        return task

    def validate(self) -> None:
        if self.image_position not in ("before", "after"):
            raise ValueError(f"image_position must be before or after, got {self.image_position!r}")
        if len(self.options) < 2 or len(set(self.options)) != len(self.options):
            raise ValueError("options must hold at least two distinct answers")
        if self.dataset.get("type") not in ("image_folder", "jsonl", "csv"):
            raise ValueError(f"dataset type must be image_folder, jsonl or csv, got {self.dataset.get('type')!r}")

    def prompt(self, sample: Sample) -> str:
        instruction = self.instruction.format(first=sample.options[0], options=", ".join(sample.options))
        return f"{sample.question}\n{instruction}"

    def messages(self, sample: Sample) -> list[dict]:
        image = {"type": "image_url", "image_url": {"url": _as_url(sample.image)}}
        text = {"type": "text", "text": self.prompt(sample)}
        return [{"role": "user", "content": [image, text] if self.image_position == "before" else [text, image]}]

    def samples(self, run: int = 0) -> list[Sample]:
        kind, root = self.dataset["type"], Path(self.dataset["path"])
        rows = _image_folder(root) if kind == "image_folder" else _table(root, kind)
        samples = []
        for i, (image, label, question, options) in enumerate(rows):
            target = self.label_map.get(label, label)
            options = options or self.options
            if target not in options:
                raise ValueError(f"{root}: label {label!r} is not one of the options {options} (use label_map)")
            samples.append(Sample(f"{i:06d}", image, target, question or self.question, options))
        if self.samples_per_class:
            rng = np.random.default_rng(self.seed + run)
            chosen = []
            for option in self.options:
                members = [s for s in samples if s.target == option]
                take = min(self.samples_per_class, len(members))
                chosen += [members[j] for j in sorted(rng.choice(len(members), size=take, replace=False))]
            samples = sorted(chosen, key=lambda s: s.id)
        return samples


def _as_url(image: str) -> str:
    return image if "://" in image or image.startswith("data:") else Path(image).resolve().as_uri()


def _image_folder(root: Path):
    if not root.is_dir():
        raise ValueError(f"image folder {root} does not exist")
    for label_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for image in sorted(p for p in label_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
            yield str(image), label_dir.name, None, None


def _table(path: Path, kind: str):
    if not path.is_file():
        raise ValueError(f"dataset file {path} does not exist")
    if kind == "jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    for number, row in enumerate(rows, start=1):
        if "image" not in row or "answer" not in row:
            raise ValueError(f"{path}:{number}: each row needs 'image' and 'answer'")
        options = row.get("options")
        if isinstance(options, str):
            options = json.loads(options)
        image = row["image"] if "://" in row["image"] else str(path.parent / row["image"])
        yield image, str(row["answer"]), row.get("question"), options
