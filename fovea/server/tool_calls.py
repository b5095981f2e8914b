"""Tool calling in Qwen2.5's format (vLLM's `hermes` parser): the chat template lists the tools in the system
turn and the model answers `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks.

tool_choice "auto" finds such blocks in free text (needs --enable-auto-tool-choice --tool-call-parser hermes, as
in vLLM); "required" and a named function constrain the output to blocks of that format whose arguments follow
the tool's parameter schema (an llguidance grammar), so their calls always parse. The model's own format is kept
for them too (vLLM writes a bare JSON list or the arguments alone there), so the model is not asked for text it
was not trained to write. Arguments are returned as the model wrote them, streamed or not.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from fovea.core.sampling_params import StructuredOutputsParams

START, END = "<tool_call>", "</tool_call>"
PARSERS = ("hermes",)
BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|\Z)", re.S)  # the last may be open
# the model's order, name first: lets a stream send the name before the arguments are complete
NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
# the separators the chat template's tojson writes (and the model learned); no other whitespace in forced calls
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_value_end(text: str) -> int | None:
    """Where the object or array that `text` starts with ends (exclusive); None while it is still open."""
    depth, in_string, escaped = 0, False, False
    for i, char in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def parse_block(block: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one block's body, or None if it is not a call."""
    try:
        call = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    match = NAME_FIRST.match(block)
    if match and json_value_end(block[match.end() :]):
        return call["name"], block[match.end() :][: json_value_end(block[match.end() :])]
    return call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)


def written_arguments(body: str, name: re.Match) -> str | None:
    """A name-first block's arguments as far as written (never past their end), if they are an object or array."""
    arguments = body[name.end() :]
    if arguments[:1] not in ("{", "["):
        return None
    return arguments[: json_value_end(arguments) or len(arguments)]


def cut_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as far as written) of a block cut before its end whose name was written first: what a
    stream has sent of it by then."""
    name = NAME_FIRST.match(body)
    return (json.loads(name.group(1)), written_arguments(body, name) or "") if name else None


def tool_call(name: str, arguments: str) -> dict:
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


@dataclass
class ToolUse:
    """A chat request's tools and tool_choice ("none", "auto", "required" or a function name)."""

    tools: list[dict]
    choice: str
    parallel: bool = True  # parallel_tool_calls: false allows one call
    tag_tokens: bool = True  # <tool_call> is one token of the vocabulary (as in Qwen2's)

    @classmethod
    def from_request(
        cls, tools: list[dict] | None, choice, parallel: bool | None, parser: str | None, tag_tokens: bool
    ) -> ToolUse | None:
        if not tools:
            if choice not in (None, "none"):
                raise ValueError("tool_choice needs tools")
            return None
        if choice is None:
            choice = "auto"  # OpenAI's default when tools are given
        elif isinstance(choice, dict):
            choice = choice["function"]["name"]
            if choice not in [tool["function"]["name"] for tool in tools]:
                raise ValueError(f"tool_choice names function {choice!r}, which is not among the tools")
        if choice == "auto" and parser is None:
            raise ValueError(
                '"auto" tool choice requires the server to run with --enable-auto-tool-choice and --tool-call-parser'
            )
        return cls(tools, choice, parallel is not False, tag_tokens)

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """For required and named choices: only well-formed calls of the allowed tools, then the end."""
        if not self.forced:
            return None
        start, end = (START, END) if self.tag_tokens else (json.dumps(START), json.dumps(END))
        allowed = [t["function"] for t in self.tools if self.choice in ("required", t["function"]["name"])]
        rules = []
        for i, function in enumerate(allowed):
            schema = {
                "x-guidance": JSON_FORMAT,
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "name": {"const": function["name"]},
                    "arguments": function.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
            }
            rules.append(f'call_{i}: {start} "\\n" %json {json.dumps(schema)} "\\n" {end}')
        one_or_more = "call" if self.choice != "required" or not self.parallel else 'call ("\\n" call)*'
        calls = " | ".join(f"call_{i}" for i in range(len(allowed)))
        return StructuredOutputsParams(grammar="\n".join([f"start: {one_or_more}", f"call: {calls}", *rules]))

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        """The text before the first call, and the calls. Text with a closed block that does not parse is all
        content; an open last block that does not parse (cut by max_tokens) is a call as far as its name and
        arguments were written (as streamed), or left out if its name was not."""
        first = text.find(START)
        if self.choice == "none" or first < 0:
            return text, []
        blocks = list(BLOCK.finditer(text, first))
        calls = [parse_block(block.group(1)) for block in blocks]
        if calls[-1] is None and not blocks[-1].group(0).endswith(END):
            calls[-1] = cut_call(blocks[-1].group(1))
            if calls[-1] is None:
                calls.pop()
        if not calls or None in calls:
            return text, []
        return text[:first] or None, calls[: None if self.parallel else 1]

    def message(self, text: str, role: str) -> dict:
        content, calls = self.parse(text)
        message = {"role": role, "content": content}
        if calls:
            message["tool_calls"] = [tool_call(name, arguments) for name, arguments in calls]
        return message

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """As vLLM and OpenAI: "tool_calls" when calls ended the answer, except for a named function ("stop")."""
        return "tool_calls" if called and reason == "stop" and self.choice in ("auto", "required") else reason


class ToolCallStream:
    """One choice's text as OpenAI's chat deltas: content until the first <tool_call>, then per call its id and
    name once the name is complete, then its arguments piece by piece as the model writes them."""

    def __init__(self, tool_use: ToolUse):
        self.tool_use = tool_use
        self.text = ""
        self.content_sent = 0  # characters of text sent as content
        self.calls: list[list] = []  # per call: [name sent, arguments sent]
        self.closed = 0, 0  # (calls whose block has closed and been sent, where the text after them starts)

    @property
    def called(self) -> bool:
        return any(name is not None for name, _ in self.calls)

    def feed(self, piece: str, final: bool) -> list[dict]:
        """The deltas that `piece` (the text's next characters) completes; `final` flushes what was held back."""
        self.text += piece
        deltas = []
        first = self.text.find(START)
        content_end = first if first >= 0 else len(self.text) - (0 if final else self._partial_tag())
        if content_end > self.content_sent:
            deltas.append({"content": self.text[self.content_sent : content_end]})
            self.content_sent = content_end
        if first < 0:
            return deltas
        done, after = self.closed  # finished blocks are not looked at again
        for index, match in enumerate(BLOCK.finditer(self.text, max(first, after)), start=done):
            if index > 0 and not self.tool_use.parallel:
                break
            closed = match.group(0).endswith(END) or final
            deltas += [{"tool_calls": [delta]} for delta in self._call_deltas(index, match.group(1), closed)]
            if closed:
                self.closed = index + 1, match.end()
        if final and not self.called and len(self.text) > self.content_sent:
            # no call came of it (a block cut before its name, or not JSON): all of it is content, as unstreamed
            deltas.append({"content": self.text[self.content_sent :]})
            self.content_sent = len(self.text)
        return deltas

    def _partial_tag(self) -> int:
        """Characters at the end of the text that may begin a <tool_call> tag (held back until they do not)."""
        return next((n for n in range(len(START) - 1, 0, -1) if self.text.endswith(START[:n])), 0)

    def _call_deltas(self, index: int, body: str, closed: bool) -> list[dict]:
        if index == len(self.calls):
            self.calls.append([None, ""])
        sent, deltas = self.calls[index], []
        match = NAME_FIRST.match(body)
        call = parse_block(body) if closed else None
        if sent[0] is None:
            if match is None and call is None:
                return []
            sent[0] = json.loads(match.group(1)) if match else call[0]
            deltas.append({"index": index, **tool_call(sent[0], "")})
        arguments = written_arguments(body, match) if match else None
        if arguments is None:  # not streamable as written: all at once when the block closes
            arguments = call[1] if call else ""
        if len(arguments) > len(sent[1]):
            deltas.append({"index": index, "function": {"arguments": arguments[len(sent[1]) :]}})
            sent[1] = arguments
        return deltas
