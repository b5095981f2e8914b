"""Engine outputs to OpenAI responses: chat completions and completions, whole or as server-sent events.

Streams follow what OpenAI sends: (chat) a first chunk with the assistant role, content deltas, a chunk carrying
each choice's finish_reason, an optional usage chunk with no choices, then `data: [DONE]`. A request that fails
mid-stream (its step failed, the engine died) sends an OpenAI-shaped `{"error": ...}` event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator

from fovea.core.request import CompletionOutput, Logprob, RequestOutput
from fovea.frontend.async_llm import EngineDeadError, RequestRefused
from fovea.server.protocol import error_body
from fovea.server.reasoning import Reasoning
from fovea.server.tool_calls import ToolCallStream, ToolUse

MAX_REQUEST_ID_CHARS = 256


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def request_ids(client, given: str | None, prefix: str) -> tuple[str, str]:
    """(the response's id, the engine's request id). vLLM's rule for the first: the prefix and the client's
    X-Request-Id header, else the body's request_id, else a random one. A client's id may repeat another's, so
    the engine's id then adds a random part of its own."""
    base = client.headers.get("x-request-id") or given
    if not base:
        made = new_id(prefix)
        return made, made
    if len(base) > MAX_REQUEST_ID_CHARS or not base.isprintable():  # (it is logged: no line breaks)
        raise ValueError(
            f"a request id (X-Request-Id or request_id) is at most {MAX_REQUEST_ID_CHARS} printable characters"
        )
    return f"{prefix}-{base}", f"{prefix}-{base}-{uuid.uuid4().hex[:8]}"


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class TextChunks:
    """A stream's commonest chunk, one choice's new text and nothing else (no logprobs, ids, usage or finish), as
    the same string `sse` makes of it, written from a template: json.dumps of the whole chunk was the largest
    part of the event loop's work per streamed token (benchmarks/README)."""

    def __init__(self, request_id: str, kind: str, created: int, model: str):
        envelope = json.dumps({"id": request_id, "object": kind, "created": created, "model": model})
        chat = kind == "chat.completion.chunk"
        self.head = f'data: {envelope[:-1]}, "choices": [{{"index": '
        self.middle = ', "delta": {"content": ' if chat else ', "text": '
        self.tail = ("}" if chat else "") + ', "logprobs": null, "finish_reason": null, "stop_reason": null}]}\n\n'

    def __call__(self, choice: int, text: str) -> str:
        return f"{self.head}{choice}{self.middle}{json.dumps(text)}{self.tail}"


def error_event(error: Exception) -> str:
    """The event that ends a stream early. The request was checked before its stream began: only the engine's
    refusal is the client's (400); any other error, a ValueError too, is the server's."""
    if isinstance(error, EngineDeadError):
        status, kind = 503, "ServiceUnavailableError"
    elif isinstance(error, RequestRefused):
        status, kind = 400, "BadRequestError"
    else:  # RequestFailed, or a bug
        status, kind = 500, "InternalServerError"
    return sse(error_body(str(error)[:1000], kind, status))


class Usage:
    def __init__(self):
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.image_tokens = 0

    def add_prompt(self, output: RequestOutput) -> None:
        self.prompt_tokens += len(output.prompt_token_ids)  # image placeholder tokens included
        self.cached_tokens += output.num_cached_tokens
        self.image_tokens += output.num_image_tokens

    def as_dict(self) -> dict:
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        # OpenAI's cached_tokens; image_tokens is fovea's (the playground shows it), present only with images
        details = {"cached_tokens": self.cached_tokens} if self.cached_tokens else {}
        if self.image_tokens:
            details["image_tokens"] = self.image_tokens
        if details:
            usage["prompt_tokens_details"] = details
        return usage


@dataclasses.dataclass(frozen=True)
class Shown:
    """What a response carries beside each choice's text, as its request asked (built once per request)."""

    logprobs: int | None = None  # top log-probabilities per token (chat: top_logprobs); None: no logprobs
    prompt_logprobs: bool = False
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's and each choice's ids
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs' tokens as token_id:N (shown_token)
    echo: str = ""  # chat: text before each reply (vLLM's echo, ChatCompletionRequest.echo_text)
    usage: tuple[bool, bool] = (False, False)  # streams: usage after the last choice, and in every chunk


class RunningUsage:
    """One prompt's usage as it streams (vLLM's continuous_usage_stats): its prompt tokens and each choice's
    tokens so far."""

    def __init__(self, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.completion_tokens: dict[int, int] = {}

    def add(self, choice: int, tokens: int) -> RunningUsage:
        self.completion_tokens[choice] = self.completion_tokens.get(choice, 0) + tokens
        return self

    def of(self, choice: int) -> dict:
        done = self.completion_tokens.get(choice, 0)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
        }


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda x: x[1].rank)
    return ranked[:k]


def shown_token(token: int, lp: Logprob, as_ids: bool) -> str:
    """A logprob entry's token: its text, or with vLLM's return_tokens_as_token_ids "token_id:N" (a token whose
    bytes are no whole character decodes to text that does not tell it apart)."""
    return f"token_id:{token}" if as_ids else lp.decoded_token or ""


def shown_logprob(lp: Logprob) -> float:
    """As vLLM sends it: -inf (a token --logprobs-mode processed_* filtered out) is no JSON number."""
    return max(lp.logprob, -9999.0)


def chat_logprobs(completion: CompletionOutput, k: int, as_ids: bool = False) -> dict | None:
    if completion.logprobs is None:
        return None

    def item(token: int, lp: Logprob) -> dict:
        text = shown_token(token, lp, as_ids)
        return {"token": text, "logprob": shown_logprob(lp), "bytes": list(text.encode())}

    content = []
    for token, entry in zip(completion.token_ids, completion.logprobs):
        content.append({**item(token, entry[token]), "top_logprobs": [item(t, lp) for t, lp in _top(entry, k)]})
    return {"content": content}


def completion_logprobs(token_ids: list[int], entries: list, k: int, text_offset: int, as_ids: bool = False) -> dict:
    """`text_offset`s are into the text, also with `as_ids`."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        offsets.append(text_offset)
        if entry is None:  # the first prompt token has no logprob
            tokens.append(f"token_id:{token}" if as_ids else "")
            token_logprobs.append(None)
            tops.append(None)
            continue
        tokens.append(shown_token(token, entry[token], as_ids))
        token_logprobs.append(shown_logprob(entry[token]))
        tops.append({shown_token(t, lp, as_ids): shown_logprob(lp) for t, lp in _top(entry, k)})
        text_offset += len(entry[token].decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(output: RequestOutput) -> list[dict | None] | None:
    """vLLM's prompt_logprobs field: per prompt token (None for the first), its and the top tokens' log-probability,
    rank and text, by token id."""
    if output.prompt_logprobs is None:
        return None
    return [
        None if entry is None else {str(token): dataclasses.asdict(value) for token, value in entry.items()}
        for entry in output.prompt_logprobs
    ]


def chat_response(
    output: RequestOutput,
    model: str,
    request_id: str,
    shown: Shown = Shown(),
    role: str = "assistant",
    tool_use: ToolUse | None = None,
    reasoning_parser: str | None = None,
) -> dict:
    """A chat completion; the prompt's token ids beside the choices (`shown.token_ids`)."""
    usage = Usage()
    usage.add_prompt(output)
    choices = []
    for c in output.outputs:
        usage.completion_tokens += len(c.token_ids)
        reasoning, text = (
            Reasoning(reasoning_parser, output.prompt).split(c.text) if reasoning_parser else (None, c.text)
        )
        message = tool_use.message(text or "", role) if tool_use else {"role": role, "content": text}
        if reasoning_parser:
            message.update(reasoning=reasoning, reasoning_content=reasoning)
        if shown.echo:
            message["content"] = shown.echo + (message.get("content") or "")
        finish = tool_use.finish_reason("tool_calls" in message, c.finish_reason) if tool_use else c.finish_reason
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": chat_logprobs(c, shown.logprobs or 0, shown.tokens_as_ids),
                "finish_reason": finish,
                "stop_reason": c.stop_reason,
                **({"token_ids": list(c.token_ids)} if shown.token_ids else {}),
            }
        )
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage.as_dict(),
        **({"prompt_logprobs": prompt_logprobs(output)} if shown.prompt_logprobs else {}),
        **({"prompt_token_ids": list(output.prompt_token_ids)} if shown.token_ids else {}),
    }


def choice_deltas(
    c: CompletionOutput, tool_calls: ToolCallStream | None, reasoning: Reasoning | None
) -> tuple[list[dict], str | None]:
    """The deltas one choice's new output makes, and its finish_reason (once it has one)."""
    thought, text = reasoning.feed(c.text, bool(c.finish_reason)) if reasoning else ("", c.text)
    deltas = [{"reasoning": thought, "reasoning_content": thought}] if thought else []
    if tool_calls is None:
        return deltas + ([{"content": text}] if text else []), c.finish_reason
    deltas += tool_calls.feed(text, bool(c.finish_reason))
    return deltas, tool_calls.tool_use.finish_reason(tool_calls.called, c.finish_reason)


async def chat_stream(
    first: RequestOutput,
    rest: AsyncIterator[RequestOutput],
    model: str,
    request_id: str,
    n: int,
    shown: Shown,
    role: str = "assistant",
    tool_use: ToolUse | None = None,
    reasoning_parser: str | None = None,
) -> AsyncIterator[str]:
    """A chat completion's chunks: the roles (with the prompt's ids, `shown.token_ids`), the echoed text, then
    each choice's deltas (with their new ids), the usage last (`shown.usage`)."""
    created = int(time.time())
    text_chunk = TextChunks(request_id, "chat.completion.chunk", created, model)
    tool_calls = {i: ToolCallStream(tool_use) for i in range(n)} if tool_use and tool_use.choice != "none" else {}
    reasoning = {i: Reasoning(reasoning_parser, first.prompt) for i in range(n)} if reasoning_parser else {}

    def chunk(choices: list[dict], usage: dict | None = None, **extra) -> str:
        body = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choices,
            **extra,
        }
        if usage is not None:
            body["usage"] = usage
        return sse(body)

    usage = Usage()
    usage.add_prompt(first)
    finished: set[int] = set()
    so_far = RunningUsage(len(first.prompt_token_ids)) if shown.usage[1] else None
    plain = so_far is None and not shown.token_ids  # chunks of text alone can come from the template
    try:
        yield chunk(
            [
                {"index": i, "delta": {"role": role, "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(n)
            ],
            None if so_far is None else so_far.of(0),
            **({"prompt_token_ids": list(first.prompt_token_ids)} if shown.token_ids else {}),
        )
        for i in range(n) if shown.echo else ():
            yield chunk(
                [{"index": i, "delta": {"content": shown.echo}, "logprobs": None, "finish_reason": None}],
                None if so_far is None else so_far.of(i),
            )
        output = first
        while True:
            for c in output.outputs:
                if c.index in finished:
                    continue
                usage.completion_tokens += len(c.token_ids)
                if so_far is not None:
                    so_far.add(c.index, len(c.token_ids))
                if c.text or c.token_ids or c.finish_reason:
                    deltas, finish = choice_deltas(c, tool_calls.get(c.index), reasoning.get(c.index))
                    if not deltas and (finish or c.logprobs or shown.token_ids):  # held back text: what else
                        deltas = [{}]
                    for k, delta in enumerate(deltas):  # logprobs, ids with the first, finish_reason with the last
                        if plain and not finish and c.logprobs is None and delta.keys() == {"content"}:
                            yield text_chunk(c.index, delta["content"])
                            continue
                        last = k == len(deltas) - 1
                        ids = {"token_ids": list(c.token_ids) if k == 0 else []} if shown.token_ids else {}
                        yield chunk(
                            [
                                {
                                    "index": c.index,
                                    "delta": delta,
                                    "logprobs": chat_logprobs(c, shown.logprobs or 0, shown.tokens_as_ids)
                                    if k == 0
                                    else None,
                                    "finish_reason": finish if last else None,
                                    "stop_reason": c.stop_reason if last else None,
                                    **ids,
                                }
                            ],
                            None if so_far is None else so_far.of(c.index),
                        )
                if c.finish_reason:
                    finished.add(c.index)
            if output.finished:
                break
            output = await anext(rest)
        if shown.usage[0]:
            yield chunk([], usage.as_dict())
    except Exception as error:  # noqa: BLE001 - the client hears why its stream ends early
        yield error_event(error)
    finally:
        await rest.aclose()  # a client that left mid-stream aborts the request here
    yield sse("[DONE]")


def completion_choice(
    output: RequestOutput,
    c: CompletionOutput,
    index: int,
    echo_text: str | None,
    shown: Shown,
    prompt_ids: bool = True,
) -> dict:
    """One choice of a completion; `echo_text`: its prompt, echoed; `prompt_ids`: the prompt's ids with it, when
    `shown.token_ids` (a stream sends them once)."""
    text = (echo_text or "") + c.text
    lp, k, as_ids = None, shown.logprobs, shown.tokens_as_ids
    if k is not None and c.logprobs is not None:
        if echo_text is not None and output.prompt_logprobs is not None:
            ids = list(output.prompt_token_ids) + list(c.token_ids)
            lp = completion_logprobs(ids, list(output.prompt_logprobs) + list(c.logprobs), k, 0, as_ids)
        else:
            lp = completion_logprobs(c.token_ids, c.logprobs, k, len(echo_text or ""), as_ids)
    return {
        "index": index,
        "text": text,
        "logprobs": lp,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        **({"prompt_logprobs": prompt_logprobs(output)} if shown.prompt_logprobs else {}),
        **({"prompt_token_ids": list(output.prompt_token_ids)} if shown.token_ids and prompt_ids else {}),
        **({"token_ids": list(c.token_ids)} if shown.token_ids else {}),
    }


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's index."""
    if len(streams) == 1:  # most completions: no task and queue hop per output
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index, stream):
        try:
            async for item in stream:
                await queue.put((index, item))
        except Exception as error:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, error))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        # a pump stops inside its stream's `anext` only once it runs again: closing a stream before then fails
        # ("asynchronous generator is already running") and hid the error that ended the merge
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def final_outputs(first, merged, num_prompts: int) -> list[RequestOutput]:
    """Every prompt's final output (from `merge`), in prompt order."""
    finals: dict[int, RequestOutput] = {}
    index, output = first
    while True:
        finals[index] = output
        if len(finals) == num_prompts:
            return [finals[i] for i in range(num_prompts)]
        index, output = await anext(merged)


def completion_response(
    finals: list[RequestOutput],
    model: str,
    request_id: str,
    n: int,
    echo_prompts: bool,
    shown: Shown = Shown(),
) -> dict:
    """The prompts' final outputs as one text_completion; choice i*n+j is prompt i's sample j."""
    usage = Usage()
    choices = []
    for i, output in enumerate(finals):
        usage.add_prompt(output)
        echo = output.prompt if echo_prompts else None
        for c in output.outputs:
            usage.completion_tokens += len(c.token_ids)
            choices.append(completion_choice(output, c, i * n + c.index, echo, shown))
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage.as_dict(),
    }


async def completion_stream(
    first,
    merged,
    model: str,
    request_id: str,
    n: int,
    shown: Shown,
    echo: bool = False,
) -> AsyncIterator[str]:
    """A completion's chunks: each choice's new text (its prompt before its first with `echo`, as vLLM's; the
    prompt's ids with its first, `shown.token_ids`), the usage last or in every chunk too (`shown.usage`: each
    prompt's own tokens and its choice's)."""
    usage = Usage()
    created = int(time.time())
    so_far: dict[int, RunningUsage] = {}  # by prompt, with usage in every chunk
    started: set[int] = set()  # choices that have had a chunk
    text_chunk = TextChunks(request_id, "text_completion", created, model)
    plain = not (shown.usage[1] or shown.token_ids or shown.prompt_logprobs)  # text alone: from the template

    def chunk(choices: list[dict], **extra) -> str:
        return sse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
                **extra,
            }
        )

    try:
        item = first
        while item is not None:
            index, output = item
            for c in output.outputs:
                usage.completion_tokens += len(c.token_ids)
                extra = {}
                if shown.usage[1]:
                    running = so_far.setdefault(index, RunningUsage(len(output.prompt_token_ids)))
                    extra["usage"] = running.add(c.index, len(c.token_ids)).of(c.index)
                choice = index * n + c.index
                if c.text or c.token_ids or c.finish_reason:  # tokens whose text is held back: their logprobs, ids
                    first_of_choice = choice not in started
                    started.add(choice)
                    echo_text = output.prompt if echo and first_of_choice else None
                    if (
                        plain
                        and echo_text is None
                        and c.finish_reason is None
                        and (c.logprobs is None or shown.logprobs is None)
                    ):
                        yield text_chunk(choice, c.text)
                        continue
                    yield chunk([completion_choice(output, c, choice, echo_text, shown, first_of_choice)], **extra)
            if output.finished:
                usage.add_prompt(output)
            item = await anext(merged, None)
        if shown.usage[0]:
            yield chunk([], usage=usage.as_dict())
    except Exception as error:  # noqa: BLE001 - the client hears why its stream ends early
        yield error_event(error)
    finally:
        await merged.aclose()
    yield sse("[DONE]")
