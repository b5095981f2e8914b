"""The HTTP front end wired together: the routes (routes.py) over an AsyncLLM, behind the body-size and API-key
guards (guards.py), with OpenAI-shaped errors (errors.py). A request passes the guards, then its route."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from fovea import __version__
from fovea.config.flags import LoRAModule
from fovea.core.sampling_params import sampling_defaults
from fovea.frontend.async_llm import AsyncLLM
from fovea.server.errors import add_error_handlers
from fovea.server.guards import MAX_BODY_OBJECTS, APIKeyCheck, BodyLimit, RequestIdHeader, SiteCheck
from fovea.server.lora_routes import ServedAdapters
from fovea.server.lora_routes import routes as lora_routes
from fovea.server.media import MediaPolicy
from fovea.server.metrics import ServerMetrics
from fovea.server.playground import ROUTES as PLAYGROUND_ROUTES
from fovea.server.playground import SETTINGS_PATH
from fovea.server.protocol import RequestLimits
from fovea.server.responses import ROUTES as RESPONSES_ROUTES
from fovea.server.responses import ResponseStore
from fovea.server.routes import ROUTES, Served, tokenizer_info, tool_routes
from fovea.server.tool_calls import START

logger = logging.getLogger("fovea")


# what answers without the API key (as in vLLM); the playground's page asks for the key, its settings want it
PUBLIC_PATHS = {"/health", "/ping", "/load", "/version", "/metrics"}


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
    max_log_len: int = 1000  # characters of a request's parameters in its log line (--max-log-len)
    force_include_usage: bool = False  # every stream's chunks carry the usage, whatever stream_options says
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as token_id:N unless a request says otherwise
    request_id_headers: bool = False  # responses carry X-Request-Id (--enable-request-id-headers)
    fastapi_docs: bool = True  # /docs, /redoc and /openapi.json (--disable-fastapi-docs turns them off)
    tool_call_parser: str | None = None  # set with --enable-auto-tool-choice: tool_choice "auto" parses calls
    lora_modules: list[LoRAModule] = field(default_factory=list)  # --lora-modules
    playground: bool = True  # the chat page at / (--disable-playground)
    allowed_origins: list[str] = field(default_factory=list)  # web pages that may call: same-origin only by default
    cors: dict = field(default_factory=dict)  # allow_methods, allow_headers, allow_credentials for those pages
    allowed_hosts: list[str] | None = None  # Host names served (None: any), loopback names on a loopback address
    default_chat_template_kwargs: dict = field(default_factory=dict)  # under every request's chat_template_kwargs
    exclude_tools_when_tool_choice_none: bool = False  # tool_choice "none": the template is not shown the tools
    tokenizer_info: bool = False  # GET /tokenizer_info (--enable-tokenizer-info-endpoint)


def build_app(engine: AsyncLLM, options: ServerOptions) -> FastAPI:
    docs = {} if options.fastapi_docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="fovea", version=__version__, **docs)
    names = options.served_model_names or [str(engine.config.model_dir)]
    config = engine.config
    defaults = sampling_defaults(config.model_dir, config.generation_config, config.override_generation_config)
    logger.info(
        "sampling defaults for fields a request leaves out: %s",
        json.dumps(defaults)
        if defaults
        else "none" + (" (--generation-config vllm)" if config.generation_config == "vllm" else ""),
    )
    if defaults and config.generation_config == "auto":
        logger.info(
            "(from the checkpoint's generation_config.json, as vLLM does; --generation-config vllm turns them off)"
        )
    metrics = ServerMetrics(
        names[0],
        config.max_model_len,
        {
            "block_size": config.block_size,
            "cache_dtype": config.kv_cache_dtype,
            "enable_prefix_caching": config.enable_prefix_caching,
            "gpu_memory_utilization": config.gpu_memory_utilization,
        },
        max_loras=config.max_loras if config.enable_lora else 0,
    )
    metrics.update(engine.stats)
    if engine.inputs.processor_cache is not None:
        metrics.watch_processor_cache(engine.inputs.processor_cache)
    engine.on_stats = metrics.update
    sandbox = None
    if options.trust_request_chat_template:
        from fovea.server.template_sandbox import TemplateSandbox

        sandbox = TemplateSandbox(str(config.model_dir), config.max_model_len * engine.inputs.prompts.max_token_chars)
    app.state.template_sandbox = sandbox  # closed by whoever runs the app
    loras = ServedAdapters(engine.inputs.check_lora, names)
    for module in options.lora_modules:  # a bad adapter stops the start, naming it
        loras.add(module)
    app.state.served = Served(
        engine,
        options,
        names,
        defaults,
        metrics,
        sandbox,
        tag_tokens=START in engine.tokenizer.get_added_vocab(),
        started=int(time.time()),
        responses=ResponseStore(),
        loras=loras,
    )
    add_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=options.max_body_bytes, max_objects=options.max_body_objects)
    routes = ROUTES + RESPONSES_ROUTES + lora_routes() + tool_routes()
    routes += [("/tokenizer_info", "GET", tokenizer_info)] if options.tokenizer_info else []
    routes += PLAYGROUND_ROUTES if options.playground else []
    public = PUBLIC_PATHS | {path for path, _, _ in PLAYGROUND_ROUTES if path != SETTINGS_PATH}
    app.add_middleware(APIKeyCheck, api_key=options.api_key, public=frozenset(public))
    if options.allowed_origins:  # their pages' preflights are answered before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=options.allowed_origins, **options.cors)
    hosts = None if options.allowed_hosts is None or "*" in options.allowed_hosts else options.allowed_hosts
    origins = frozenset(origin.lower().rstrip("/") for origin in options.allowed_origins)
    hosts = None if hosts is None else frozenset(host.lower() for host in hosts)
    if options.request_id_headers:
        app.add_middleware(RequestIdHeader)
    app.add_middleware(SiteCheck, allowed_origins=origins, local_names=hosts)  # added last: runs first
    for path, method, route in routes:
        app.add_api_route(path, route, methods=[method])
    return app
