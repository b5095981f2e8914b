"""The OpenAI routes, one function each. Each reads what the server was started with (`Served`, built once by
app.py) from `request.app.state.served`.

A chat's path: body parsed and validated (pydantic) in the preparation pool -> sampling params and the
per-request limits (cheap checks first) -> images fetched under the media policy (their own thread pool) ->
AsyncLLM.generate (templating, tokenization and image preprocessing, then the engine process) -> response or SSE
stream (openai_serving). A client that leaves at any point cancels what is left. Work that grows with a request
(parsing its body, templating, tokenizing, images, building a whole response) runs in the preparation pool, never
on the event loop, so one large request does not hold up the others' streams and /health.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from fovea import __version__
from fovea.core.messages import Profile
from fovea.core.sampling_params import SamplingParams
from fovea.frontend.async_llm import AsyncLLM
from fovea.multimodal.prompt import ChatOptions
from fovea.server import openai_serving as serving
from fovea.server.errors import APIError, ClientDisconnected, error_response
from fovea.server.media import fetch_media, media_to_fetch
from fovea.server.metrics import ServerMetrics
from fovea.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    InvocationRequest,
    NamedToolChoice,
    StreamOptions,
    TokenizeRequest,
    parse_body,
    tool_list,
)
from fovea.server.tool_calls import ToolUse

if TYPE_CHECKING:
    from fovea.server.app import ServerOptions

logger = logging.getLogger("fovea")
DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there


@dataclass
class Served:
    """What every route needs, settled at start-up."""

    engine: AsyncLLM
    options: ServerOptions
    names: list[str]  # served model names; the first is the default
    defaults: dict  # sampling fields a request leaves out (the checkpoint's generation_config)
    metrics: ServerMetrics
    sandbox: object | None  # TemplateSandbox for request chat templates (--trust-request-chat-template)
    tag_tokens: bool  # <tool_call> is one token (forced tool calls)
    started: int  # unix time, for /v1/models
    responses: object = None  # the Responses API's store (responses.py)
    loras: object = None  # ServedAdapters (lora_routes.py): LoRA adapters served as models

    @property
    def max_len(self) -> int:
        return self.engine.config.max_model_len

    def model_name(self, requested: str | None) -> str:
        if requested is None or requested in self.names or requested in self.loras.by_name:
            return requested or self.names[0]
        raise APIError(404, f"The model `{requested}` does not exist.", "NotFoundError", "model")

    def lora(self, model: str):
        """The LoRA adapter a (checked) model name stands for; None: the base model."""
        return self.loras.by_name.get(model)

    def checked_params(self, body, tool_use: ToolUse | None = None) -> SamplingParams:
        """The request's SamplingParams, after every check that needs no downloads, templating or tokens."""
        self.options.limits.check(body)
        params = body.to_sampling_params(self.defaults)
        if tool_use is not None and tool_use.forced:
            if params.structured_outputs is not None:
                raise ValueError(
                    f"tool_choice {tool_use.choice!r} constrains the output already; drop "
                    "response_format / structured_outputs"
                )
            params = params.clone(structured_outputs=tool_use.structured_outputs())
        self.engine.inputs.check_params(params, grammar=False)  # the grammar compiles once, as it is prepared
        return params

    def chat_params(self, body: ChatCompletionRequest) -> tuple[list[dict] | None, ToolUse | None, SamplingParams]:
        """The tools as the template sees them, how tool calls are handled, and the checked SamplingParams
        (run in the pool: a body of thousands of tools takes tens of milliseconds)."""
        choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
        tools = tool_list(body.tools)
        tool_use = ToolUse.from_request(
            tools, choice, body.parallel_tool_calls, self.options.tool_call_parser, self.tag_tokens
        )
        if choice == "none" and self.options.exclude_tools_when_tool_choice_none:
            tools = None  # the template does not see them (vLLM's --exclude-tools-when-tool-choice-none)
        return tools, tool_use, self.checked_params(body, tool_use)

    def template_kwargs(self, given: dict | None) -> dict | None:
        """A request's chat_template_kwargs over the server's (--default-chat-template-kwargs)."""
        return {**self.options.default_chat_template_kwargs, **(given or {})} or None

    def render_in_sandbox(self, messages: list[dict], chat: ChatOptions):
        prompts = self.engine.inputs.prompts
        # content as lists of parts: the sandbox reads the template's content format (client input) itself
        normalized, media = prompts.normalize_chat(
            messages, self.max_len, dataclasses.replace(chat, content_format="openai")
        )
        return self.sandbox.render(normalized, chat, prompts.placeholders), media

    async def read_body(self, request: Request, model):
        return await self.engine.run_in_pool(parse_body, await request.body(), model)

    async def json_off_loop(self, build, *args) -> JSONResponse:
        """A response built and rendered in the preparation pool: 8 choices x 1000 tokens x 20 top logprobs took
        seconds to build and encode, which on the event loop stalled every other client. The request was checked
        before it ran: a ValueError here is the server's failure (a 500), not the client's (STATUS makes it a 400)."""

        def respond() -> JSONResponse:
            try:
                return JSONResponse(build(*args))
            except ValueError as error:
                raise RuntimeError(f"building the response failed: {error}") from error

        return await self.engine.run_in_pool(respond)

    def shown(self, body, logprobs: int | None, echo: str = "") -> serving.Shown:
        """What the response carries beside the text, as `body` asked; return_tokens_as_token_ids and the usage
        of streams fall back on the server's flags."""
        as_ids = body.return_tokens_as_token_ids
        return serving.Shown(
            logprobs,
            body.prompt_logprobs is not None,
            body.return_token_ids,
            self.options.return_tokens_as_token_ids if as_ids is None else as_ids,
            echo,
            StreamOptions.usage(body.stream_options, self.options.force_include_usage),
        )

    def log_request(self, request_id: str, prompt_tokens: int, params) -> None:
        if self.options.log_requests:  # a 100,000-entry choice list would make one log line of megabytes
            logger.info(
                "request %s: %d prompt tokens, %s", request_id, prompt_tokens, str(params)[: self.options.max_log_len]
            )


async def unless_disconnected(request: Request, awaitable):
    """Awaits `awaitable`, unless the client leaves first: then it is cancelled, which aborts its request."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():  # the client left, or this handler itself was cancelled
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let the request's generator abort and close


async def prometheus_metrics(request: Request):
    return Response(generate_latest(request.app.state.served.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def health(request: Request):
    """503 when no engine serves; 200 otherwise, naming the data-parallel replicas that are down (restarting)."""
    engine = request.app.state.served.engine
    if engine.error is not None:
        return error_response(503, engine.error, "ServiceUnavailableError")
    down = sorted(engine.replicas_down)
    return JSONResponse({"replicas_down": down} if down else {})


async def server_load(request: Request):
    """vLLM's /load: the requests in flight, for a load balancer's choice (always counted here)."""
    return {"server_load": request.app.state.served.engine.num_requests_in_flight}


async def version():
    return {"version": __version__}


async def models(request: Request):
    served: Served = request.app.state.served
    root = str(served.engine.config.model_dir)
    cards = [(name, root, None) for name in served.names]
    cards += [(lora.lora_name, lora.lora_path, lora.base_model_name) for lora in list(served.loras.by_name.values())]
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": served.started,
                "owned_by": "fovea",
                "root": path,
                "parent": parent,
                "max_model_len": served.max_len,
            }
            for name, path, parent in cards
        ],
    }


@dataclass
class ChatRun:
    """A chat request that has started: its first output (bad input failed before it) and the rest to come."""

    body: ChatCompletionRequest
    first: object  # RequestOutput
    stream: object  # AsyncIterator[RequestOutput]
    model: str
    request_id: str
    tool_use: ToolUse | None


async def start_chat(
    request: Request,
    served: Served,
    read_chat: Callable[[], ChatCompletionRequest],
    id_prefix: str,
    on_start: Callable[[], Awaitable[None]] | None = None,
) -> ChatRun:
    """What chat completions and the Responses API share: the body (`read_chat`), params, tools, media, the
    engine's first output. One preparation-pool job reads the body, checks it and, unless it names media to
    download or brings its own chat template, makes the engine's request (template, tokens, images): a chat of
    inline images goes from the event loop to the pool and back once before it is sent. `on_start`: awaited as
    the prepared request goes to the engine (a background response is then in progress)."""
    engine, options = served.engine, served.options
    arrival = time.time()  # latencies count the preparation
    limits = engine.config.limit_mm_per_prompt

    def prepare():
        body = read_chat()
        model = served.model_name(body.model)
        response_id, request_id = serving.request_ids(request, body.request_id, id_prefix)
        tools, tool_use, params = served.chat_params(body)
        if body.chat_template is not None and served.sandbox is None:
            raise APIError(
                400,
                "chat_template in a request needs the server to run with --trust-request-chat-template",
                param="chat_template",
            )
        chat = ChatOptions(
            body.chat_template or options.chat_template,
            body.add_generation_prompt,
            tools,
            served.template_kwargs(body.chat_template_kwargs),
            options.chat_template_content_format,
            body.continue_final_message,
            body.documents,
        )
        prepared = None
        if body.chat_template is None and not media_to_fetch(body.messages, options.media, limits):
            prepared = engine.make_request(
                request_id,
                None,
                body.messages,
                params,
                body.processor_kwargs(),
                chat,
                arrival,
                0,
                served.lora(model),
                body.priority,
            )
        return body, model, tool_use, params, chat, prepared, response_id, request_id

    body, model, tool_use, params, chat, prepared, response_id, request_id = await unless_disconnected(
        request, engine.run_in_pool(prepare)
    )

    async def start():
        if prepared is not None:
            stream = engine.stream(prepared)
        elif body.chat_template is None:
            stream = engine.generate(
                messages=await fetch_media(body.messages, options.media, limits),
                sampling_params=params,
                request_id=request_id,
                mm_processor_kwargs=body.processor_kwargs(),
                chat=chat,
                lora_request=served.lora(model),
                priority=body.priority,
            )
        else:  # a thread of its own, not the pool: it waits up to 2 s for a sandbox process
            messages = await fetch_media(body.messages, options.media, limits)
            text, media = await asyncio.to_thread(served.render_in_sandbox, messages, chat)
            data = {"image": media.images, "video": media.videos}
            stream = engine.generate(
                prompt={"prompt": text, "multi_modal_data": data},
                sampling_params=params,
                request_id=request_id,
                mm_processor_kwargs=body.processor_kwargs(),
                lora_request=served.lora(model),
                priority=body.priority,
            )
        if on_start is not None:
            await on_start()
        return stream, await anext(stream)  # bad input fails here, before any 200

    stream, first = await unless_disconnected(request, start())
    served.log_request(request_id, len(first.prompt_token_ids), params)
    return ChatRun(body, first, stream, model, response_id, tool_use)


async def chat_completions(request: Request):
    served: Served = request.app.state.served
    raw = await request.body()
    run = await start_chat(request, served, lambda: parse_body(raw, ChatCompletionRequest), "chatcmpl")
    body = run.body
    role, parser = served.options.response_role, served.engine.config.reasoning_parser
    shown = served.shown(body, body.top_logprobs or 0, body.echo_text(role))
    if body.stream:
        return StreamingResponse(
            serving.chat_stream(
                run.first, run.stream, run.model, run.request_id, body.n, shown, role, run.tool_use, parser
            ),
            media_type="text/event-stream",
        )
    await run.stream.aclose()
    return await served.json_off_loop(
        serving.chat_response, run.first, run.model, run.request_id, shown, role, run.tool_use, parser
    )


async def completions(request: Request):
    served: Served = request.app.state.served
    engine = served.engine
    body = await served.read_body(request, CompletionRequest)
    model = served.model_name(body.model)
    prompts = body.prompts(served.options.limits.max_prompts)
    params = await engine.run_in_pool(served.checked_params, body)
    response_id, request_id = serving.request_ids(request, body.request_id, "cmpl")

    async def start():
        requests = await engine.prepare_many(
            prompts, params, request_id, body.processor_kwargs(), served.lora(model), body.priority
        )
        merged = serving.merge([engine.stream(r) for r in requests])
        return merged, await anext(merged), sum(len(r.prompt_token_ids) for r in requests)

    merged, first, prompt_tokens = await unless_disconnected(request, start())
    served.log_request(request_id, prompt_tokens, params)
    shown = served.shown(body, body.logprobs)
    if body.stream:
        return StreamingResponse(
            serving.completion_stream(first, merged, model, response_id, body.n, shown, body.echo),
            media_type="text/event-stream",
        )
    try:
        finals = await unless_disconnected(request, serving.final_outputs(first, merged, len(prompts)))
    finally:
        await merged.aclose()
    return await served.json_off_loop(
        serving.completion_response,
        finals,
        model,
        response_id,
        body.n,
        body.echo,
        shown,
    )


async def invocations(request: Request):
    """SageMaker's one route: a chat completion or a completion, told apart by the body (read once: the handler
    finds it cached; parsed twice, the second time by the handler)."""
    served: Served = request.app.state.served
    kind = (await served.read_body(request, InvocationRequest)).route()
    return await (chat_completions if kind == "chat" else completions)(request)


async def tokenize(request: Request):
    served: Served = request.app.state.served
    engine, options = served.engine, served.options
    body = await served.read_body(request, TokenizeRequest)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages")

    async def count():
        if body.messages is not None:
            messages = await fetch_media(body.messages, options.media, engine.config.limit_mm_per_prompt)
            chat = ChatOptions(
                options.chat_template,
                body.add_generation_prompt,
                tool_list(body.tools),
                served.template_kwargs(body.chat_template_kwargs),
                options.chat_template_content_format,
                body.continue_final_message,
            )
            processed = await engine.run_in_pool(engine.inputs.process_chat, messages, None, chat)
            return processed.token_ids
        # the special tokens the installed tokenizer itself puts around a plain prompt (Llama's BOS; none for
        # Qwen), as a completion's prompt gets them
        return await engine.run_in_pool(
            engine.inputs.prompts.encode, body.prompt, served.max_len, body.add_special_tokens
        )

    tokens = await unless_disconnected(request, count())
    return {"tokens": tokens, "count": len(tokens), "max_model_len": served.max_len}


async def detokenize(request: Request):
    served: Served = request.app.state.served
    body = await served.read_body(request, DetokenizeRequest)
    vocab = served.engine.config.model.text.vocab_size
    if len(body.tokens) > served.max_len:
        raise APIError(400, f"at most max_model_len={served.max_len} token ids can be detokenized", param="tokens")
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": await served.engine.run_in_pool(served.engine.tokenizer.decode, body.tokens)}


async def tokenizer_info(request: Request):
    """vLLM's /tokenizer_info (--enable-tokenizer-info-endpoint): the tokenizer's settings as tokenizer_config.json
    gives them (special tokens as their text; no key naming a file on this machine), its class, and the chat
    template the server applies."""
    served: Served = request.app.state.served
    engine = served.engine

    def info() -> dict:
        settings = json.loads(json.dumps(engine.tokenizer.init_kwargs, default=str))
        settings = {k: v for k, v in settings.items() if not k.endswith("_file") and k != "name_or_path"}
        template = served.options.chat_template or engine.inputs.prompts.chat_template
        return settings | {"tokenizer_class": type(engine.tokenizer).__name__, "chat_template": template}

    return await served.json_off_loop(info)


def engine_command(act: Callable) -> Callable:
    """A route that has the engine do `act(engine)` after its current step, answering 200 without waiting."""

    async def route(request: Request):
        act(request.app.state.served.engine)
        return Response(status_code=200)

    return route


def tool_routes() -> list:
    """vLLM's profiler routes where VLLM_TORCH_PROFILER_DIR names a folder for the traces (engine/profiler.py),
    and its development routes to reset the prefix and multimodal caches where VLLM_SERVER_DEV_MODE=1 (for
    benchmarks without cache hits; a prefix cache whose blocks requests hold is not reset, which is logged)."""
    from fovea.engine.profiler import profiler_dir

    routes = []
    if profiler_dir() is not None:
        routes += [
            ("/start_profile", "POST", engine_command(lambda engine: engine.tell_engines(Profile(True)))),
            ("/stop_profile", "POST", engine_command(lambda engine: engine.tell_engines(Profile(False)))),
        ]
    if os.environ.get("VLLM_SERVER_DEV_MODE", "").lower() in ("1", "true"):
        routes += [
            ("/reset_prefix_cache", "POST", engine_command(lambda engine: engine.reset_cache("prefix"))),
            ("/reset_mm_cache", "POST", engine_command(lambda engine: engine.reset_cache("mm"))),
        ]
    return routes


ROUTES = [
    ("/metrics", "GET", prometheus_metrics),
    ("/health", "GET", health),
    ("/ping", "GET", health),  # vLLM's, for load balancers and SageMaker (which POSTs)
    ("/ping", "POST", health),
    ("/load", "GET", server_load),
    ("/version", "GET", version),
    ("/v1/models", "GET", models),
    ("/v1/chat/completions", "POST", chat_completions),
    ("/v1/completions", "POST", completions),
    ("/invocations", "POST", invocations),
    ("/tokenize", "POST", tokenize),
    ("/detokenize", "POST", detokenize),
]
