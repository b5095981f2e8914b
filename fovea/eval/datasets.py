"""Reading a task's dataset: rows of (image or video, label, question, options), in a fixed order.

Sources (the task's `dataset.type`, or guessed from the path):
- image_folder: one sub-folder per class; the label is the sub-folder's name. Video files (.mp4, .mkv, .webm,
  .mov, .avi) there are video samples.
- jsonl / csv / parquet: one row per sample. The image column holds a path (relative to the file), a URL, raw
  image bytes, or a Hugging Face `datasets` image struct ({"bytes": ..., "path": ...}); a row may instead fill
  the video column (the same forms; a video file). The answer column holds the label. Optional question and
  options columns override the task's per row. Column names default to image, video, answer, question and
  options and can be renamed in the task (`dataset: {image: img, answer: label}`).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".gif"}
VIDEO_SUFFIXES = {".mp4", ".mkv", ".webm", ".mov", ".avi"}
TABLE_TYPES = ("jsonl", "csv", "parquet")
DATASET_TYPES = ("image_folder",) + TABLE_TYPES


@dataclass
class Row:
    image: str | bytes  # a path, a URL, or encoded image bytes (a video file's, when `video`)
    label: str
    question: str | None = None
    options: list[str] | None = None
    video: bool = False


def guess_type(path: str | Path) -> str:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"dataset {path} does not exist")
    if path.is_dir():
        return "image_folder"
    suffix = path.suffix.lower().lstrip(".")
    if suffix in TABLE_TYPES:
        return suffix
    raise ValueError(f"cannot tell the dataset type of {path}: give a folder or a .jsonl, .csv or .parquet file")


def read_rows(dataset: dict) -> list[Row]:
    if "$" in str(dataset["path"]):
        raise ValueError(
            f"dataset path {dataset['path']} names an unset environment variable: set it, or give the data with --data"
        )
    kind, path = dataset.get("type") or guess_type(dataset["path"]), Path(dataset["path"])
    if kind not in DATASET_TYPES:
        raise ValueError(f"dataset type must be one of {', '.join(DATASET_TYPES)}, got {kind!r}")
    if kind == "image_folder":
        return _image_folder(path)
    if not path.is_file():
        raise ValueError(f"dataset file {path} does not exist")
    columns = {name: dataset.get(name, name) for name in ("image", "video", "answer", "question", "options")}
    return [_row(record, columns, path, number) for number, record in enumerate(_records(path, kind), start=1)]


def _image_folder(root: Path) -> list[Row]:
    if not root.is_dir():
        raise ValueError(f"image folder {root} does not exist")
    rows = [
        Row(str(item), label_dir.name, video=item.suffix.lower() in VIDEO_SUFFIXES)
        for label_dir in sorted(p for p in root.iterdir() if p.is_dir())
        for item in sorted(p for p in label_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES | VIDEO_SUFFIXES)
    ]
    if not rows:
        raise ValueError(f"image folder {root} holds no images or videos in class sub-folders")
    return rows


def _records(path: Path, kind: str) -> list[dict]:
    if kind == "jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if kind == "csv":
        with path.open(newline="") as f:
            return list(csv.DictReader(f))
    try:
        import pyarrow.parquet
    except ImportError:
        raise ValueError("parquet datasets need pyarrow: pip install 'fovea[eval]'") from None
    return pyarrow.parquet.read_table(path).to_pylist()


def _row(record: dict, columns: dict[str, str], path: Path, number: int) -> Row:
    video = bool(record.get(columns["video"]))
    media_column = columns["video" if video else "image"]
    if media_column not in record or columns["answer"] not in record:
        raise ValueError(
            f"{path}: row {number} needs the columns {columns['image']!r} (or {columns['video']!r}) "
            f"and {columns['answer']!r}"
        )
    media = record[media_column]
    if isinstance(media, dict):  # a Hugging Face datasets Image: the bytes, or else a path
        media = media.get("bytes") or media.get("path")
    if isinstance(media, str) and "://" not in media and not media.startswith("data:"):
        media = str(path.parent / media)
    if not isinstance(media, (str, bytes)) or not media:
        kind = "video" if video else "image"
        raise ValueError(f"{path}: row {number} has no {kind} (a path, URL or {kind} bytes)")
    options = record.get(columns["options"])
    if isinstance(options, str):
        options = json.loads(options)
    return Row(media, str(record[columns["answer"]]), record.get(columns["question"]) or None, options or None, video)
