"""From a sampled token to what the caller sees. In the engine: the token recorded, the stop checks, logprob
entries, and the request's report (`request_delta`: ids and finish). Where the caller is (the front end's process,
or an in-process `LLM`): the text, detokenized as tokens arrive, and the `RequestOutput` (`OutputAssembler`).

The tokenizers library's DecodeStream does the incremental part: it holds back a token whose bytes end inside
a multi-byte UTF-8 character until the character is complete, so no stream ever shows a broken character.
Stop strings are searched in the text as it grows, including matches that span several tokens.
"""

from __future__ import annotations

import functools

from tokenizers.decoders import DecodeStream

from fovea.core.request import (
    CompletionOutput,
    Logprob,
    Request,
    RequestDelta,
    RequestInput,
    RequestOutput,
    SampleDelta,
    ScheduledBatch,
    Sequence,
)
from fovea.core.sampling_params import RequestOutputKind

PRIME_TOKENS = 4  # prompt tokens fed first, so the first generated token decodes in context (leading spaces)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self.backend = tokenizer.backend_tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # Without spaces between special tokens, two consecutive added tokens are joined with their raw text
        # (some decoders prefix a space to each).
        self.added = (
            None
            if spaces_between_special_tokens or skip_special_tokens
            else {token_id: token.content for token_id, token in tokenizer.added_tokens_decoder.items()}
        )
        self.last_was_added = False
        for token_id in prompt_ids[-PRIME_TOKENS:]:
            self._step(token_id)

    def _step(self, token_id: int) -> str:
        try:
            return self.stream.step(self.backend, token_id) or ""
        except Exception:  # an id outside the vocabulary (random weights can produce one): no text
            return ""

    def decode(self, token_id: int) -> str:
        """The text this token completes ("" while a character is still partial)."""
        piece = self._step(token_id)
        if self.added is not None:
            raw = self.added.get(token_id)
            if raw is not None and self.last_was_added:
                piece = raw
            self.last_was_added = raw is not None
        return piece


def find_stop_string(text: str, new_chars: int, stop_strings: list[str]) -> tuple[str, int] | None:
    """The stop string that ends earliest in `text` among those that end inside its last `new_chars`
    characters, and where it starts; None if none."""
    best = None
    for stop in stop_strings:
        # a match must end in the new text, so it starts at most len(stop) - 1 characters before it
        begin = max(0, len(text) - new_chars - len(stop) + 1)
        index = text.find(stop, begin)
        if index != -1 and (best is None or index + len(stop) < best[1] + len(best[0])):
            best = (stop, index)
    return best


def decode_pending(seq: Sequence) -> int:
    """Adds the text of the sequence's tokens not decoded yet; returns how many characters that added. Text is
    decoded when a check needs it (stop strings, a reasoning end tag) or an output shows it: on a GPU that is after
    the next step is queued (LLMEngine.step), while the device works."""
    if seq.detokenizer is None:
        return 0
    before = len(seq.text)
    seq.text += "".join(seq.detokenizer.decode(token) for token in seq.token_ids[seq.num_decoded :])
    seq.num_decoded = len(seq.token_ids)
    return len(seq.text) - before


def append_token(seq: Sequence, token: int, entry: dict | None, logprob: float, max_model_len: int):
    """Records a sampled token on its sequence (ids, logprobs, and text where a check reads it); returns why
    the sequence finishes with it, (finish_reason, stop_reason), or None. A stop string found is cut from the
    text (kept with include_stop_str_in_output)."""
    params = seq.params
    seq.token_ids.append(token)
    seq.cumulative_logprob += logprob
    if seq.logprobs is not None:
        seq.logprobs.append(entry)
    new_chars = 0
    if params.stop_strings or seq.grammar_waiting:  # checks that read the text now; the rest is decoded later
        new_chars = decode_pending(seq)
        if seq.grammar_waiting:  # the reasoning's end tag, looked for where this token's text could complete it
            tag = seq.request.input.grammar_after
            if seq.text.find(tag, max(0, len(seq.text) - new_chars - len(tag) + 1)) >= 0:
                seq.grammar_waiting = False  # the grammar constrains from the next token
    generated = len(seq.token_ids) - seq.num_prompt_tokens
    if generated >= params.min_tokens:
        if token in seq.request.eos_token_ids:
            return "stop", None
        if token in seq.request.stop_token_set:
            return "stop", token
        found = (
            find_stop_string(seq.text, new_chars, params.stop_strings) if params.stop_strings and new_chars else None
        )
        if found:
            stop, index = found
            seq.text = seq.text[: index + len(stop) if params.include_stop_str_in_output else index]
            return "stop", stop
    if (params.max_tokens is not None and generated >= params.max_tokens) or len(seq.token_ids) >= max_model_len:
        return "length", None
    return None


class LogprobEntries:
    """{token: Logprob} entries, with the tokens' texts: the same few thousand ids come back step after step."""

    def __init__(self, tokenizer):
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda token: tokenizer.decode([token]))

    def __call__(
        self, token: int, logprob: float, rank: int, top_ids: list[int], top_values: list[float]
    ) -> dict[int, Logprob]:
        """The chosen token and the best ones (ranked 1, 2, ...)."""
        entry = {token: Logprob(logprob, rank, self.token_text(token))}
        for place, (tid, value) in enumerate(zip(top_ids, top_values), start=1):
            entry.setdefault(tid, Logprob(value, place, self.token_text(tid)))
        return entry


def request_delta(request: Request, final: bool) -> tuple:
    """What the request's samples gained since its last report, as a RequestDelta's plain tuple: ids, logprob
    entries, how they finished. Text is the assembler's (OutputAssembler), wherever the caller is: this is all
    the engine's step loop builds."""
    samples = []
    for seq in request.sequences:
        start = seq.num_prompt_tokens + seq.sent_tokens
        logprobs = seq.logprobs is not None
        samples.append(
            (
                seq.index,
                seq.token_ids[start:],
                seq.logprobs[seq.sent_tokens :] if logprobs else None,
                seq.cumulative_logprob if logprobs else None,
                seq.finish_reason,
                seq.stop_reason,
                len(seq.text) if isinstance(seq.stop_reason, str) else None,
            )
        )
        seq.sent_tokens = len(seq.token_ids) - seq.num_prompt_tokens
    if final or not request.prompt_sent:
        request.prompt_sent = True
        return request.request_id, samples, final, request.num_cached_tokens, request.prompt_logprobs, request.metrics
    return request.request_id, samples, final, request.num_cached_tokens, None, None


class SampleText:
    """One sample's output as its caller has it: every token so far and their text."""

    def __init__(self, tokenizer, input: RequestInput):
        params = input.params
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer, input.prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens
            )
            if params.detokenize
            else None
        )
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] = []
        self.sent_tokens = self.sent_text = 0  # how much DELTA outputs handed out

    def add(self, delta: SampleDelta) -> None:
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs += delta.logprobs
        if self.detokenizer is not None:
            self.text += "".join(self.detokenizer.decode(token) for token in delta.token_ids)
        if delta.text_len is not None:  # a stop string: cut where the engine cut its own text of the same tokens
            self.text = self.text[: delta.text_len]


class OutputAssembler:
    """A request's `RequestOutput`s from the engine's reports (RequestDelta): the samples' text, detokenized as
    tokens arrive; everything so far (CUMULATIVE, FINAL_ONLY) or what is new since the last output (DELTA). Text
    that may still turn into a stop string is held back until it cannot. It runs where the caller is: the front
    end's process for a server, the caller's thread for `LLM`."""

    def __init__(self, tokenizer, input: RequestInput):
        self.tokenizer, self.input = tokenizer, input
        self.samples: dict[int, SampleText] = {}
        self.prompt_logprobs, self.metrics = None, None
        self.prompt_sent = False  # a DELTA output carried the prompt already

    def __call__(self, report: tuple) -> RequestOutput:
        """`report`: a RequestDelta, or its plain tuple."""
        delta = RequestDelta._make(report)
        params, final = self.input.params, delta.finished
        if delta.metrics is not None:
            self.prompt_logprobs, self.metrics = delta.prompt_logprobs, delta.metrics
        incremental = params.output_kind == RequestOutputKind.DELTA
        holdback = 0 if final else params.stop_holdback  # a stop string may still be forming
        completions = []
        for sample_delta in map(SampleDelta._make, delta.outputs):
            sample = self.samples.get(sample_delta.index)
            if sample is None:
                sample = self.samples[sample_delta.index] = SampleText(self.tokenizer, self.input)
            sample.add(sample_delta)
            done = sample_delta.finish_reason is not None
            text_end = len(sample.text) if done else max(len(sample.text) - holdback, 0)
            token_start = sample.sent_tokens if incremental else 0
            text_start = min(sample.sent_text, text_end) if incremental else 0
            logprobs = params.logprobs is not None
            completions.append(
                CompletionOutput(
                    sample_delta.index,
                    sample.text[text_start:text_end],
                    sample.token_ids[token_start:],
                    sample_delta.cumulative_logprob if logprobs else None,
                    sample.logprobs[token_start:] if logprobs else None,
                    sample_delta.finish_reason,
                    sample_delta.stop_reason,
                )
            )
            sample.sent_tokens, sample.sent_text = len(sample.token_ids), text_end
        completions.sort(key=lambda c: c.index)  # forks finish in any order
        if incremental and self.prompt_sent and not final:  # streaming: the prompt travels with the first and last
            return RequestOutput(self.input.request_id, None, [], None, completions, final, delta.num_cached_tokens)
        self.prompt_sent = True
        return RequestOutput(
            self.input.request_id,
            self.input.prompt,
            self.input.prompt_token_ids,
            self.prompt_logprobs,
            completions,
            final,
            delta.num_cached_tokens,
            self.metrics,
            sum(item.span.length for item in self.input.mm_items),
        )


def record_prompt_logprobs(batch: ScheduledBatch, scored: dict[int, tuple], entry: LogprobEntries) -> None:
    """The prompt log-probabilities a step scored (batch index -> chosen, ranks, top ids, top values), appended
    to their requests' as {token: Logprob} entries."""
    for index, (chosen, ranks, top_ids, top_values) in scored.items():
        seq = batch.seqs[index]
        targets = seq.token_ids[len(seq.request.prompt_logprobs) :][: chosen.numel()]
        top_ids = top_ids.tolist() if top_ids is not None else [[] for _ in targets]
        top_values = top_values.tolist() if top_values is not None else [[] for _ in targets]
        seq.request.prompt_logprobs += [
            entry(*row) for row in zip(targets, chosen.tolist(), ranks.tolist(), top_ids, top_values)
        ]
