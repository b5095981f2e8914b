"""The HTTP front end: OpenAI routes over an AsyncLLM, API key check, OpenAI-shaped errors.

A request's path: body size check -> API key -> route -> body parsed and validated (pydantic) -> sampling params
and the per-request limits (cheap checks first) -> images fetched under the media policy (their own thread pool)
-> AsyncLLM.generate (templating, tokenization and image preprocessing, then the engine process) -> response or
SSE stream (openai_serving). A client that leaves at any point cancels what is left. Work that grows with a
request (parsing its body, templating, tokenizing, images, building a whole response) runs in the preparation
pool, never on the event loop, so one large request does not hold up the others' streams and /health.
Errors become OpenAI-shaped bodies: 400 bad input, 401 key, 404 model or route, 405 method, 413 too large,
500 a failure while running the request, 503 engine down (restarting). Tracebacks go to the log, never out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from fovea import __version__
from fovea.core.sampling_params import SamplingParams, sampling_defaults
from fovea.frontend.async_llm import AsyncLLM, EngineDeadError, RequestFailed
from fovea.multimodal.fetch import ImageTooLarge
from fovea.multimodal.prompt import ChatOptions
from fovea.server import openai_serving as serving
from fovea.server.guards import MAX_BODY_OBJECTS, APIKeyCheck, BodyLimit
from fovea.server.media import MediaPolicy, fetch_media
from fovea.server.metrics import ServerMetrics
from fovea.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    InvalidBody,
    NamedToolChoice,
    RequestLimits,
    TokenizeRequest,
    error_body,
    parse_body,
    tool_list,
)
from fovea.server.tool_calls import START, ToolUse

logger = logging.getLogger("fovea")
DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there
HTTP_ERROR_KINDS = {404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestEntityTooLargeError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


@dataclass
class ServerOptions:
    served_model_names: list[str] = field(default_factory=list)
    api_key: str | None = None
    chat_template: str | None = None
    chat_template_content_format: str = "auto"  # auto, string or openai (fovea/multimodal/chat_format.py)
    media: MediaPolicy = field(default_factory=MediaPolicy)
    max_body_bytes: int = 64 << 20
    max_body_objects: int = MAX_BODY_OBJECTS  # JSON objects and arrays (FOVEA_MAX_BODY_OBJECTS)
    limits: RequestLimits = field(default_factory=RequestLimits)
    trust_request_chat_template: bool = False  # vLLM's flag: client chat templates, in the sandbox
    response_role: str = "assistant"  # the role of a chat completion's message
    log_requests: bool = False  # a log line per request: id, prompt tokens, sampling parameters
    tool_call_parser: str | None = None  # set with --enable-auto-tool-choice: tool_choice "auto" parses calls


class ClientDisconnected(Exception):
    pass


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


def build_app(engine: AsyncLLM, options: ServerOptions) -> FastAPI:
    app = FastAPI(title="fovea", version=__version__)
    names = options.served_model_names or [str(engine.config.model_dir)]
    defaults = sampling_defaults(engine.config.model_dir, engine.config.generation_config)
    logger.info("sampling defaults for fields a request leaves out: %s", json.dumps(defaults) if defaults else
                "none" + (" (--generation-config vllm)" if engine.config.generation_config == "vllm" else ""))
    if defaults and engine.config.generation_config == "auto":
        logger.info("(from the checkpoint's generation_config.json, as vLLM does; --generation-config vllm turns "
                    "them off)")
    media_limits = engine.config.limit_mm_per_prompt
    max_len = engine.config.max_model_len
    started = int(time.time())
    # the front end checks that requests' grammars compile: its compiler (seconds: it reads the whole vocabulary)
    # is made now, beside start-up, not by the first structured request
    threading.Thread(target=lambda: engine.inputs.grammars, name="grammar-compiler", daemon=True).start()
    config = engine.config
    metrics = ServerMetrics(names[0], config.max_model_len, {
        "block_size": config.block_size, "cache_dtype": "auto", "enable_prefix_caching": config.enable_prefix_caching,
        "gpu_memory_utilization": config.gpu_memory_utilization})
    metrics.update(engine.stats)
    engine.on_stats = metrics.update
    tag_tokens = START in engine.tokenizer.get_added_vocab()  # <tool_call> is one token (forced tool calls)
    sandbox = None
    if options.trust_request_chat_template:
        from fovea.server.template_sandbox import TemplateSandbox

        sandbox = TemplateSandbox(str(engine.config.model_dir), max_len * engine.inputs.prompts.max_token_chars)
    app.state.template_sandbox = sandbox  # closed by whoever runs the app

    def error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(message, kind, status, param), status_code=status)

    @app.exception_handler(APIError)
    async def on_api_error(_, exc: APIError):
        return error(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(InvalidBody)
    async def on_invalid(_, exc: InvalidBody):
        return error(400, str(exc), "BadRequestError", exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail), HTTP_ERROR_KINDS.get(exc.status_code, "BadRequestError"))

    @app.exception_handler(ValueError)
    async def on_value_error(_, exc: ValueError):
        return error(400, str(exc), "BadRequestError")

    @app.exception_handler(ImageTooLarge)
    async def on_image_too_large(_, exc: ImageTooLarge):
        return error(413, str(exc), "RequestEntityTooLargeError")

    @app.exception_handler(EngineDeadError)
    async def on_dead(_, exc: EngineDeadError):
        return error(503, str(exc), "ServiceUnavailableError")

    @app.exception_handler(RequestFailed)
    async def on_failed(_, exc: RequestFailed):
        return error(500, str(exc), "InternalServerError")

    @app.exception_handler(ClientDisconnected)
    async def on_disconnected(_, exc: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it; the request is already aborted

    @app.exception_handler(Exception)
    async def on_unexpected(_, exc: Exception):
        # a bug hit while handling this request: it fails alone (uvicorn logs the traceback), the server goes on
        return error(500, f"internal error: {type(exc).__name__}: {exc}"[:1000], "InternalServerError")

    app.add_middleware(BodyLimit, max_bytes=options.max_body_bytes, max_objects=options.max_body_objects)
    app.add_middleware(APIKeyCheck, api_key=options.api_key)  # added last: runs first

    def model_name(requested: str | None) -> str:
        if requested is None or requested in names:
            return requested or names[0]
        raise APIError(404, f"The model `{requested}` does not exist.", "NotFoundError", "model")

    def checked_params(body, tool_use: ToolUse | None = None):
        """The request's SamplingParams, after every check that needs no downloads, templating or tokens."""
        options.limits.check(body)
        params = body.to_sampling_params(defaults)
        if tool_use is not None and tool_use.forced:
            if params.structured_outputs is not None:
                raise ValueError(f"tool_choice {tool_use.choice!r} constrains the output already; drop "
                                 "response_format / structured_outputs")
            params = params.clone(structured_outputs=tool_use.structured_outputs())
        engine.inputs.check_params(params, grammar=False)  # the grammar compiles once, as the request is prepared
        return params

    def chat_params(body: ChatCompletionRequest) -> tuple[list[dict] | None, ToolUse | None, SamplingParams]:
        """The tools as the template sees them, how tool calls are handled, and the checked SamplingParams
        (run in the pool: a body of thousands of tools takes tens of milliseconds)."""
        choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
        tools = tool_list(body.tools)
        tool_use = ToolUse.from_request(tools, choice, body.parallel_tool_calls, options.tool_call_parser, tag_tokens)
        return tools, tool_use, checked_params(body, tool_use)

    def render_in_sandbox(messages: list[dict], chat: ChatOptions):
        normalized, media = engine.inputs.prompts.normalize_chat(messages, max_len, chat)
        return sandbox.render(normalized, chat), media

    async def read_body(request: Request, model):
        return await engine.run_in_pool(parse_body, await request.body(), model)

    async def json_off_loop(build, *args) -> JSONResponse:
        """A response built and rendered in the preparation pool: 8 choices x 1000 tokens x 20 top logprobs took
        seconds to build and encode, which on the event loop stalled every other client."""
        return await engine.run_in_pool(lambda: JSONResponse(build(*args)))

    def log_request(request_id: str, prompt_tokens: int, params) -> None:
        if options.log_requests:  # a 100,000-entry choice list would make one log line of megabytes
            logger.info("request %s: %d prompt tokens, %.1000s", request_id, prompt_tokens, params)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return error(503, engine.error, "ServiceUnavailableError")
        return JSONResponse({})

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": started, "owned_by": "fovea",
             "root": str(engine.config.model_dir), "max_model_len": max_len}
            for name in names]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request, ChatCompletionRequest)
        model = model_name(body.model)
        tools, tool_use, params = await engine.run_in_pool(chat_params, body)
        if body.chat_template is not None and sandbox is None:
            raise APIError(400, "chat_template in a request needs the server to run with "
                                "--trust-request-chat-template", param="chat_template")
        chat = ChatOptions(body.chat_template or options.chat_template, body.add_generation_prompt, tools,
                           body.chat_template_kwargs, options.chat_template_content_format)
        request_id = serving.new_id("chatcmpl")

        async def start():
            messages = await fetch_media(body.messages, options.media, media_limits)
            if body.chat_template is None:
                stream = engine.generate(messages=messages, sampling_params=params, request_id=request_id,
                                         mm_processor_kwargs=body.mm_processor_kwargs, chat=chat)
            else:  # a thread of its own, not the pool: it waits up to 2 s for a sandbox process
                text, media = await asyncio.to_thread(render_in_sandbox, messages, chat)
                data = {"image": media.images, "video": media.videos}
                stream = engine.generate(prompt={"prompt": text, "multi_modal_data": data},
                                         sampling_params=params, request_id=request_id,
                                         mm_processor_kwargs=body.mm_processor_kwargs)
            return stream, await anext(stream)  # bad input fails here, before any 200

        stream, first = await unless_disconnected(request, start())
        log_request(request_id, len(first.prompt_token_ids), params)
        top, role = body.top_logprobs or 0, options.response_role
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(serving.chat_stream(first, stream, model, request_id, body.n, top,
                                                         include_usage, role, tool_use),
                                     media_type="text/event-stream")
        await stream.aclose()
        return await json_off_loop(serving.chat_response, first, model, request_id, top, role, tool_use)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request, CompletionRequest)
        model = model_name(body.model)
        prompts = body.prompts(options.limits.max_prompts)
        params = await engine.run_in_pool(checked_params, body)
        request_id = serving.new_id("cmpl")

        async def start():
            requests = await engine.prepare_many(prompts, params, request_id, body.mm_processor_kwargs)
            merged = serving.merge([engine.stream(r) for r in requests])
            return merged, await anext(merged), sum(len(r.prompt_token_ids) for r in requests)

        merged, first, prompt_tokens = await unless_disconnected(request, start())
        log_request(request_id, prompt_tokens, params)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(serving.completion_stream(first, merged, model, request_id, body.n, body.logprobs,
                                                               include_usage), media_type="text/event-stream")
        try:
            finals = await unless_disconnected(request, serving.final_outputs(first, merged, len(prompts)))
        finally:
            await merged.aclose()
        return await json_off_loop(serving.completion_response, finals, model, request_id, body.n, body.echo,
                                   body.logprobs)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_body(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages")

        async def count():
            if body.messages is not None:
                messages = await fetch_media(body.messages, options.media, media_limits)
                chat = ChatOptions(options.chat_template, body.add_generation_prompt, tool_list(body.tools),
                                   body.chat_template_kwargs, options.chat_template_content_format)
                processed = await engine.run_in_pool(engine.inputs.process_chat, messages, None, chat)
                return processed.token_ids
            # the special tokens the installed tokenizer itself puts around a plain prompt (Llama's BOS; none for
            # Qwen), as a completion's prompt gets them
            return await engine.run_in_pool(engine.inputs.prompts.encode, body.prompt, max_len,
                                            body.add_special_tokens)

        tokens = await unless_disconnected(request, count())
        return {"tokens": tokens, "count": len(tokens), "max_model_len": max_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_body(request, DetokenizeRequest)
        vocab = engine.config.model.text.vocab_size
        if len(body.tokens) > max_len:
            raise APIError(400, f"at most max_model_len={max_len} token ids can be detokenized", param="tokens")
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": await engine.run_in_pool(engine.tokenizer.decode, body.tokens)}

    return app
