"""A request's `RequestOutput`s, made in the caller's process from the engine's reports (RequestDelta): the front
end's receiving thread for a server, the caller's thread for `LLM` (LLMEngine.step). Detokenizing here keeps it out
of the engine's step loop (benchmarks/README, issue 54).

The tokenizers library's DecodeStream does the incremental part (engine/outputs.py IncrementalDetokenizer): it holds
back a token whose bytes end inside a multi-byte UTF-8 character until the character is complete, so no stream ever
shows a broken character. The logprob entries ({token: Logprob}, with the tokens' text) are made here too, from
the engine's LogprobRow tuples: at batch 256 with logprobs=5 making them in the step loop cost the engine more
than the rest of its host work (benchmarks/README).
"""

from __future__ import annotations

import functools

from fovea.core.request import CompletionOutput, Logprob, RequestDelta, RequestInput, RequestOutput, SampleDelta
from fovea.core.sampling_params import RequestOutputKind
from fovea.engine.outputs import IncrementalDetokenizer


class LogprobEntries:
    """{token: Logprob} entries of the engine's LogprobRows, with the tokens' texts: the same few thousand ids come
    back step after step, so a front end keeps their texts for all its requests."""

    def __init__(self, tokenizer):
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda token: tokenizer.decode([token]))

    def __call__(self, row: tuple | None) -> dict[int, Logprob] | None:
        """The chosen token and the best ones (ranked 1, 2, ...); None (a prompt's first token) stays None."""
        if row is None:
            return None
        token, logprob, rank, top_ids, top_logprobs = row
        text = self.token_text
        entry = {token: Logprob(logprob, rank, text(token))}
        for place, (top_id, value) in enumerate(zip(top_ids, top_logprobs), start=1):
            entry.setdefault(top_id, Logprob(value, place, text(top_id)))
        return entry


class SampleText:
    """One sample's output as its caller has it: every token so far, their text and logprob entries."""

    def __init__(self, tokenizer, input: RequestInput, entries: LogprobEntries):
        params = input.params
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer, input.prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens
            )
            if params.detokenize
            else None
        )
        self.entries = entries
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] = []
        self.sent_tokens = self.sent_text = 0  # how much DELTA outputs handed out

    def add(self, delta: SampleDelta) -> None:
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs += map(self.entries, delta.logprobs)
        if self.detokenizer is not None:
            self.text += self.detokenizer.decode_all(delta.token_ids)
        if delta.text_len is not None:  # a stop string: cut where the engine cut its own text of the same tokens
            self.text = self.text[: delta.text_len]


class OutputAssembler:
    """A request's `RequestOutput`s from the engine's reports (RequestDelta): the samples' text, detokenized as
    tokens arrive; everything so far (CUMULATIVE, FINAL_ONLY) or what is new since the last output (DELTA). Text
    that may still turn into a stop string is held back until it cannot. It runs where the caller is: the front
    end's process for a server, the caller's thread for `LLM`. `entries`: the caller's LogprobEntries, shared by
    its requests (None: one of its own)."""

    def __init__(self, tokenizer, input: RequestInput, entries: LogprobEntries | None = None):
        self.tokenizer, self.input = tokenizer, input
        self.entries = entries if entries is not None else LogprobEntries(tokenizer)
        self.samples: dict[int, SampleText] = {}
        self.prompt_logprobs, self.metrics = None, None
        self.prompt_sent = False  # a DELTA output carried the prompt already

    def __call__(self, delta: RequestDelta) -> RequestOutput:
        params, final = self.input.params, delta.finished
        if delta.metrics is not None:  # the first report and the last: the prompt's logprobs are whole in both
            self.metrics = delta.metrics
            if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
                self.prompt_logprobs = list(map(self.entries, delta.prompt_logprobs))
        incremental = params.output_kind == RequestOutputKind.DELTA
        holdback = 0 if final else params.stop_holdback  # a stop string may still be forming
        logprobs = params.logprobs is not None
        completions = []
        for sample_delta in map(SampleDelta._make, delta.outputs):
            sample = self.samples.get(sample_delta.index)
            if sample is None:
                sample = self.samples[sample_delta.index] = SampleText(self.tokenizer, self.input, self.entries)
            sample.add(sample_delta)
            done = sample_delta.finish_reason is not None
            text_end = len(sample.text) if done else max(len(sample.text) - holdback, 0)
            token_start = sample.sent_tokens if incremental else 0
            text_start = min(sample.sent_text, text_end) if incremental else 0
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


def joined(outputs: list[RequestOutput], incremental: bool) -> RequestOutput:
    """Outputs of one stream that queued while its reader was busy, as one (fewer, larger chunks when the front
    end falls behind, as vLLM's). DELTA: each sample's new text, ids and logprobs in order, its finish as the
    last has it; the prompt fields from the first that has them. Otherwise the last has it all."""
    last = outputs[-1]
    if not incremental:
        return last
    parts: dict[int, list[CompletionOutput]] = {}
    for output in outputs:
        for c in output.outputs:
            parts.setdefault(c.index, []).append(c)
    samples = []
    for index in sorted(parts):
        ours, final = parts[index], parts[index][-1]
        logprobs = None
        if any(c.logprobs is not None for c in ours):
            logprobs = [entry for c in ours for entry in c.logprobs or ()]
        text, token_ids = "".join(c.text for c in ours), [t for c in ours for t in c.token_ids]
        samples.append(
            CompletionOutput(
                index, text, token_ids, final.cumulative_logprob, logprobs, final.finish_reason, final.stop_reason
            )
        )
    prompt = next((output for output in outputs if output.prompt_token_ids), last)
    return RequestOutput(
        last.request_id,
        prompt.prompt,
        prompt.prompt_token_ids,
        prompt.prompt_logprobs,
        samples,
        last.finished,
        last.num_cached_tokens,
        next((output.metrics for output in reversed(outputs) if output.metrics is not None), None),
        prompt.num_image_tokens,
    )
