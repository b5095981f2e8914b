"""Benchmark workloads, built before the clock starts: random, random-mm, prefix_repetition, sharegpt and jsonl
(vLLM's custom), as vLLM builds them (hf: bench/hf_datasets.py).

Random prompts are token ids drawn from the vocabulary without special tokens, decoded to text and adjusted until
the text re-tokenizes to the asked length, so the server sees that many prompt tokens. random-mm adds
random-noise JPEG images and, for buckets of more than one frame, random-noise MP4 videos at 30 fps (both sent as
data URLs); as in vLLM, its input token counts cover the text only.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int
    images: list[str] = field(default_factory=list)  # data URLs or http(s)/file URLs
    videos: list[str] = field(default_factory=list)


def length_range(mean: int, range_ratio: float, flag: str = "--random-range-ratio") -> tuple[int, int]:
    """[floor(mean * (1 - ratio)), ceil(mean * (1 + ratio))], as vLLM samples lengths and item counts."""
    if not 0 <= range_ratio <= 1:
        raise ValueError(f"{flag} must be in [0, 1], got {range_ratio}")
    return math.floor(mean * (1 - range_ratio)), math.ceil(mean * (1 + range_ratio))


class PromptMaker:
    """Text that re-tokenizes to an exact number of tokens."""

    def __init__(self, tokenizer, rng: np.random.Generator):
        self.tokenizer = tokenizer
        self.rng = rng
        special = set(tokenizer.all_special_ids)
        self.ordinary = np.array([t for t in range(len(tokenizer)) if t not in special])

    def random_ids(self, count: int) -> list[int]:
        return self.rng.choice(self.ordinary, size=count).tolist()

    def text(self, ids: list[int], target: int) -> tuple[str, int]:
        """Decodes `ids`, then trims or extends until the text encodes to `target` tokens (or close, after a
        few tries: merges across the cut can shift the count by a token)."""
        for _ in range(10):
            text = self.tokenizer.decode(ids)
            actual = self.tokenizer.encode(text, add_special_tokens=False)
            if len(actual) == target:
                return text, target
            ids = actual[:target] if len(actual) > target else actual + self.random_ids(target - len(actual))
        return text, len(self.tokenizer.encode(text, add_special_tokens=False))


def random_requests(
    tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng)
    prefix = maker.random_ids(prefix_len)
    low, high = length_range(input_len, range_ratio)
    input_lens = rng.integers(max(low, 1), max(high, 1) + 1, size=num_prompts)
    low, high = length_range(output_len, range_ratio)
    output_lens = rng.integers(max(low, 1), max(high, 1) + 1, size=num_prompts)
    requests = []
    for n_in, n_out in zip(input_lens, output_lens):
        text, length = maker.text(prefix + maker.random_ids(int(n_in)), prefix_len + int(n_in))
        requests.append(BenchRequest(text, length, int(n_out)))
    return requests


def prefix_repetition_requests(
    tokenizer,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
    shuffle: bool = True,
) -> list[BenchRequest]:
    """vLLM's prefix_repetition: `num_prefixes` random prefixes, each followed by num_prompts // num_prefixes
    random suffixes (lengths as random's: the text re-tokenizes to them), the requests shuffled unless not."""
    per_prefix = num_prompts // num_prefixes if num_prefixes > 0 else 0
    if per_prefix == 0:
        raise ValueError(f"--num-prompts ({num_prompts}) must be at least --prefix-repetition-num-prefixes")
    rng = np.random.default_rng(seed)
    maker, requests = PromptMaker(tokenizer, rng), []
    for _ in range(num_prefixes):
        prefix, _ = maker.text(maker.random_ids(prefix_len), prefix_len)
        for _ in range(per_prefix):
            suffix, _ = maker.text(maker.random_ids(suffix_len), suffix_len)
            length = len(tokenizer.encode(prefix + suffix, add_special_tokens=False))
            requests.append(BenchRequest(prefix + suffix, length, output_len))
    return [requests[i] for i in rng.permutation(len(requests))] if shuffle else requests


def parse_bucket_config(text: str) -> dict[tuple[int, int, int], float]:
    """'{(256,256,1):0.5,(720,1280,16):0.5}' -> {(height, width, frames): probability}: frames 1 is an image,
    more a video; buckets of weight 0 are dropped and the rest normalized."""
    try:
        raw = ast.literal_eval(text) if isinstance(text, str) else text
    except (ValueError, SyntaxError):
        raise ValueError(f"--random-mm-bucket-config is not a dict literal: {text!r}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError("--random-mm-bucket-config must be a non-empty dict {(height, width, frames): weight}")
    for key, weight in raw.items():
        if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(v, int) and v > 0 for v in key)):
            raise ValueError(f"bucket {key!r} must be (height, width, frames) of positive integers")
        if not weight >= 0:
            raise ValueError(f"bucket {key!r} has a negative weight")
    total = sum(raw.values())
    if total <= 0:
        raise ValueError("--random-mm-bucket-config weights sum to zero")
    return {key: weight / total for key, weight in raw.items() if weight > 0}


def modality(bucket: tuple[int, int, int]) -> str:
    return "image" if bucket[2] == 1 else "video"


def noise_jpeg_url(height: int, width: int, rng: np.random.Generator) -> str:
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def noise_mp4_url(height: int, width: int, frames: int, rng: np.random.Generator) -> str:
    """Random frames at 30 fps in MP4 (MPEG-4 part 2, the codec vLLM's bench writes with OpenCV's mp4v)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=30)
        stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
        for pixels in rng.integers(0, 256, size=(frames, height, width, 3), dtype=np.uint8):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return "data:video/mp4;base64," + base64.b64encode(buffer.getvalue()).decode()


DEFAULT_MM_LIMITS = {"image": 255, "video": 1}  # vLLM's bench defaults


def random_mm_requests(
    tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    base_items: int = 1,
    items_range_ratio: float = 0.0,
    limits: dict[str, int] | None = None,
    buckets: dict | None = None,
    seed: int = 0,
) -> list[BenchRequest]:
    """Each request draws its item count from the range, then items by bucket weight; a modality at its limit
    leaves the draw (its buckets removed, the rest renormalized), as vLLM samples."""
    requests = random_requests(tokenizer, num_prompts, input_len, output_len, range_ratio, prefix_len, seed)
    rng = np.random.default_rng(seed + 1)
    buckets = buckets or {(256, 256, 1): 0.5, (720, 1280, 1): 0.5}
    limits = {**DEFAULT_MM_LIMITS, **(limits or {})}
    used = {modality(bucket) for bucket in buckets}
    low, high = length_range(base_items, items_range_ratio, "--random-mm-num-mm-items-range-ratio")
    high = min(high, sum(limits[kind] for kind in used))
    if max(low, 0) > high:
        raise ValueError(f"--random-mm-base-items-per-request {base_items} is over the limits {limits}")
    for request in requests:
        count, taken, open_buckets = int(rng.integers(max(low, 0), high + 1)), dict.fromkeys(used, 0), dict(buckets)
        while sum(taken.values()) < count and open_buckets:
            shapes = list(open_buckets)
            weights = np.array(list(open_buckets.values()))
            height, width, frames = shapes[rng.choice(len(shapes), p=weights / weights.sum())]
            kind = modality((height, width, frames))
            if taken[kind] >= limits[kind]:
                open_buckets = {b: w for b, w in open_buckets.items() if modality(b) != kind}
                continue
            taken[kind] += 1
            if kind == "image":
                request.images.append(noise_jpeg_url(height, width, rng))
            else:
                request.videos.append(noise_mp4_url(height, width, frames, rng))
    return requests


def sharegpt_requests(
    path: str, tokenizer, num_prompts: int, output_len: int | None = None, seed: int | None = 0
) -> list[BenchRequest]:
    """First human turn as the prompt, the reply's length as the output length; vLLM's filters (prompt and
    reply of at least 4 tokens, prompt at most 1024, both at most 2048). `seed` None: in the file's order."""
    conversations = [c for c in json.loads(Path(path).read_text()) if len(c.get("conversations", [])) >= 2]
    requests = []
    for i in in_order(len(conversations), seed):
        turns = conversations[i]["conversations"]
        request = conversation_request(turns[0]["value"], turns[1]["value"], tokenizer, output_len)
        if request is not None:
            requests.append(request)
        if len(requests) == num_prompts:
            break
    if not requests:
        raise ValueError(f"{path} has no usable conversations")
    return requests


def in_order(count: int, seed: int | list[int] | None) -> list[int]:
    """Indices shuffled with `seed`; None (--disable-shuffle): as they are."""
    return list(range(count)) if seed is None else np.random.default_rng(seed).permutation(count).tolist()


def oversampled(requests: list[BenchRequest], num_prompts: int, seed: int) -> list[BenchRequest]:
    """As vLLM fills a workload that has fewer requests than asked for: copies of requests drawn at random."""
    drawn = np.random.default_rng(seed).integers(0, len(requests), max(num_prompts - len(requests), 0))
    return requests + [dataclasses.replace(requests[i]) for i in drawn.tolist()]


def conversation_request(
    prompt: str, reply: str, tokenizer, output_len: int | None, images: list[str] | None = None
) -> BenchRequest | None:
    """A conversation's first message as the prompt and its reply's length as the output length (unless
    `output_len`); None where vLLM skips it (prompt or reply under 4 tokens, prompt over 1024, both over 2048)."""
    prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
    wanted = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
    if prompt_len < 4 or wanted < 4 or prompt_len > 1024 or prompt_len + wanted > 2048:
        return None
    return BenchRequest(prompt, prompt_len, wanted, images or [])


def jsonl_requests(
    path: str, tokenizer, num_prompts: int, output_len: int, seed: int | None = None
) -> list[BenchRequest]:
    """One JSON object per line: {"prompt": ..., "output_len"?: N, "images"?: [url, ...], "videos"?: [url, ...]}
    (URLs: data:, http(s):, file:, or a path, which is sent as a file:// URL); the first `num_prompts` of the
    file, or of its rows shuffled with `seed` (vLLM's custom)."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{number}: each line must be an object with a string 'prompt'")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    return [
        BenchRequest(
            rows[i]["prompt"],
            len(tokenizer.encode(rows[i]["prompt"], add_special_tokens=False)),
            int(rows[i].get("output_len", output_len)),
            media_urls(rows[i].get("images", [])),
            media_urls(rows[i].get("videos", [])),
        )
        for i in in_order(len(rows), seed)[:num_prompts]
    ]


def media_urls(values: list) -> list[str]:
    """URLs as given; a plain path becomes a file:// URL (the server must allow its folder:
    --allowed-local-media-path)."""
    return [
        value if "://" in value or value.startswith("data:") else Path(value).resolve().as_uri() for value in values
    ]
