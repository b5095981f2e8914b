"""vLLM's `--dataset-name hf` workloads: a dataset on the Hugging Face hub, or a local copy of its parquet files,
read a shard at a time until enough rows make requests (vLLM streams it through `datasets`; here pyarrow reads
the shards huggingface_hub fetches). Rows come as a seeded streaming shuffle gives them: the split's shards in a
seeded order, and the rows of each shuffled 1,000 at a time; with `--no-stream` (vLLM's: the split loaded whole),
every shard is fetched first and all the split's rows are shuffled together.

Which dataset it is (`--hf-name`, else the path) says how a row becomes a request, as in vLLM:
- VisionArena (lmarena-ai/VisionArena-Chat, lmarena-ai/vision-arena-bench-v0.1): the first turn's text and the
  row's first image; MMStar (Lin-Chen/MMStar): the question without its options, and its image; `--hf-output-len`
  tokens out, 128 unless given;
- conversations in ShareGPT's form (lmms-lab/LLaVA-OneVision-Data, Aeala/ShareGPT_Vicuna_unfiltered): the first
  message, with the row's image where it has one, and the reply's length out unless `--hf-output-len` says;
  ShareGPT's filters apply (bench/datasets.py).
Images are sent as JPEG data URLs of their RGB pixels; input lengths count the text only (vLLM's).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Iterator
from pathlib import Path

from PIL import Image

from fovea.bench.datasets import BenchRequest, conversation_request, in_order

IMAGE_QUESTIONS = {  # (the prompt, the image) of a row
    "lmarena-ai/VisionArena-Chat": lambda row: (row["conversation"][0][0]["content"], row["images"][0]),
    "lmarena-ai/vision-arena-bench-v0.1": lambda row: (row["turns"][0][0]["content"], row["images"][0]),
    "Lin-Chen/MMStar": lambda row: (row.get("question", "").split("Options:", 1)[0].strip(), row["image"]),
}
CONVERSATIONS = ("lmms-lab/LLaVA-OneVision-Data", "Aeala/ShareGPT_Vicuna_unfiltered")
IMAGE_QUESTION_OUTPUT_LEN = 128
SHUFFLE_ROWS = 1000


def hf_requests(
    path: str,
    tokenizer,
    num_prompts: int,
    name: str | None = None,
    split: str = "train",
    subset: str | None = None,
    output_len: int | None = None,
    seed: int | None = 0,
    whole: bool = False,
) -> list[BenchRequest]:
    """`seed` None (--disable-shuffle): the shards and their rows in order; `whole` (--no-stream): one shuffle of
    the whole split."""
    name = name or path
    if name in IMAGE_QUESTIONS:
        make = image_question(IMAGE_QUESTIONS[name], tokenizer, output_len or IMAGE_QUESTION_OUTPUT_LEN)
    elif name in CONVERSATIONS:
        make = conversation(tokenizer, output_len)
    else:
        known = ", ".join([*IMAGE_QUESTIONS, *CONVERSATIONS])
        raise ValueError(
            f"--dataset-name hf does not know {name!r}; it reads {known} (--hf-name: which of them a local copy is)"
        )
    requests = []
    for row in (whole_split_rows if whole else rows)(path, split, subset, seed):
        request = make(row)
        if request is not None:
            requests.append(request)
            if len(requests) == num_prompts:
                return requests
    if not requests:
        raise ValueError(f"{path} (split {split!r}) gave no requests")
    return requests


def image_question(read: Callable, tokenizer, output_len: int) -> Callable[[dict], BenchRequest]:
    def make(row: dict) -> BenchRequest:
        prompt, image = read(row)
        length = len(tokenizer.encode(prompt, add_special_tokens=False))
        return BenchRequest(prompt, length, output_len, [jpeg_data_url(image)])

    return make


def conversation(tokenizer, output_len: int | None) -> Callable[[dict], BenchRequest | None]:
    def make(row: dict) -> BenchRequest | None:
        turns = row.get("conversations") or []
        if len(turns) < 2:
            return None
        images = [jpeg_data_url(row["image"])] if row.get("image") is not None else []
        return conversation_request(turns[0]["value"], turns[1]["value"], tokenizer, output_len, images)

    return make


def jpeg_data_url(image) -> str:
    """An image as datasets stores it in parquet ({"bytes", "path"}), raw bytes, or PIL's."""
    if isinstance(image, dict):
        image = image.get("bytes") or Path(image["path"]).read_bytes()
    if isinstance(image, bytes):
        image = Image.open(io.BytesIO(image))
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def rows(path: str, split: str, subset: str | None, seed: int | None) -> Iterator[dict]:
    import pyarrow.parquet

    shards, fetch = split_shards(path, split, subset)
    for index in in_order(len(shards), seed):
        batches = pyarrow.parquet.ParquetFile(fetch(shards[index])).iter_batches(batch_size=SHUFFLE_ROWS)
        for number, batch in enumerate(batches):
            found = batch.to_pylist()
            yield from (found[i] for i in in_order(len(found), None if seed is None else [seed, index, number]))


def whole_split_rows(path: str, split: str, subset: str | None, seed: int | None) -> Iterator[dict]:
    """Every row of the split in one seeded order (every shard fetched first; each read whole, memory-mapped, when
    the order first reaches it)."""
    import pyarrow.parquet

    shards, fetch = split_shards(path, split, subset)
    files = [fetch(shard) for shard in shards]
    places = [
        (f, r) for f, file in enumerate(files) for r in range(pyarrow.parquet.ParquetFile(file).metadata.num_rows)
    ]
    tables = {}
    for index in in_order(len(places), seed):
        f, r = places[index]
        if f not in tables:
            tables[f] = pyarrow.parquet.read_table(files[f], memory_map=True)
        yield tables[f].slice(r, 1).to_pylist()[0]


def split_shards(path: str, split: str, subset: str | None) -> tuple[list[str], Callable[[str], str]]:
    """The split's parquet files (under the subset's folder where one is named) and how to get each: a local file
    or folder as it is, else a hub dataset's files, each downloaded when it is read."""
    local = Path(path)
    if local.is_file():
        return [str(local)], str
    if local.is_dir():
        files = sorted(str(p.relative_to(local)) for p in local.rglob("*.parquet"))
        fetch = lambda name: str(local / name)  # noqa: E731
    else:
        from huggingface_hub import HfApi, hf_hub_download

        files = sorted(HfApi().list_repo_files(path, repo_type="dataset"))
        fetch = lambda name: hf_hub_download(path, name, repo_type="dataset")  # noqa: E731
    chosen = [name for name in files if name.endswith(".parquet") and in_split(name, split, subset)]
    if not chosen:
        raise ValueError(f"{path} has no parquet files of split {split!r}" + (f" in {subset!r}" if subset else ""))
    return chosen, fetch


def in_split(name: str, split: str, subset: str | None) -> bool:
    """The hub's parquet layouts: data/train-00000-of-00002.parquet, train/0000.parquet, SUBSET/train-*.parquet."""
    *folders, file = name.split("/")
    return (split in folders or file.startswith((f"{split}-", f"{split}."))) and (subset is None or subset in folders)
