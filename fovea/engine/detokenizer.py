"""Token ids to text as they arrive, and stop strings.

The tokenizers library's DecodeStream does the incremental part: it holds back a token whose bytes end inside
a multi-byte UTF-8 character until the character is complete, so no stream ever shows a broken character.
Stop strings are searched in the text as it grows, including matches that span several tokens.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

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
