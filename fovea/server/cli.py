"""`fovea serve`: vLLM's flag names, grouped; builds the engine and runs uvicorn."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from fovea.config.flags import add_engine_flags, add_vllm_only_flags, engine_kwargs, json_arg, lora_module_arg


def with_config_file(serve: argparse.ArgumentParser, path: str) -> None:
    """vLLM's `--config FILE`: a YAML mapping of serve's flags (dashes or underscores, no leading --) to values,
    which become the flags' defaults, so that the command line's own flags win. A key that is no flag fails."""
    import yaml

    try:
        values = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"--config {path}: {error}") from None
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a mapping of flags to values")
    actions = {action.dest: action for action in serve._actions if action.dest not in ("help", "config")}
    unknown = sorted(str(key) for key in values if str(key).replace("-", "_") not in actions)
    if unknown:
        raise ValueError(f"--config {path}: {unknown} are not flags of fovea serve")
    defaults = {}
    for key, value in values.items():
        action = actions[str(key).replace("-", "_")]
        if isinstance(value, list) and action.type is not None:  # (a string is converted by argparse itself)
            try:
                value = [action.type(v if isinstance(v, str) else json.dumps(v)) for v in value]
            except (argparse.ArgumentTypeError, ValueError) as error:
                raise ValueError(f"--config {path}: {key}: {error}") from None
        defaults[action.dest] = value
    serve.set_defaults(**defaults)


def add_serve_parser(sub) -> None:
    serve = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (default: the embedded demo model)", formatter_class=DefaultsShown
    )
    serve.add_argument(
        "model", nargs="?", default=None, help="model directory or hub id (downloaded unless HF_HUB_OFFLINE is set)"
    )
    serve.add_argument("--model", dest="model_flag", default=None, help="the model, as vLLM's older flag")
    serve.add_argument(
        "--config",
        default=None,
        help="a YAML file of these flags (model: ..., max-model-len: 32k, ...), as vLLM's; the command line's win",
    )
    net = serve.add_argument_group("server")
    net.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on: this machine only unless --host 0.0.0.0 (vLLM listens on every address)",
    )
    net.add_argument("--port", type=int, default=8000, help="port to listen on")
    net.add_argument("--uds", default=None, help="listen on this Unix domain socket instead of --host/--port")
    net.add_argument(
        "--log-config-file",
        default=os.environ.get("VLLM_LOGGING_CONFIG_PATH"),
        help="a JSON logging configuration (logging.config.dictConfig's) for fovea's and uvicorn's loggers "
        "(else the VLLM_LOGGING_CONFIG_PATH variable's)",
    )
    net.add_argument("--served-model-name", nargs="+", default=None, help="names clients may use (several allowed)")
    net.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (else the VLLM_API_KEY variable's)",
    )
    net.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    net.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=["auto", "string", "openai"],
        help="message content as a string or as a list of parts; auto: read off the template",
    )
    net.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept chat_template in requests (rendered in sandboxed worker processes)",
    )
    net.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="the HTTP server's log",
    )
    net.add_argument("--disable-log-requests", action="store_true", help="no access log")
    net.add_argument("--enable-log-requests", action="store_true", help="log each request's id, length, parameters")
    net.add_argument(
        "--enable-log-outputs",
        action="store_true",
        help="with --enable-log-requests, also log each request's output text (up to --max-log-len characters)",
    )
    net.add_argument("--response-role", default="assistant", help="role of the chat completion's message")
    net.add_argument(
        "--default-chat-template-kwargs",
        type=json_arg,
        default=None,
        help="chat template variables for every request, under its own chat_template_kwargs, e.g. "
        "'{\"enable_thinking\": false}'",
    )
    net.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='requests with tool_choice "none" render the chat template without their tools',
    )
    net.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprobs name their tokens token_id:N unless a request's return_tokens_as_token_ids says otherwise",
    )
    net.add_argument(
        "--enable-request-id-headers", action="store_true", help="responses carry X-Request-Id (the request's own)"
    )
    net.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="GET /tokenizer_info: the tokenizer's settings (tokenizer_config.json's, no file paths) and chat template",
    )
    net.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    net.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log")
    net.add_argument(
        "--disable-access-log-for-endpoints",
        type=lambda text: [path.strip() for path in text.split(",") if path.strip()],
        default=[],
        help="paths left out of the access log, comma-separated, e.g. /health,/metrics",
    )
    net.add_argument(
        "--max-log-len", type=int, default=1000, help="characters of a request's parameters in its log line"
    )
    net.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="accepted: /load always reports the requests in flight",
    )
    net.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="streams carry the usage in every chunk and after the last, whatever the request's stream_options",
    )
    net.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": calls found in the answer (needs --tool-call-parser)',
    )
    net.add_argument("--tool-call-parser", default=None, help="how calls are written: hermes (Qwen2.5's format)")
    net.add_argument("--root-path", default="", help="path prefix when behind a proxy that strips it")
    net.add_argument(
        "--allowed-origins",
        type=json_list,
        default=[],
        help="web pages (origins, as JSON: '[\"https://app.example\"]', or '[\"*\"]') that may call the API from a "
        "browser; others are refused (vLLM allows any by default)",
    )
    net.add_argument("--allowed-methods", type=json_list, default=["*"], help="CORS methods for --allowed-origins")
    net.add_argument("--allowed-headers", type=json_list, default=["*"], help="CORS headers for --allowed-origins")
    net.add_argument("--allow-credentials", action="store_true", help="CORS credentials for --allowed-origins")
    net.add_argument(
        "--allowed-hosts",
        type=json_list,
        default=None,
        help="Host header names served, as JSON; on a loopback --host only this machine's names by default (a "
        "page that rebinds its name to 127.0.0.1 is refused); a proxy that passes its own name lists it, '[\"*\"]' "
        "any (fovea only)",
    )
    net.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key (and --ssl-certfile)")
    net.add_argument("--ssl-certfile", default=None, help="the certificate for --ssl-keyfile")
    net.add_argument("--ssl-ca-certs", default=None, help="CA certificates for client certificates (uvicorn's)")
    net.add_argument("--ssl-cert-reqs", type=int, default=0, help="whether client certificates are required (ssl)")
    net.add_argument("--ssl-ciphers", default="TLSv1", help="cipher suites for TLS 1.2 and below (uvicorn's)")
    net.add_argument(
        "--h11-max-incomplete-event-size", type=int, default=None, help="largest request head in bytes (uvicorn's)"
    )
    net.add_argument("--disable-playground", action="store_true", help="no chat page at / and /playground (fovea only)")
    net.add_argument("--max-request-body-mb", type=int, default=64, help="larger bodies get 413 (fovea only)")
    net.add_argument(
        "--max-engine-restarts",
        type=int,
        default=3,
        help="engine processes restarted after dying within 10 minutes before the server exits non-zero (fovea only)",
    )
    media = serve.add_argument_group("media policy")
    media.add_argument("--allowed-local-media-path", default=None, help="file:// image URLs are allowed below it")
    media.add_argument(
        "--allowed-media-domains", nargs="+", default=None, help="the only hosts http(s) images may come from"
    )
    groups = add_engine_flags(serve)
    groups["lora"].add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module_arg,
        default=[],
        help='adapters served as models: name=path, or {"name": ..., "path": ..., "base_model_name": ...} '
        "(needs --enable-lora)",
    )
    add_vllm_only_flags(serve)
    serve.set_defaults(func=run_serve)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")  # as Host headers name them


def json_list(text: str) -> list[str]:
    """vLLM's form of --allowed-origins and its kin: a JSON list of strings."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}); a list, e.g. '[\"https://app.example\"]'") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError("must be a JSON list of strings")
    return value


class DefaultsShown(argparse.HelpFormatter):
    """Every flag's help ends with its default, as vLLM's does."""

    def _get_help_string(self, action):
        switch_off = action.nargs == 0 and action.default in (None, False)  # a switch: off unless given
        if not action.option_strings or "(default" in action.help or action.default is argparse.SUPPRESS or switch_off:
            return action.help
        return action.help + (" (default: none)" if action.default is None else " (default: %(default)s)")


class QuietPaths(logging.Filter):
    """--disable-access-log-for-endpoints: uvicorn's access lines for these paths (their query aside) are dropped."""

    def __init__(self, paths: list[str]):
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        path = args[2] if len(args) > 2 and isinstance(args[2], str) else ""  # (client, method, path, ...)
        return path.split("?", 1)[0] not in self.paths


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_socket = socket.socket(family, socket.SOCK_STREAM)
    server_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server_socket.bind((host, port))
    except OSError as error:
        sys.exit(f"fovea serve: cannot listen on {host}:{port}: {error.strerror}")
    server_socket.listen(2048)
    server_socket.set_inheritable(True)
    where = "this machine only; --host 0.0.0.0 serves others" if host in LOOPBACK_HOSTS else host
    print(f"fovea serve: listening on {host}:{port} ({where}); the model loads next", file=sys.stderr, flush=True)
    return server_socket


def bind_unix(path: str) -> socket.socket:
    """--uds: a Unix domain socket at `path` (a stale socket file there is replaced; any other file is not)."""
    import stat

    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            sys.exit(f"fovea serve: --uds {path} exists and is not a socket")
        os.unlink(path)
    server_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server_socket.bind(path)
    except OSError as error:
        sys.exit(f"fovea serve: cannot listen on {path}: {error.strerror}")
    server_socket.listen(2048)
    server_socket.set_inheritable(True)
    print(f"fovea serve: listening on unix:{path}; the model loads next", file=sys.stderr, flush=True)
    return server_socket


def logging_config(path: str | None) -> dict | None:
    """--log-config-file: the JSON dictConfig, applied now (fovea's loggers) and handed to uvicorn (its own)."""
    if not path:
        return None
    from fovea import apply_logging_config

    try:
        config = apply_logging_config(path)
    except ValueError as error:
        sys.exit(f"fovea serve: --log-config-file {error}")
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(Path(path).resolve())  # the engine processes read it at import
    return config


def run_serve(args: argparse.Namespace) -> None:
    from fovea.core.memory import freeze_startup_heap, watch_memory

    watch_memory("the front end")  # before any thread starts: the arenas' bound holds for threads started later
    import uvicorn

    from fovea.frontend.async_llm import AsyncLLM
    from fovea.multimodal.prompt import RESERVED_TEMPLATE_KWARGS
    from fovea.server.app import ServerOptions, build_app
    from fovea.server.errors import APIError
    from fovea.server.media import MediaPolicy
    from fovea.server.tool_calls import PARSERS

    if args.model_flag is not None:
        if args.model is not None and args.model != args.model_flag:
            sys.exit(f"fovea serve: two models given ({args.model} and --model {args.model_flag})")
        args.model = args.model_flag
    if args.enable_log_outputs and not args.enable_log_requests:
        sys.exit("fovea serve: --enable-log-outputs requires --enable-log-requests")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(args.default_chat_template_kwargs or {}))
    if reserved:
        sys.exit(f"fovea serve: --default-chat-template-kwargs may not set {reserved}: they are request fields")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        sys.exit("fovea serve: --enable-auto-tool-choice requires --tool-call-parser")
    if args.tool_call_parser is not None and args.tool_call_parser not in PARSERS:
        sys.exit(
            f"fovea serve: tool call parser {args.tool_call_parser!r} is not implemented; available: "
            f"{', '.join(PARSERS)}"
        )
    template = args.chat_template
    if template and Path(template).is_file():
        template = Path(template).read_text()
    elif template and not any(char in template for char in "{}\n"):  # vLLM's test: a template has one of these
        sys.exit(f"fovea serve: --chat-template {template!r} names no file, and is not a template either")
    log_config = logging_config(args.log_config_file)
    # a busy port fails now, not after the model has loaded
    server_socket = bind_unix(args.uds) if args.uds else bind(args.host, args.port)
    try:
        engine = AsyncLLM.from_args(args.model, max_restarts=args.max_engine_restarts, **engine_kwargs(args))
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"fovea serve: {error}")
    try:
        policy = MediaPolicy(
            Path(args.allowed_local_media_path) if args.allowed_local_media_path else None,
            [d.lower() for d in args.allowed_media_domains or []],
        )
        api_key = args.api_key or os.environ.get("VLLM_API_KEY")  # vLLM's variable
        options = ServerOptions(
            args.served_model_name or [args.model or "fovea-demo"],
            api_key,
            template,
            args.chat_template_content_format,
            policy,
            args.max_request_body_mb << 20,
            trust_request_chat_template=args.trust_request_chat_template,
            response_role=args.response_role,
            log_requests=args.enable_log_requests,
            max_log_len=args.max_log_len,
            force_include_usage=args.enable_force_include_usage,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            request_id_headers=args.enable_request_id_headers,
            tokenizer_info=args.enable_tokenizer_info_endpoint,
            fastapi_docs=not args.disable_fastapi_docs,
            tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
            lora_modules=args.lora_modules,
            playground=not args.disable_playground,
            allowed_origins=args.allowed_origins,
            cors=dict(
                allow_methods=args.allowed_methods,
                allow_headers=args.allowed_headers,
                allow_credentials=args.allow_credentials,
            ),
            allowed_hosts=args.allowed_hosts
            if args.allowed_hosts is not None or args.host not in LOOPBACK_HOSTS
            else sorted(LOOPBACK_NAMES),
            default_chat_template_kwargs=args.default_chat_template_kwargs or {},
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        )
        engine.log_outputs = args.enable_log_outputs and args.max_log_len
        try:
            app = build_app(engine, options)
        except (ValueError, APIError) as error:  # a --lora-modules adapter that does not fit, or a name twice
            sys.exit(f"fovea serve: {getattr(error, 'message', error)}")
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level=args.uvicorn_log_level,
                **({"log_config": log_config} if log_config else {}),
                root_path=args.root_path,
                ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile,
                ssl_ca_certs=args.ssl_ca_certs,
                ssl_cert_reqs=args.ssl_cert_reqs,
                ssl_ciphers=args.ssl_ciphers,
                h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
                access_log=not (args.disable_log_requests or args.disable_uvicorn_access_log),
                timeout_graceful_shutdown=30,
            )
        )
        if args.disable_access_log_for_endpoints:
            logging.getLogger("uvicorn.access").addFilter(QuietPaths(args.disable_access_log_for_endpoints))
        # an engine that cannot be brought back: stop serving and exit non-zero rather than answer 503 forever
        engine.on_fatal = lambda: setattr(server, "should_exit", True)
        # uvicorn finishes in-flight requests on SIGTERM, then re-raises the signal under the handler found at
        # start; a no-op one turns that into a normal exit (status 0) after the engine is shut down below.
        signal.signal(signal.SIGTERM, lambda *_: None)
        freeze_startup_heap()  # a full garbage collection no longer walks the libraries and the app
        server.run(sockets=[server_socket])
        if app.state.template_sandbox is not None:
            app.state.template_sandbox.close()
    finally:
        engine.shutdown()
        if args.uds and os.path.lexists(args.uds):
            os.unlink(args.uds)
    if engine.error is not None:
        sys.exit(f"fovea serve: {engine.error}")
