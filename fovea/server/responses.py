"""OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`, `POST .../cancel`) as a
translation over chat completions: the input items become chat messages (instructions as the system turn,
`input_text` / `input_image` parts, earlier `function_call` and `function_call_output` items as the assistant's
tool calls and the tool's answers), `text.format` becomes response_format, `max_output_tokens` max_tokens; the
chat result comes back as output items (`reasoning`, `message` with `output_text`, `function_call`), whole or as
the SDK's typed stream events.

`store` (default true) keeps a response, and the conversation that led to it, in memory for `GET` and for a later
request's `previous_response_id` (whose instructions are not carried over, as OpenAI does). Bounded: the newest
FOVEA_STORED_RESPONSES responses (default 1000) and FOVEA_STORED_RESPONSES_MB of their text (default 256, images
as data URLs included); older ones are forgotten first. `background` (with `store`, not streamed) answers at once
with a `queued` response and runs on without the client: `GET` shows it `in_progress` once it goes to the engine,
then `completed`, `incomplete`, `failed` (with the error) or `cancelled` (`POST .../cancel`, or `DELETE`, aborts
it); at most FOVEA_BACKGROUND_RESPONSES (256) run at once, a 429 past that.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import OrderedDict

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from fovea.server import openai_serving as serving
from fovea.server.errors import APIError
from fovea.server.protocol import ChatCompletionRequest, ResponsesRequest, invalid_body
from fovea.server.reasoning import reasoning_tokens
from fovea.server.response_items import finished_turn, output_items, response_object, stream_events
from fovea.server.routes import Served, start_chat

MAX_STORED = int(os.environ.get("FOVEA_STORED_RESPONSES", "1000"))
MAX_STORED_BYTES = int(float(os.environ.get("FOVEA_STORED_RESPONSES_MB", "256")) * 2**20)
# background responses hold no connection: what else would bound how many a client leaves running
MAX_BACKGROUND = int(os.environ.get("FOVEA_BACKGROUND_RESPONSES", "256"))


class ResponseStore:
    """Responses and their conversations by id, newest kept, within a count and a size. Kept as their JSON bytes:
    the size counted is the size held (as Python objects they took ~7x their JSON's length)."""

    def __init__(self, max_count: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.max_count, self.max_bytes = max_count, max_bytes
        self.entries: OrderedDict[str, bytes] = OrderedDict()
        self.size = 0
        self.running: dict[str, asyncio.Task] = {}  # background responses by id (touched on the event loop only)
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> None:
        kept = json.dumps([response, conversation], separators=(",", ":")).encode()
        with self._lock:
            self.size += len(kept) - len(self.entries.pop(response["id"], b""))
            self.entries[response["id"]] = kept
            while self.entries and (len(self.entries) > self.max_count or self.size > self.max_bytes):
                self.size -= len(self.entries.popitem(last=False)[1])

    def get(self, response_id: str) -> tuple[dict, list[dict]]:
        with self._lock:
            found = self.entries.get(response_id)
        if found is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", "NotFoundError", "response_id")
        response, conversation = json.loads(found)
        return response, conversation

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        with self._lock:
            entry = self.entries.pop(response_id, None)
            if entry is not None:
                self.size -= len(entry)


# ----------------------------------------------------------------------------------- request -> chat request


def as_messages(items: str | list[dict]) -> list[dict]:
    """Input items as chat messages (calls of one turn joined in one assistant message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for item in items:
        if not isinstance(item, dict):
            raise ValueError(f"each input item must be an object, got {type(item).__name__}")
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("user", "system", "assistant"):
                raise ValueError(f"an input message's role must be user, system, developer or assistant, got {role!r}")
            messages.append({"role": role, "content": content_parts(item.get("content"))})
        elif kind == "function_call":
            missing = [key for key in ("call_id", "name", "arguments") if not isinstance(item.get(key), str)]
            if missing:
                raise ValueError(f"a function_call item needs {', '.join(missing)} (strings)")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind != "reasoning":  # reasoning is not fed back, as the chat templates drop it
            raise ValueError(
                f"input items of type {kind!r} are not supported: message, function_call, function_call_output"
            )
    return messages


def content_parts(content) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("a message's content must be a string or a list of input parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image":
            if not part.get("image_url"):
                raise ValueError("an input_image needs an image_url (a URL or a data URL); file_id is not supported")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise ValueError(f"content parts of type {kind!r} are not supported: input_text, input_image")
    return parts


def chat_request(body: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request, and the conversation without the instructions (what a later previous_response_id
    continues)."""
    if body.background and (body.stream or not body.store):
        raise ValueError("background responses need store=true and are not streamed (poll GET /v1/responses/{id})")
    if (body.model_extra or {}).get("conversation") is not None:  # never accepted and ignored
        raise ValueError("conversation is not supported; continue a response with previous_response_id")
    tools = []
    for tool in body.tools or []:
        if tool.get("type") != "function":
            raise ValueError(f"tools of type {tool.get('type')!r} are not supported: function")
        tools.append(
            {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}
        )
    choice = body.tool_choice
    if choice == "auto" and not tools:  # the Responses API's default, which stands with no tools (chat's is a 400)
        choice = None
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    text_format = (body.text or {}).get("format") or {"type": "text"}
    if not isinstance(text_format, dict):
        raise ValueError('text.format must be an object such as {"type": "json_schema", ...}')
    response_format = None
    if text_format.get("type") == "json_schema":
        schema = {k: text_format[k] for k in ("name", "schema", "strict", "description") if k in text_format}
        response_format = {"type": "json_schema", "json_schema": schema}
    elif text_format.get("type") == "json_object":
        response_format = {"type": "json_object"}
    elif text_format.get("type") != "text":
        raise ValueError(f"text.format {text_format.get('type')!r} is not one of text, json_object, json_schema")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    conversation = history + as_messages(body.input)
    fields = dict(
        model=body.model,
        messages=system + conversation,
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=tools or None,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format,
        stream=body.stream,
    )
    # vLLM's sampling extras (top_k, seed, structured_outputs, chat_template_kwargs, ...) pass through as they are
    extras = {k: v for k, v in (body.model_extra or {}).items() if k in ChatCompletionRequest.model_fields}
    given = {k: v for k, v in fields.items() if v is not None}
    for name in sorted(set(extras) & set(given)):  # the chat's own name for a field the Responses API names itself
        own = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}.get(name)
        raise ValueError(f"{name} is not a Responses API field" + (f"; it is {own} here" if own else ""))
    try:
        return ChatCompletionRequest(**extras, **given), conversation
    except ValidationError as error:
        raise invalid_body(error) from None


# ------------------------------------------------------------------------------------------------- routes


async def create_response(request: Request):
    served: Served = request.app.state.served
    body = await served.read_body(request, ResponsesRequest)
    store: ResponseStore = served.responses
    history = (
        (await served.engine.run_in_pool(store.get, body.previous_response_id))[1] if body.previous_response_id else []
    )
    chat, conversation = await served.engine.run_in_pool(chat_request, body, history)
    if body.background:
        return await start_in_background(served, body, chat, conversation)
    return await respond(request, served, body, chat, conversation)


class Detached:
    """A background response's stand-in for its client, who does not wait for the answer: never gone."""

    headers: dict = {}  # (its id is the response's own)

    async def is_disconnected(self) -> bool:
        return False


async def start_in_background(served: Served, body: ResponsesRequest, chat, conversation: list[dict]) -> dict:
    """The `queued` response, stored; a task runs the request and stores how it ended (off the event loop: a
    conversation's images are stored as data URLs)."""
    store: ResponseStore = served.responses
    if len(store.running) >= MAX_BACKGROUND:
        raise APIError(
            429,
            f"{MAX_BACKGROUND} background responses are running (FOVEA_BACKGROUND_RESPONSES); retry when one ends",
            "RateLimitError",
        )
    response_id = "resp_" + serving.new_id("bg").removeprefix("bg-")
    queued = response_object(body, response_id, served.model_name(body.model), [], {}, None, int(time.time()), "queued")
    await served.engine.run_in_pool(store.put, queued, conversation)

    async def in_progress() -> None:  # prepared, and going to the engine
        await served.engine.run_in_pool(store.put, queued | {"status": "in_progress"}, conversation)

    async def run() -> None:
        ended = None
        try:
            await respond(Detached(), served, body, chat, conversation, response_id, queued["created_at"], in_progress)
        except asyncio.CancelledError:
            ended = {"status": "cancelled"}
        except Exception as error:  # noqa: BLE001 - the client reads it from the stored response
            client_side = isinstance(error, ValueError) or (isinstance(error, APIError) and error.status < 500)
            failure = {"code": "invalid_prompt" if client_side else "server_error", "message": str(error)[:1000]}
            ended = {"status": "failed", "error": failure}
        try:
            if ended is not None:
                await served.engine.run_in_pool(store.put, queued | ended, conversation)
        finally:
            store.running.pop(response_id, None)

    store.running[response_id] = asyncio.create_task(run())
    return queued


async def respond(
    client,
    served: Served,
    body: ResponsesRequest,
    chat,
    conversation: list[dict],
    response_id=None,
    created=None,
    on_start=None,
):
    """The response to `chat`, whole or streamed; `client`: the HTTP request (its leaving aborts the run);
    `on_start`: start_chat's."""
    store: ResponseStore = served.responses
    run = await start_chat(client, served, lambda: chat, "resp", on_start)
    response_id = response_id or "resp_" + run.request_id.removeprefix("resp-")
    created = created or int(time.time())

    def finish(output: list[dict], usage: dict, finish_reason: str | None) -> dict:
        response = response_object(body, response_id, run.model, output, usage, finish_reason, created)
        if body.store:
            store.put(response, conversation + [finished_turn(output)])
        return response

    parser = served.engine.config.reasoning_parser

    def count_reasoning(token_ids) -> int:
        return reasoning_tokens(parser, run.first.prompt, served.engine.tokenizer, token_ids) if parser else 0

    if body.stream:

        async def finish_off_loop(*args) -> dict:  # storing measures the conversation, images and all
            return await served.engine.run_in_pool(finish, *args)

        events = stream_events(run, body, response_id, created, parser, finish_off_loop, count_reasoning)
        return StreamingResponse(events, media_type="text/event-stream")
    await run.stream.aclose()

    def whole() -> dict:
        chat_result = serving.chat_response(
            run.first,
            run.model,
            run.request_id,
            serving.Shown(),
            "assistant",
            run.tool_use,
            served.engine.config.reasoning_parser,
        )
        choice = chat_result["choices"][0]
        usage = chat_result["usage"] | {"reasoning_tokens": count_reasoning(run.first.outputs[0].token_ids)}
        return finish(output_items(choice["message"]), usage, choice["finish_reason"])

    return await served.json_off_loop(whole)


async def get_response(request: Request, response_id: str):
    served = request.app.state.served
    return (await served.engine.run_in_pool(served.responses.get, response_id))[0]


async def stop_running(store: ResponseStore, response_id: str) -> bool:
    """Cancels a background response's run (its request is aborted; it is stored as cancelled)."""
    task = store.running.get(response_id)
    if task is None:
        return False
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return True


async def delete_response(request: Request, response_id: str):
    store = request.app.state.served.responses
    await stop_running(store, response_id)
    store.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


async def cancel_response(request: Request, response_id: str):
    store = request.app.state.served.responses
    if not await stop_running(store, response_id):
        status = store.get(response_id)[0]["status"]
        raise APIError(400, f"Only background responses still running can be cancelled; this one is {status}.")
    return store.get(response_id)[0]


ROUTES = [
    ("/v1/responses", "POST", create_response),
    ("/v1/responses/{response_id}", "GET", get_response),
    ("/v1/responses/{response_id}", "DELETE", delete_response),
    ("/v1/responses/{response_id}/cancel", "POST", cancel_response),
]
