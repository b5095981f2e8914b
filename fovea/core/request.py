"""What the front end hands the engine per request, what the engine tracks for it, and what it hands back.

A `RequestInput` is what the user asked for, prepared by the front end: a prompt (token ids, M-RoPE positions,
images) and sampling parameters; it crosses to the engine process as it is. The engine makes a `Request` of it,
its own record: one `Sequence` per sample (it owns a KV block table and a count of tokens whose KV is computed),
the samples' RNGs and grammars, metrics and what was already sent. Sequences are what the scheduler batches into
a `ScheduledBatch`, one step. With n > 1 the request runs as one sequence until its prompt is prefilled; then it
forks into n sequences sharing the prompt's blocks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

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


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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


class Request:
    """The engine's record of one request: its input (what the steps read of it copied out) and its state."""

    def __init__(self, input: RequestInput):
        self.input = input
        self.request_id, self.params = input.request_id, input.params
        self.prompt_token_ids, self.mrope_delta, self.mm_items = (
            input.prompt_token_ids,
            input.mrope_delta,
            input.mm_items,
        )
        length = len(input.prompt_token_ids)
        self.positions = np.broadcast_to(np.arange(length), (3, length)) if input.positions is None else input.positions
        self.mm_spans = [item.span for item in self.mm_items]
        self.lora = input.lora
        self.hash_salt = b"" if input.lora is None else b"lora:%d" % input.lora.lora_int_id  # block_manager.py
        params = self.params
        self.eos_token_ids = () if params.ignore_eos else tuple(input.eos_token_ids)
        self.stop_ids = self.eos_token_ids + tuple(params.stop_token_ids)  # what min_tokens holds back
        self.stop_token_set = frozenset(params.stop_token_ids)
        self.generators: list[torch.Generator | None] = []  # one per sample, on the engine's device
        self.grammars: list = []  # structured outputs: an llguidance matcher per sample
        self.metrics = RequestMetrics(input.arrival_time)
        self.sequences: list[Sequence] = []
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.aborted = False
        self.prompt_sent = False  # a report carried the prompt's log-probabilities and the metrics already
        self.num_finished_sequences = 0  # kept by the scheduler
        # a step it ran in failed: it runs in steps of its own until one samples for it (scheduler.isolate)
        self.suspect = False
        self.failed_steps = 0

    @property
    def finished(self) -> bool:
        # every sample finished (an aborted request never forks the samples it has not reached yet)
        return self.num_finished_sequences == (len(self.sequences) if self.aborted else self.params.n)


class Sequence:
    def __init__(self, seq_id: int, request: Request, index: int = 0):
        self.seq_id = seq_id
        self.request = request
        self.params = request.params
        self.index = index  # which of the request's n samples
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        # a token sampled by a step still on the device (the engine's `in_flight`), not yet in token_ids
        self.num_pending = 0
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.order = (request.input.fair_rank, request.input.arrival_index, index)
        self.pending_forks = request.params.n - 1 if index == 0 else 0  # samples to split off after the prefill
        self.queried_images: set[str] = set()  # images this sequence looked up in the encoder cache
        self.cumulative_logprob = 0.0
        self.last_token_time: float | None = None
        self.logprobs: list[dict[int, Logprob]] | None = [] if request.params.logprobs is not None else None
        self.text = ""
        self.num_decoded = self.num_prompt_tokens  # tokens whose text is in `text` (engine/outputs.py)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detokenizer = None  # set by the engine where its text is checked (stop strings, a reasoning end tag)
        self.grammar_waiting = request.input.grammar_after is not None  # its structured output has not begun
        self.sent_tokens = 0  # output tokens already reported (RequestDelta)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_tokens - self.num_computed_tokens > 1


@dataclass
class ScheduledBatch:
    """One engine step as the scheduler decides it and the model runner runs it."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # of each sequence, this step
    encode: list[MMItem] = field(default_factory=list)  # images to hand to the encoder (ImageEncoder)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) KV blocks, forks' partial blocks
    # sequences whose block tables changed other than by growing since the last step run (freed: finished,
    # preempted, isolated; or blocks swapped for cached ones): the runner lays them out afresh
    relaid: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class SampleDelta(NamedTuple):
    """What one sample of a request gained since the request's last report; its text is made where the caller
    is (frontend/outputs.py OutputAssembler), not in the engine's step loop."""

    index: int
    token_ids: list[int]  # new since the last report
    logprobs: list[dict[int, Logprob]] | None  # their entries, where logprobs were asked for
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
    prompt_logprobs: list[dict[int, Logprob] | None] | None
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
