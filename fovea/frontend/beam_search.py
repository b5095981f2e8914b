"""Beam search, as vLLM runs it: in the front end, over the engine's one-token requests.

Each step, every live beam of a prompt is a request for one token that brings back the 2 x beam_width likeliest
next tokens' log-probabilities (the model's raw ones, before temperature) and the token it drew, each a candidate
(vLLM's rule, which follows transformers' 2 x num_beams). A candidate that is an end-of-sequence token ends its
beam (unless ignore_eos); of the others, the beam_width with the highest cumulative log-probability go on. After
max_tokens steps, or once no beam goes on, the ended and the live beams are ranked by cumulative logprob /
length ** length_penalty, the length counting the prompt and not the end token, and the best beam_width are the
answer. A step's prompts are the last step's plus one token each, so the prefix cache leaves each beam only its
last, partial KV block to compute.

`SamplingParams(use_beam_search=True, n=beam_width, ...)` asks for it (the server's `use_beam_search`); the
engine never sees such a request, only its steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fovea.core.request import Logprob, MMItem, RequestDelta, RequestInput, RequestMetrics, RequestOutput
from fovea.core.sampling_params import RequestOutputKind, SamplingParams
from fovea.frontend.outputs import OutputAssembler
from fovea.multimodal.image_workers import SharedPixels, new_segment_name, release_shared


@dataclass
class BeamSearchSequence:
    """One of `LLM.beam_search`'s answers, as vLLM gives it: the tokens and the text include the prompt."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class Beam:
    tokens: list[int]  # generated so far
    logprobs: list[dict[int, Logprob]]  # each step's entries (the candidates it was chosen among)
    cum_logprob: float = 0.0
    ended: bool = False  # by an end-of-sequence token, which `tokens` holds as its last


@dataclass
class BeamSearch:
    """One prompt's search, driven by its caller: run `step_requests()` on the engine, hand each one's final output
    to `take`; once `done`, `output()` is the answer."""

    root: RequestInput  # the prepared prompt; its params ask for the search
    max_model_len: int
    lend_pixels: bool = False  # steps go to another process: they carry the pixels as shared-memory handles
    beams: list[Beam] = field(init=False, default_factory=lambda: [Beam([], [])])
    ended: list[Beam] = field(init=False, default_factory=list)
    steps_done: int = field(init=False, default=0)
    waiting: dict[str, RequestOutput | None] = field(init=False, default_factory=dict)  # this step's, by id
    first: RequestOutput | None = field(init=False, default=None)  # the first step's: cached tokens, times

    def __post_init__(self):
        params = self.root.params
        self.lent: dict[int, SharedPixels] = {}  # segments the search holds until close(), by the pixels' id
        if self.lend_pixels:  # every step names the same segments: its pixels are not copied again each step
            self.items = [self._lend(item) for item in self.root.mm_items]
        else:  # every step holds the same arrays
            self.root.take_shared_pixels()
            self.close()
            self.items = self.root.mm_items
        self.width = params.n
        self.eos = set() if params.ignore_eos else set(self.root.eos_token_ids)
        room = self.max_model_len - len(self.root.prompt_token_ids)
        self.max_steps = min(room, params.max_tokens or room)

    def _lend(self, item: MMItem) -> MMItem:
        pixels = item.pixels
        if item.embeds:  # the tower's output given as input: an array of floats, sent as it is
            return item
        if id(pixels) not in self.lent:  # (a long video's parts share their pixels)
            shared = pixels if isinstance(pixels, SharedPixels) else SharedPixels.create(pixels, new_segment_name())
            self.lent[id(pixels)] = shared
        return dataclasses.replace(item, pixels=dataclasses.replace(self.lent[id(pixels)], borrowed=True))

    def close(self) -> None:
        """Frees the shared memory the search held (idempotent); the caller's, once the search has ended."""
        release_shared(list(self.lent.values()))
        self.lent = {}
        if self.root.release_unsent is not None:  # (what it would free is in `lent`, or taken)
            self.root.release_unsent.detach()
            self.root.release_unsent = None

    @property
    def done(self) -> bool:
        return not self.beams or self.steps_done >= self.max_steps

    def step_requests(self) -> list[RequestInput]:
        """This step's one-token requests, one per live beam."""
        params = self.root.params
        step = SamplingParams(
            max_tokens=1,
            temperature=params.temperature,
            logprobs=max(2 * self.width, params.logprobs or 0),
            seed=None if params.seed is None else (params.seed + self.steps_done) % 2**62,  # a draw of its own
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        requests = []
        for i, beam in enumerate(self.beams):
            positions = self.root.positions
            if positions is not None and beam.tokens:  # generated tokens count on from the prompt's M-RoPE delta
                start = len(self.root.prompt_token_ids) + self.root.mrope_delta
                added = np.arange(start, start + len(beam.tokens), dtype=positions.dtype)
                positions = np.concatenate([positions, np.broadcast_to(added, (positions.shape[0], len(added)))], 1)
            requests.append(
                dataclasses.replace(
                    self.root,
                    request_id=f"{self.root.request_id}-beam{self.steps_done}-{i}",
                    prompt_token_ids=self.root.prompt_token_ids + beam.tokens,
                    params=step,
                    positions=positions,
                    mm_items=[dataclasses.replace(item) for item in self.items],  # taking pixels changes an item
                    grammar_after=None,
                    release_unsent=None,
                )
            )
        self.waiting = dict.fromkeys(r.request_id for r in requests)
        return requests

    def take(self, output: RequestOutput) -> bool:
        """A step request's final output; True once the step's last one is in (the beams have moved on)."""
        self.waiting[output.request_id] = output
        if any(o is None for o in self.waiting.values()):
            return False
        outputs, self.waiting = list(self.waiting.values()), {}
        self.first = self.first or outputs[0]
        candidates = []  # (cumulative logprob, token, beam, entry): only the winners become beams
        for beam, out in zip(self.beams, outputs):
            entry = out.outputs[0].logprobs[0]
            for token, logprob in entry.items():
                total = beam.cum_logprob + logprob.logprob
                if token in self.eos:
                    self.ended.append(Beam(beam.tokens + [token], beam.logprobs + [entry], total, ended=True))
                else:
                    candidates.append((total, token, beam, entry))
        candidates.sort(key=lambda c: c[0], reverse=True)
        self.beams = [Beam(b.tokens + [t], b.logprobs + [e], total) for total, t, b, e in candidates[: self.width]]
        # an ended beam's score is final: one that is not among the best `width` ended ones never will be
        self.ended = sorted(self.ended, key=self.score, reverse=True)[: self.width]
        self.steps_done += 1
        return True

    def score(self, beam: Beam) -> float:
        length = len(self.root.prompt_token_ids) + len(beam.tokens) - beam.ended
        return beam.cum_logprob / length**self.root.params.length_penalty

    def best(self) -> list[Beam]:
        return sorted(self.ended + self.beams, key=self.score, reverse=True)[: self.width]

    def answer(self) -> list[tuple[Beam, list[int]]]:
        """The best beams, best first, each with the tokens it answers: an ended beam's end token is left out
        unless include_stop_str_in_output (vLLM's rule)."""
        keep_end = self.root.params.include_stop_str_in_output
        return [(b, b.tokens[: len(b.tokens) - (b.ended and not keep_end)]) for b in self.best()]

    def output(self, tokenizer) -> RequestOutput:
        """The answer as the request's one final output, made as the engine's are (OutputAssembler), with the
        beams' logprob entries (the step requests' outputs')."""
        answer = self.answer()
        samples = [
            (i, tokens, None, beam.cum_logprob, *finish_of(beam), None) for i, (beam, tokens) in enumerate(answer)
        ]
        first, now = self.first, time.time()
        metrics = RequestMetrics(self.root.arrival_time, finished_time=now, last_token_time=now)
        if first is not None and first.metrics is not None:
            metrics.first_scheduled_time = first.metrics.first_scheduled_time
            metrics.first_token_time = first.metrics.first_token_time
        cached = first.num_cached_tokens if first is not None else 0
        delta = RequestDelta(self.root.request_id, samples, True, cached, None, metrics)
        output = OutputAssembler(tokenizer, self.root)(delta)
        if self.root.params.logprobs is not None:
            for completion, (beam, tokens) in zip(output.outputs, answer):
                completion.logprobs = beam.logprobs[: len(tokens)]
        return output


async def served_beam_search(search: BeamSearch, stream: Callable, tokenizer) -> RequestOutput:
    """A search run on a served engine: each step's requests go out together (`stream`: AsyncLLM's, which yields
    a request's outputs); the first step request to fail fails the search, and the others are aborted."""

    async def final(step: RequestInput) -> RequestOutput:
        async for output in stream(step):
            pass
        return output

    try:
        while not search.done:
            tasks = [asyncio.ensure_future(final(step)) for step in search.step_requests()]
            try:
                outputs = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)  # their aborts are sent before close()
                raise
            for output in outputs:
                search.take(output)
        return search.output(tokenizer)
    finally:
        search.close()


def finish_of(beam: Beam) -> tuple[str, int | None]:
    """(finish_reason, stop_reason): an ended beam stopped at its end token."""
    return ("stop", beam.tokens[-1]) if beam.ended else ("length", None)


def beam_search_output(output: RequestOutput, tokenizer) -> BeamSearchOutput:
    """A finished search's RequestOutput (asked with logprobs set) as `LLM.beam_search` gives it."""
    found = []
    for sample in output.outputs:
        tokens = output.prompt_token_ids + sample.token_ids
        stop = sample.stop_reason if sample.finish_reason == "stop" else None
        found.append(
            BeamSearchSequence(
                tokens, sample.logprobs, sample.cumulative_logprob, tokenizer.decode(tokens), sample.finish_reason, stop
            )
        )
    return BeamSearchOutput(found)
