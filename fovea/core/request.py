"""The types that cross between the front end and the engine: what the front end hands the engine per request,
and what the engine hands back.

A `RequestInput` is what the user asked for, prepared by the front end: a prompt (token ids, M-RoPE positions,
images) and sampling parameters; it crosses to the engine process as it is. The engine keeps its own record of it
(engine/sequence.py) and reports `RequestDelta`s, which the front end makes into `RequestOutput`s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from fovea.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter a request runs with (vLLM's fields): a PEFT adapter directory. `lora_int_id` identifies
    it (cached KV blocks and image embeddings are its own); a name served by `fovea serve` gets one when loaded."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    digest: str = ""  # of the files the front end checked: the engine loads only those bytes (models/lora.py)

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be at least 1, got {self.lora_int_id}")


@dataclass(frozen=True)
class MMSpan:
    """Where one image's placeholder tokens sit in the prompt, and what the image is."""

    start: int
    length: int
    content_hash: str


@dataclass
class MMItem:
    """One image (or a run of a video's temporal patches) of a prompt: where its placeholders are, its content
    hash, and the encoder's input: resized uint8 (height, width, 3) pixels (a video's (frames, height, width, 3)),
    patchified on the engine's device. From the server's decoding workers the pixels arrive as a SharedPixels
    handle, which the engine takes on arrival; `frames` then says which of its frames are this item's."""

    span: MMSpan
    grid_thw: tuple[int, int, int]
    pixels: np.ndarray  # or SharedPixels until the engine takes it
    frames: tuple[int, int] | None = None
    embeds: bool = False  # `pixels` are the tower's output for it, given as input (--enable-mm-embeds)
    lora: LoRARequest | None = None  # the adapter the vision tower runs with (one that changes the tower)

    @property
    def content_hash(self) -> str:
        return self.span.content_hash

    @property
    def end(self) -> int:
        return self.span.start + self.span.length


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


@dataclass(slots=True)  # read and written for every token (engine/sequence.py's slots say why that matters)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestInput:
    """A prepared request, as the front end sends it to the engine. The engine changes nothing in it but its
    pixels: shared-memory handles become arrays on arrival (take_shared_pixels)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    positions: np.ndarray | None = None  # (3, prompt length) M-RoPE positions; None: text only, counting up
    mrope_delta: int = 0  # what generated tokens add to their index to get their position
    mm_items: list[MMItem] = field(default_factory=list)
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.time)
    eos_token_ids: tuple[int, ...] = ()
    arrival_index: int = 0  # FCFS order, also after preemption
    # the i-th prompt of one API request waits behind the first prompts of later requests: a request with
    # thousands of prompts cannot hold everyone else behind it (0 for single-prompt requests)
    fair_rank: int = 0
    priority: int = 0  # --scheduling-policy priority: lower first (and preempted last), then the order above
    grammar_after: str | None = None  # structured outputs start once this text is in the output (reasoning's end)
    lora: LoRARequest | None = None
    # front end only: frees shared pixels if the request is dropped before it is sent
    release_unsent: object = field(default=None, repr=False, compare=False)

    def take_shared_pixels(self) -> None:
        """Copies pixels out of the decoding workers' shared memory and frees it: the engine does so on arrival;
        a front end does it first when the engine runs on another node (a Ray replica), which cannot see it."""
        taken: dict[str, np.ndarray] = {}  # a long video's parts share one segment
        for item in self.mm_items:
            if not isinstance(item.pixels, np.ndarray):  # a SharedPixels (multimodal/image_workers.py)
                if item.pixels.name not in taken:
                    taken[item.pixels.name] = item.pixels.take()
                whole = taken[item.pixels.name]
                item.pixels = whole[item.frames[0] : item.frames[1]] if item.frames else whole


class LogprobRow(NamedTuple):
    """One position's log-probabilities as the engine keeps and reports them (a plain tuple in these fields'
    order): the token's, its rank, and the likeliest tokens'. The front end makes the {token: Logprob} entry of
    it, with the tokens' text (frontend/outputs.py), off the engine's step loop."""

    token: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


class SampleDelta(NamedTuple):
    """What one sample of a request gained since the request's last report; its text is made where the caller
    is (frontend/outputs.py OutputAssembler), not in the engine's step loop."""

    index: int
    token_ids: list[int]  # new since the last report
    logprobs: list[tuple] | None  # their LogprobRow tuples, where logprobs were asked for
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None
    text_len: int | None  # finished by a stop string: the length of the output text once cut


class RequestDelta(NamedTuple):
    """A request's report from an engine step: what its samples gained (SampleDelta layouts); the prompt's
    log-probabilities and the metrics come with the first and the last report. The engine builds it, and its
    samples, as plain tuples in these fields' order: a step's reports go to the front end in one pickle, and a
    tuple pickles ~6x faster than an object with fields (benchmarks/README, issue 54); `_make` reads one."""

    request_id: str
    outputs: list[tuple]
    finished: bool
    num_cached_tokens: int
    prompt_logprobs: list[tuple | None] | None  # LogprobRow tuples, None for the first prompt token
    metrics: RequestMetrics | None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What a request has produced. DELTA outputs (streaming) carry the prompt fields (prompt, its token ids and
    logprobs, metrics) only in the first and the final output, so that a step at batch 256 stays cheap to send."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    num_image_tokens: int = 0  # the prompt's image and video placeholder tokens
