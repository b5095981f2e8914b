"""Evaluation tasks from YAML: where the samples come from, how each is asked, and what counts as its answer.

The smallest task file:
    name: t
    dataset: {type: image_folder, path: DIR}     # one sub-folder per class; labels = sub-folder names
    question: "Does this image show metastatic breast tissue?"
    options: ["no", "yes"]
Everything else has a default (see Task); the dataset sources are described in fovea/eval/datasets.py. A dataset
path may use ~ and $VARIABLES and is relative to the task file. Shipped tasks live in fovea/eval/task_files/ and
are named by their file's stem (`--task patch_camelyon`).
"""

from __future__ import annotations

import base64
import io
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from fovea.eval.datasets import DATASET_TYPES, guess_type, read_rows

SHIPPED_TASKS = Path(__file__).parent / "task_files"
DEFAULT_INSTRUCTION = 'Answer with JSON only, for example {{"answer": "{first}"}}, choosing one of: {options}.'


@dataclass
class Sample:
    id: str
    image: str | bytes  # a path, a URL, or encoded image bytes (a video file's, when `video`)
    target: str
    question: str
    options: list[str]
    video: bool = False


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
    # the answer generated under a JSON schema whose "answer" is one of the options (structured outputs): no
    # missing answers, at the price of forcing a choice; `fovea eval --structured-answer` turns it on too
    structured_answer: bool = False
    _samples: list[Sample] | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Task:
        import yaml

        try:
            raw = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as exc:
            raise ValueError(f"{path} is not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a task file must be a mapping")
        known = {f.name for f in fields(cls) if f.init}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{path}: unknown task keys {sorted(unknown)}")
        missing = {"name", "dataset", "question", "options"} - set(raw)
        if missing:
            raise ValueError(f"{path}: task is missing {sorted(missing)}")
        task = cls(**raw)
        if not isinstance(task.dataset, dict) or "path" not in task.dataset:
            raise ValueError(f"{path}: dataset needs a path")
        dataset_path = os.path.expandvars(os.path.expanduser(str(task.dataset["path"])))
        if "$" not in dataset_path:  # an unset variable is reported when the data is read (--data may replace it)
            dataset_path = str(Path(path).parent / dataset_path)  # an absolute path stays as it is
        task.dataset = {**task.dataset, "path": dataset_path}
        task.validate()
        return task

    @classmethod
    def find(cls, name_or_path: str) -> Task:
        """A task file's path, or the name of a shipped task."""
        path = Path(name_or_path)
        if path.is_file():
            return cls.from_yaml(path)
        shipped = SHIPPED_TASKS / f"{name_or_path}.yaml"
        if shipped.is_file():
            return cls.from_yaml(shipped)
        names = sorted(p.stem for p in SHIPPED_TASKS.glob("*.yaml"))
        raise ValueError(f"no task file {name_or_path!r} and no shipped task of that name (shipped: {names})")

    def answer_schema(self) -> dict:
        """{"answer": one of the options}: what the default instruction asks for, as a JSON schema."""
        return {
            "type": "object",
            "properties": {"answer": {"enum": list(self.options)}},
            "required": ["answer"],
            "additionalProperties": False,
        }

    def with_data(self, path: str | Path) -> Task:
        """The same task on another copy of its data (`--data`): a class folder or a .jsonl/.csv/.parquet file."""
        return replace(self, dataset={**self.dataset, "path": str(path), "type": guess_type(path)})

    def validate(self) -> None:
        if self.image_position not in ("before", "after"):
            raise ValueError(f"image_position must be before or after, got {self.image_position!r}")
        if any(isinstance(o, bool) for o in [*self.options, *self.label_map, *self.label_map.values()]):
            raise ValueError(
                "options and label_map hold booleans: YAML reads unquoted yes/no/true/false as such; "
                'quote them ("no", "yes")'
            )
        self.options = [str(o) for o in self.options]
        self.label_map = {str(k): str(v) for k, v in self.label_map.items()}  # labels are read as strings
        if len(self.options) < 2 or len(set(self.options)) != len(self.options):
            raise ValueError("options must hold at least two distinct answers")
        if self.dataset.get("type", "image_folder") not in DATASET_TYPES:
            raise ValueError(f"dataset type must be one of {', '.join(DATASET_TYPES)}, got {self.dataset['type']!r}")
        if not 0 <= self.max_missing <= 1:
            raise ValueError(f"max_missing is a fraction between 0 and 1, got {self.max_missing}")
        if self.runs < 1 or (self.samples_per_class is not None and self.samples_per_class < 1):
            raise ValueError("runs and samples_per_class must be at least 1")

    def prompt(self, sample: Sample) -> str:
        instruction = self.instruction.format(first=sample.options[0], options=", ".join(sample.options))
        return f"{sample.question}\n{instruction}"

    def messages(self, sample: Sample, system_prompt: str | None = None) -> list[dict]:
        kind = "video_url" if sample.video else "image_url"
        image = {"type": kind, kind: {"url": image_url(sample.image, "video" if sample.video else "image")}}
        text = {"type": "text", "text": self.prompt(sample)}
        user = {"role": "user", "content": [image, text] if self.image_position == "before" else [text, image]}
        return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [user]

    def samples(self, run: int = 0, limit: int | None = None) -> list[Sample]:
        """The samples of one run, in dataset order: all, or `samples_per_class` of each class drawn with seed +
        run; then, with `limit`, that many spread evenly over them (so every class still shows up)."""
        samples = self._all_samples()
        if self.samples_per_class:
            rng = np.random.default_rng(self.seed + run)
            chosen = []
            for option in self.options:
                members = [s for s in samples if s.target == option]
                take = min(self.samples_per_class, len(members))
                chosen += [members[j] for j in sorted(rng.choice(len(members), size=take, replace=False))]
            samples = sorted(chosen, key=lambda s: s.id)
        if limit is not None and limit < len(samples):
            samples = [samples[i] for i in np.linspace(0, len(samples) - 1, limit).round().astype(int)]
        return samples

    def _all_samples(self) -> list[Sample]:
        if self._samples is None:
            self._samples = []
            for i, row in enumerate(read_rows(self.dataset)):
                target = self.label_map.get(row.label, row.label)
                options = row.options or self.options
                if target not in options:
                    raise ValueError(
                        f"{self.dataset['path']}: label {row.label!r} is not one of the options "
                        f"{options} (map it with label_map)"
                    )
                self._samples.append(
                    Sample(f"{i:06d}", row.image, target, row.question or self.question, options, row.video)
                )
        return self._samples


def image_url(image: str | bytes, kind: str = "image") -> str:
    if isinstance(image, bytes):
        return data_url(image, kind)
    return image if "://" in image or image.startswith("data:") else Path(image).resolve().as_uri()


def data_url(raw: bytes, kind: str = "image") -> str:
    from PIL import Image

    if kind == "video":  # the server reads the container from the bytes, not from the media type
        return "data:video/mp4;base64," + base64.b64encode(raw).decode()
    try:
        kind = (Image.open(io.BytesIO(raw)).format or "png").lower()
    except Exception:  # undecodable: the engine reports it with the sample
        kind = "png"
    return f"data:image/{kind};base64," + base64.b64encode(raw).decode()
