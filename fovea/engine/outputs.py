"""From a sampled token to the request's report: the token recorded, the stop checks (on text only where they
read it), and `request_delta` (ids, logprob rows and finish). The text, the logprob entries and the
`RequestOutput` are made where the caller is (frontend/outputs.py).

The tokenizers library's DecodeStream does the incremental part: it holds back a token whose bytes end inside
a multi-byte UTF-8 character until the character is complete, so no stream ever shows a broken character.
Stop strings are searched in the text as it grows, including matches that span several tokens.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from fovea.engine.sequence import Request, ScheduledBatch, Sequence

PRIME_TOKENS = 4  # prompt tokens fed first, so the first generated token decodes in context (leading spaces)
# a UTF-8 character's bytes end within this many tokens: at most 4 bytes, a token each, and room for tokens of no
# bytes (special ones skipped) between them
CHARACTER_TOKENS = 8


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self.backend = tokenizer.backend_tokenizer
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # Without spaces between special tokens, two consecutive added tokens are joined with their raw text
        # (some decoders prefix a space to each).
        self.added = (
            None
            if spaces_between_special_tokens or skip_special_tokens
            else {token_id: token.content for token_id, token in tokenizer.added_tokens_decoder.items()}
        )
        self.last_was_added = False
        self.skip_special_tokens = skip_special_tokens
        self.shown: list[int] = []  # the last ids whose text was given (the context a fresh stream starts from)
        self.held: list[int] = []  # ids stepped since, whose text is held back (a character still partial)
        for token_id in prompt_ids[-PRIME_TOKENS:]:
            self._step(token_id)
        self.shown, self.held = (self.shown + self.held)[-PRIME_TOKENS:], []  # (the prompt's text is never shown)

    def _step(self, token_id: int) -> str:
        try:
            piece = self.stream.step(self.backend, token_id) or ""
        except Exception:  # an id outside the vocabulary (random weights can produce one): no text
            piece = ""
        self._note([token_id], piece)
        return piece

    def _note(self, token_ids: list[int], piece: str) -> None:
        if piece:
            self.shown, self.held = (self.shown + self.held + token_ids)[-PRIME_TOKENS:], []
        else:
            self.held += token_ids

    def decode_all(self, token_ids: list[int]) -> str:
        """The text these tokens complete, as `decode` one at a time gives it: one call into the tokenizers
        library for all of them where no token needs a look of its own (a whole non-streamed output at its end;
        benchmarks/detokenize.py)."""
        # an id past the vocabulary (a padded embedding's row) makes the library drop the whole call's text: alone,
        # it drops only its own
        if self.added is None and len(token_ids) > 1 and max(token_ids) < self.vocab_size:
            try:
                text = self.stream.step(self.backend, token_ids)
            except TypeError:  # older tokenizers releases step one id at a time (the call fails before any step)
                pass
            else:
                if text is None:
                    return self._before_partial(token_ids)
                self._note(token_ids, text)
                return text
        return "".join(map(self.decode, token_ids))

    def _before_partial(self, token_ids: list[int]) -> str:
        """The ids end inside a character or in invalid bytes, and the library held back all of their text, where
        one at a time gives the text up to the last id that ended a character: found from the end, then stepped
        to in one call from a fresh stream in the same context (the held ids stepped again)."""
        shown, held = ([token_id for token_id in ids if token_id < self.vocab_size] for ids in (self.shown, self.held))
        context = shown + held + token_ids
        whole = next(
            (n for n in range(len(token_ids) - 1, 0, -1) if self._ends_a_character(context[: -len(token_ids) + n])), 0
        )
        if whole == 0:  # no text yet: the stream holds them, as one at a time
            self._note(token_ids, "")
            return ""
        self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        if shown:
            self.stream.step(self.backend, shown)
        text = self.stream.step(self.backend, held + token_ids[:whole]) or ""
        self.stream.step(self.backend, token_ids[whole:])
        self._note(token_ids[:whole], text)
        self._note(token_ids[whole:], "")
        return text

    def _ends_a_character(self, ids: list[int]) -> bool:
        """Whether these ids' text ends with a whole character: read from their last CHARACTER_TOKENS only."""
        return not self.backend.decode(ids[-CHARACTER_TOKENS:], skip_special_tokens=self.skip_special_tokens).endswith(
            "\ufffd"
        )

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
    seq.text += seq.detokenizer.decode_all(seq.token_ids[seq.num_decoded :])
    seq.num_decoded = len(seq.token_ids)
    return len(seq.text) - before


def append_token(seq: Sequence, token: int, entry: tuple | None, logprob: float):
    """Records a sampled token on its sequence (ids, its LogprobRow, and text where a check reads it); returns why
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
    if len(seq.token_ids) >= seq.length_limit:
        return "length", None
    return None


def report_due(request: Request, interval: int) -> bool:
    """Whether a streamed request is reported now (--stream-interval): its first tokens at once (the time to the
    first token is the same), then whenever a sample has `interval` unreported tokens or has finished."""
    if interval == 1 or not request.prompt_sent:
        return True
    for seq in request.sequences:
        unsent = len(seq.token_ids) - seq.num_prompt_tokens - seq.sent_tokens
        if unsent >= interval or (unsent and seq.finish_reason is not None):
            return True
    return False


def request_delta(request: Request, final: bool) -> tuple:
    """What the request's samples gained since its last report, as a RequestDelta's plain tuple: ids, logprob
    rows, how they finished. Text is the assembler's (OutputAssembler), wherever the caller is: this is all
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


def record_prompt_logprobs(batch: ScheduledBatch, scored: dict[int, tuple]) -> None:
    """The prompt log-probabilities a step scored (batch index -> chosen, ranks, top ids, top values), appended
    to their requests' as LogprobRow tuples."""
    for index, (chosen, ranks, top_ids, top_values) in scored.items():
        seq = batch.seqs[index]
        targets = seq.token_ids[len(seq.request.prompt_logprobs) :][: chosen.numel()]
        # tuples, as the sampled tokens' rows (LLMEngine._record_samples says why)
        top_ids = map(tuple, top_ids.tolist()) if top_ids is not None else [()] * len(targets)
        top_values = map(tuple, top_values.tolist()) if top_values is not None else [()] * len(targets)
        seq.request.prompt_logprobs += zip(targets, chosen.tolist(), ranks.tolist(), top_ids, top_values)
