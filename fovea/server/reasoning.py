"""`--reasoning-parser qwen3|deepseek_r1`: a thinking model's `<think>...</think>` part goes to the message's
reasoning field, the rest to `content` (tool calls are looked for in the rest only; structured outputs start after
it, see InputProcessor.make_request).

qwen3: the reasoning is open from the first generated token when the rendered prompt ends with `<think>` (a
thinking template opens it for the model); otherwise only when the output itself starts with `<think>` (older
templates leave the tag to the model). So an Instruct model's answer, or one asked with `chat_template_kwargs:
{"enable_thinking": false}` (the template then closes an empty think block in the prompt), is all content.
deepseek_r1 (vLLM's, for DeepSeek-R1 and QwQ-style models): open from the first token whatever the prompt, a tag
the output writes first dropped. A reasoning part that never closes (max_tokens reached) is all reasoning. The text
is sent as both `reasoning` (vLLM's current name) and `reasoning_content` (its name before, which clients still
read).
"""

from __future__ import annotations

from fovea.config.flags import REASONING_TAGS, reasoning_opened

MAX_LEAD = 256  # whitespace before the first tag past which the output is taken not to open with one


def partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` may begin `tag` (held back until they do not)."""
    return next((n for n in range(len(tag) - 1, 0, -1) if text.endswith(tag[:n])), 0)


class Reasoning:
    """One choice's text split as it arrives (`feed`) or whole (`split`), for one parser and prompt."""

    def __init__(self, parser: str, prompt: str | None):
        self.start, self.end = REASONING_TAGS[parser]
        self.opened = reasoning_opened(parser, prompt)  # by the template (or the parser): reasoning comes first
        self.state = "undecided"  # until the output's first characters show whether it starts with the tag
        self.lead = ""  # while undecided: the output's leading whitespace, held back
        self.pending = ""  # text not yet sent: a tag may be forming in it (after `lead`, while undecided)

    def feed(self, piece: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) that `piece` completes; `final` flushes what was held back. The work is that of
        `piece` and of at most a tag's length held back: never of the whole text so far."""
        reasoning = content = ""
        if self.state == "undecided":
            if not self.pending:  # still in the leading whitespace
                head = piece.lstrip()
                self.lead += piece[: len(piece) - len(head)]
                piece = head
            self.pending += piece
            if self.pending.startswith(self.start):
                self.state, self.pending, self.lead = "reasoning", self.pending[len(self.start) :], ""
            elif final or not self.start.startswith(self.pending) or len(self.lead) > MAX_LEAD:
                # a model that writes the tag itself, or no tag (nor after this much whitespace)
                self.state = "reasoning" if self.opened else "content"
                self.pending, self.lead = self.lead + self.pending, ""
        else:
            self.pending += piece
        if self.state == "reasoning":
            end = self.pending.find(self.end)
            if end >= 0:
                reasoning, self.pending = self.pending[:end], self.pending[end + len(self.end) :]
                self.state = "content"
            else:
                cut = len(self.pending) - (0 if final else partial_suffix(self.pending, self.end))
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
        if self.state == "content":
            content, self.pending = self.pending, ""
        return reasoning, content

    def split(self, text: str) -> tuple[str | None, str | None]:
        """The whole text's (reasoning, content); None where a part is empty."""
        reasoning, content = self.feed(text, final=True)
        return reasoning or None, content or None


def reasoning_tokens(parser: str, prompt: str | None, tokenizer, token_ids) -> int:
    """How many of an output's tokens are its reasoning (the Responses API's reasoning_tokens): those after an
    opening tag (or all from the start, when the prompt opened it) up to the closing tag, counted by the tags'
    own token ids; by the reasoning text's tokens where a tag is not one token."""
    start, end = REASONING_TAGS[parser]
    start_id, end_id = (tokenizer.convert_tokens_to_ids(tag) for tag in (start, end))
    ids = list(token_ids)
    if start_id is None or end_id is None or start_id == tokenizer.unk_token_id or end_id == tokenizer.unk_token_id:
        reasoning = Reasoning(parser, prompt).split(tokenizer.decode(ids))[0]
        return len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    prompted = (prompt or "").rstrip().endswith(start)
    begin = 1 if ids[:1] == [start_id] and not prompted else 0 if reasoning_opened(parser, prompt) else None
    if begin is None:
        return 0
    return ids.index(end_id, begin) - begin if end_id in ids[begin:] else len(ids) - begin
