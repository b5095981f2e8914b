"""The Responses API's output (responses.py has its requests): a chat result as output items (`reasoning`,
`message` with `output_text`, `function_call`) in a response object, whole, or streamed as the openai SDK's typed
events: `response.created` and `response.in_progress`, then per output item `output_item.added`,
`content_part.added`, its deltas (`output_text.delta`, `reasoning_text.delta`, `function_call_arguments.delta`) and
their `.done`s, then `response.completed`; each event names its type and counts in `sequence_number`.
"""

from __future__ import annotations

import json
import uuid

from fovea.server import openai_serving as serving
from fovea.server.protocol import ResponsesRequest
from fovea.server.reasoning import Reasoning
from fovea.server.tool_calls import ToolCallStream


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(body: ResponsesRequest, response_id: str, model: str, output: list[dict], usage: dict,
                    finish_reason: str | None, created: int, status: str | None = None) -> dict:  # fmt: skip
    incomplete = finish_reason == "length"
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status or ("incomplete" if incomplete else "completed"),
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": model,
        "output": output,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": body.tools or [],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls,
        "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning,
        "store": body.store,
        "background": body.background,
        "metadata": body.metadata or {},
        "truncation": body.truncation or "disabled",
        "user": body.user,
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": usage.get("reasoning_tokens", 0)},
            "total_tokens": usage.get("total_tokens", 0),
        },
    }


def message_item(text: str) -> dict:
    return {
        "type": "message",
        "id": item_id("msg"),
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def reasoning_item(text: str) -> dict:
    return {
        "type": "reasoning",
        "id": item_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def call_item(call: dict) -> dict:
    function = call["function"]
    return {
        "type": "function_call",
        "id": item_id("fc"),
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"],
        "status": "completed",
    }


def output_items(message: dict) -> list[dict]:
    """A chat message's parts as output items: reasoning, then the answer's text, then each call."""
    items = [reasoning_item(message["reasoning"])] if message.get("reasoning") else []
    if message.get("content"):
        items.append(message_item(message["content"]))
    return items + [call_item(call) for call in message.get("tool_calls") or []]


def finished_turn(output: list[dict]) -> dict:
    """The assistant's turn as a chat message, for a later previous_response_id."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output
        if item["type"] == "function_call"
    ]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


class ItemEvents:
    """The events of a streamed response's output items: an item opens with its first delta of a kind (reasoning,
    text, a call) and closes with its .done events when the next opens or the answer ends."""

    def __init__(self):
        self.output: list[dict] = []  # the items so far, as they stand
        self.open: dict | None = None
        self.numbers = iter(range(1 << 62))

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": next(self.numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def feed(self, delta: dict) -> list[str]:
        """Events for one chat delta ({"reasoning"}, {"content"} or {"tool_calls"}, as choice_deltas makes)."""
        events = []
        for kind, text in (("reasoning", delta.get("reasoning")), ("message", delta.get("content"))):
            if text:
                if self.open is None or self.open["type"] != kind:
                    events += self.start(reasoning_item("") if kind == "reasoning" else message_item(""))
                self.open["content"][0]["text"] += text
                name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                extra = {"logprobs": []} if kind == "message" else {}
                events.append(self.event(name, **self.where(), content_index=0, delta=text, **extra))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):  # a call's first delta carries its id and name
                new = {"id": call["id"], "function": {"name": function.get("name", ""), "arguments": ""}}
                events += self.start(call_item(new))
            if function.get("arguments"):
                self.open["arguments"] += function["arguments"]
                events.append(
                    self.event("response.function_call_arguments.delta", **self.where(), delta=function["arguments"])
                )
        return events

    def where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def start(self, item: dict) -> list[str]:
        events = self.close()
        self.output.append(item)
        self.open = item
        events.append(
            self.event(
                "response.output_item.added", output_index=len(self.output) - 1, item={**item, "status": "in_progress"}
            )
        )
        if item["type"] != "function_call":
            part = (
                {"type": "output_text", "text": "", "annotations": []}
                if item["type"] == "message"
                else {"type": "reasoning_text", "text": ""}
            )
            events.append(self.event("response.content_part.added", **self.where(), content_index=0, part=part))
        return events

    def close(self) -> list[str]:
        if self.open is None:
            return []
        item, where, events = self.open, self.where(), []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
        else:
            part = item["content"][0]
            message = item["type"] == "message"
            kind = "response.output_text.done" if message else "response.reasoning_text.done"
            events.append(
                self.event(kind, **where, content_index=0, text=part["text"], **({"logprobs": []} if message else {}))
            )
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        self.open = None
        return events


async def stream_events(
    run, body: ResponsesRequest, response_id: str, created: int, parser: str | None, finish, count_reasoning
):
    """A streamed response: created, in_progress, the items' events, completed (or an error event). `finish`
    (a coroutine) makes and stores the final response from the items, the usage and the finish reason;
    `count_reasoning(token_ids)`: the reasoning tokens among the output's."""
    items = ItemEvents()
    tool_calls = ToolCallStream(run.tool_use) if run.tool_use and run.tool_use.choice != "none" else None
    reasoning = Reasoning(parser, run.first.prompt) if parser else None
    usage, finish_reason = serving.Usage(), None
    usage.add_prompt(run.first)
    shell = response_object(body, response_id, run.model, [], {}, None, created, status="in_progress")
    yield items.event("response.created", response=shell)
    yield items.event("response.in_progress", response=shell)
    generated: list[int] = []
    try:
        result = run.first
        while True:
            c = result.outputs[0]
            usage.completion_tokens += len(c.token_ids)
            generated += c.token_ids
            if c.text or c.finish_reason:
                deltas, finish_reason = serving.choice_deltas(c, tool_calls, reasoning)
                for delta in deltas:
                    for event in items.feed(delta):
                        yield event
            if result.finished:
                break
            result = await anext(run.stream)
        for event in items.close():
            yield event
        response = await finish(
            items.output, usage.as_dict() | {"reasoning_tokens": count_reasoning(generated)}, finish_reason
        )
        yield items.event("response.completed", response=response)
    except Exception as error:  # noqa: BLE001 - the client hears why its stream ends early
        yield serving.error_event(error)
    finally:
        await run.stream.aclose()
