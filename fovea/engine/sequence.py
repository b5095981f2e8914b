"""The engine's record of a request and of its samples, and the step the scheduler makes of them.

The engine makes a `Request` of each RequestInput: one `Sequence` per sample (it owns a KV block table and a
count of tokens whose KV is computed), the samples' RNGs and grammars, metrics and what was already reported.
Sequences are what the scheduler batches into a `ScheduledBatch`, one step; the runner is told the step as a
`ScheduledStep` and never sees these objects. With n > 1 the request runs as one sequence until its prompt is
prefilled; then it forks into n sequences sharing the prompt's blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch

from fovea.core.request import RequestInput, RequestMetrics
from fovea.core.sampling_params import RequestOutputKind
from fovea.runner.step_input import NewSequence, ScheduledStep


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """The engine's record of one request: its input (what the steps read of it copied out) and its state."""

    # slots, those every step reads first: a step at batch 256 pays a cache miss per line of per-request state
    # it touches (benchmarks/README, issue 54)
    __slots__ = (
        "streams", "stop_set", "metrics", "sequences", "eos_token_ids", "request_id", "mm_items", "lora", "suspect",
        "prompt_logprobs", "params", "input", "prompt_token_ids", "mrope_delta", "positions", "mm_spans", "hash_salt",
        "stop_ids", "stop_token_set", "generators", "grammars", "num_cached_tokens", "aborted", "prompt_sent",
        "num_finished_sequences", "failed_steps", "reads_last_tokens", "__weakref__",
    )  # fmt: skip

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
        # what starts the chain of block hashes (block_manager.py): an adapter's KV, a tenant's salt
        self.hash_salt = b"" if input.lora is None else b"lora:%d" % input.lora.lora_int_id
        if input.params.cache_salt is not None:
            self.hash_salt += b"salt:" + input.params.cache_salt.encode()
        params = self.params
        self.eos_token_ids = () if params.ignore_eos else tuple(input.eos_token_ids)
        self.stop_ids = self.eos_token_ids + tuple(params.stop_token_ids)  # what min_tokens holds back
        self.stop_token_set = frozenset(params.stop_token_ids)
        self.stop_set = self.stop_token_set.union(self.eos_token_ids)
        self.streams = params.output_kind != RequestOutputKind.FINAL_ONLY  # reported after every step it samples in
        # a bad word of several tokens: the sampler reads the last ones generated (no step is scheduled ahead)
        self.reads_last_tokens = any(len(ids) > 1 for ids in params.bad_words_token_ids)
        self.generators: list[torch.Generator | None] = []  # one per sample, on the engine's device
        self.grammars: list = []  # structured outputs: an llguidance matcher per sample
        self.metrics = RequestMetrics(input.arrival_time)
        self.sequences: list[Sequence] = []
        self.num_cached_tokens = 0
        # LogprobRow tuples (the front end makes the entries), None for the first prompt token
        self.prompt_logprobs: list[tuple | None] | None = [None] if params.prompt_logprobs is not None else None
        self.aborted = False
        self.prompt_sent = False  # a report carried the prompt's log-probabilities and the metrics already
        self.num_finished_sequences = 0  # kept by the scheduler
        # a step it ran in failed: it runs in steps of its own until one samples for it (scheduler.isolate)
        self.suspect = False
        self.failed_steps = 0

    @property
    def finished(self) -> bool:
        # every sample finished; an abort finishes those it has (it never forks the ones it has not reached yet)
        return self.aborted or self.num_finished_sequences == self.params.n


class Sequence:
    # slots, those a decode step reads first (as Request's)
    __slots__ = (
        "status", "request", "plain", "token_ids", "length_limit", "num_pending", "num_computed_tokens",
        "last_token_time", "block_table", "num_registered_blocks", "on_runner", "blocks_sent", "seq_id",
        "pending_forks", "params", "index", "num_prompt_tokens", "block_hashes", "order", "queried_images",
        "cumulative_logprob", "logprobs", "text", "num_decoded", "finish_reason", "stop_reason", "detokenizer",
        "grammar_waiting", "sent_tokens", "__weakref__",
    )  # fmt: skip

    def __init__(self, seq_id: int, request: Request, index: int = 0, max_model_len: int = 1 << 62):
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
        self.order = (request.input.priority, request.input.fair_rank, request.input.arrival_index, index)
        self.pending_forks = request.params.n - 1 if index == 0 else 0  # samples to split off after the prefill
        self.queried_images: set[str] = set()  # images this sequence looked up in the encoder cache
        self.cumulative_logprob = 0.0
        self.last_token_time: float | None = None
        self.logprobs: list[tuple] | None = [] if request.params.logprobs is not None else None  # LogprobRows
        self.text = ""
        self.num_decoded = self.num_prompt_tokens  # tokens whose text is in `text` (engine/outputs.py)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detokenizer = None  # set by the engine where its text is checked (stop strings, a reasoning end tag)
        self.grammar_waiting = request.input.grammar_after is not None  # its structured output has not begun
        self.sent_tokens = 0  # output tokens already reported (RequestDelta)
        # its tokens need none of append_token's checks but a stop token and the length (LLMEngine._record_samples)
        self.plain = (
            not self.params.stop_strings
            and request.input.grammar_after is None
            and self.params.structured_outputs is None
            and self.params.min_tokens == 0
        )
        max_tokens = self.params.max_tokens
        # tokens at which it finishes by length: max_tokens generated, or max_model_len in all
        self.length_limit = min(max_model_len, self.num_prompt_tokens + (1 << 62 if max_tokens is None else max_tokens))
        self.on_runner = False  # the runner has a row for it (ScheduledStep)
        self.blocks_sent = 0  # blocks of its table the runner has

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_tokens - self.num_computed_tokens > 1

    def for_runner(self) -> NewSequence:
        """All the runner reads of it, for the row it makes (once, unless relaid)."""
        request = self.request
        self.on_runner, self.blocks_sent = True, len(self.block_table)
        return NewSequence(
            self.seq_id,
            self.token_ids,
            self.num_prompt_tokens,
            self.num_computed_tokens,
            list(self.block_table),
            request.positions,
            request.mrope_delta,
            request.mm_items,
            self.params,
            self.index,
            request.generators,
            request.grammars if request.grammars and not self.grammar_waiting else None,
            request.stop_ids,
            self.pending_forks,
            self.params.prompt_logprobs if request.prompt_logprobs is not None else None,
            request.lora,
        )


@dataclass
class ScheduledBatch:
    """One engine step: its sequences, and the step as the runner is told it (the same sequences, in order)."""

    seqs: list[Sequence] = field(default_factory=list)
    step: ScheduledStep = field(default_factory=ScheduledStep)
    # those whose step fills a KV block or shows an image: what Scheduler.step_done looks at, not all of them
    filling: list[Sequence] = field(default_factory=list)

    @property
    def num_new_tokens(self) -> list[int]:
        return self.step.num_new_tokens

    @property
    def num_tokens(self) -> int:
        return self.step.num_tokens

    def __len__(self) -> int:
        return len(self.seqs)
