"""`fovea serve`: vLLM's flag names, grouped; builds the engine and runs uvicorn."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
from pathlib import Path

from fovea.config.vllm_args import VLLM_ONLY_ARGS, max_model_len_arg


def _json_arg(text: str) -> dict:
    """A JSON object, or vLLM's older key=value[,key=value] form with integer values (image=4)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        pairs = [item.partition("=") for item in text.split(",")]
        if not all(sep and number.strip().isdigit() for _, sep, number in pairs):
            raise argparse.ArgumentTypeError(f"not valid JSON ({exc}) nor key=value pairs") from None
        return {key.strip(): int(number) for key, _, number in pairs}
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the embedded demo model)",
                           formatter_class=DefaultsShown)
    serve.add_argument("model", nargs="?", default=None,
                       help="model directory or hub id (downloaded unless HF_HUB_OFFLINE is set)")
    serve.add_argument("--model", dest="model_flag", default=None, help="the model, as vLLM's older flag")
    net = serve.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1",
                     help="address to listen on: this machine only unless --host 0.0.0.0 (vLLM listens on every "
                          "address)")
    net.add_argument("--port", type=int, default=8000, help="port to listen on")
    net.add_argument("--served-model-name", nargs="+", default=None, help="names clients may use (several allowed)")
    net.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1 routes (else the VLLM_API_KEY variable's)")
    net.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    net.add_argument("--chat-template-content-format", default="auto", choices=["auto", "string", "openai"],
                     help="message content as a string or as a list of parts; auto: read off the template")
    net.add_argument("--trust-request-chat-template", action="store_true",
                     help="accept chat_template in requests (rendered in sandboxed worker processes)")
    net.add_argument("--uvicorn-log-level", default="info",
                     choices=["critical", "error", "warning", "info", "debug", "trace"], help="the HTTP server's log")
    net.add_argument("--disable-log-requests", action="store_true", help="no access log")
    net.add_argument("--enable-log-requests", action="store_true", help="log each request's id, length, parameters")
    net.add_argument("--response-role", default="assistant", help="role of the chat completion's message")
    net.add_argument("--enable-auto-tool-choice", action="store_true",
                     help='tool_choice "auto": calls found in the answer (needs --tool-call-parser)')
    net.add_argument("--tool-call-parser", default=None, help="how calls are written: hermes (Qwen2.5's format)")
    net.add_argument("--root-path", default="", help="path prefix when behind a proxy that strips it")
    net.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key (and --ssl-certfile)")
    net.add_argument("--ssl-certfile", default=None, help="the certificate for --ssl-keyfile")
    net.add_argument("--max-request-body-mb", type=int, default=64, help="larger bodies get 413 (fovea only)")
    net.add_argument("--max-engine-restarts", type=int, default=3,
                     help="engine processes restarted after dying within 10 minutes before the server exits "
                          "non-zero (fovea only)")
    media = serve.add_argument_group("images")
    media.add_argument("--limit-mm-per-prompt", type=_json_arg, default=None, help='e.g. {"image": 4}')
    media.add_argument("--mm-processor-kwargs", type=_json_arg, default=None,
                       help='e.g. {"min_pixels": 3136, "max_pixels": 1003520}')
    media.add_argument("--mm-processor-workers", type=int, default=None,
                       help="processes that decode and resize images (default: one per core, at most 8; 0: in "
                            "the front end's threads)")
    media.add_argument("--allowed-local-media-path", default=None, help="file:// image URLs are allowed below it")
    media.add_argument("--allowed-media-domains", nargs="+", default=None,
                       help="the only hosts http(s) images may come from")
    engine = serve.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32", "half", "float"],
                        help="weights and activations; auto: the checkpoint's (bf16 for fp32 ones on a GPU)")
    engine.add_argument("--max-model-len", type=max_model_len_arg, default=None,
                        help="tokens per sequence: 32768, 32k (32000), 32K (32768), or auto (the model's own, "
                             "shortened to what the KV cache holds)")
    engine.add_argument("--max-num-seqs", type=int, default=256, help="sequences running at once")
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="tokens per engine step (prompts are chunked to fit)")
    engine.add_argument("--max-num-encoder-input-tokens", type=int, default=None,
                        help="image tokens handed to the vision encoder per step (default: max-num-batched-tokens)")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="this engine's share of the GPU's memory (weights, activations, KV cache)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV cache of prompt prefixes (images included) seen before")
    engine.add_argument("--seed", type=int, default=0, help="seed of requests that set none")
    add_fast_path_args(engine)
    parallel = serve.add_argument_group("parallelism")
    parallel.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs (ranks) per engine")
    parallel.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                          help="engine replicas behind this server, each --tensor-parallel-size GPUs")
    parallel.add_argument("--mm-encoder-tp-mode", default="weights", choices=["weights", "data"],
                          help="vision tower split over the ranks (weights) or whole on each, images shared out (data)")
    parallel.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                          help="ranks and replicas as local processes (mp, default) or actors on a running Ray cluster")
    engine.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="KV-cache blocks, instead of the memory profile's count")
    engine.add_argument("--generation-config", default="auto",
                        help="auto: sampling defaults from the checkpoint's generation_config.json; vllm: none; "
                             "or a directory holding one")
    engine.add_argument("--max-logprobs", type=int, default=20, help="most logprobs a request may ask for")
    hub = serve.add_argument_group("hub")
    hub.add_argument("--revision", default=None, help="branch, tag or commit of a hub id")
    hub.add_argument("--download-dir", default=None, help="Hugging Face cache directory for hub ids")
    hub.add_argument("--tokenizer", default=None, help="must be the model's own (a separate one is not supported)")
    add_vllm_only_args(serve.add_argument_group("vLLM flags kept for launch lines (see fovea/config/vllm_args.py)"))
    serve.set_defaults(func=run_serve)


class DefaultsShown(argparse.HelpFormatter):
    """Every flag's help ends with its default, as vLLM's does."""

    def _get_help_string(self, action):
        switch_off = action.nargs == 0 and action.default in (None, False)  # a switch: off unless given
        if not action.option_strings or "(default" in action.help or action.default is argparse.SUPPRESS \
                or switch_off:
            return action.help
        return action.help + (" (default: none)" if action.default is None else " (default: %(default)s)")


def add_vllm_only_args(group) -> None:
    """Accepted so that vLLM launch lines run: they change nothing here, or fail naming what is not implemented."""
    only = "only this value; others fail naming what is missing"
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help=only)
    group.add_argument("--kv-cache-dtype", default="auto", help=only)
    group.add_argument("--load-format", default="auto", help="auto or safetensors")
    group.add_argument("--quantization", "-q", default=None, help="none yet: any value fails naming what is missing")
    group.add_argument("--tokenizer-mode", default="auto", help="auto or hf")
    group.add_argument("--mm-processor-cache-gb", type=float, default=None, help="0 only (no such cache yet)")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                       help="accepted and logged: long prompts are always chunked")
    for flag in ("--trust-remote-code", "--disable-log-stats", "--disable-frontend-multiprocessing",
                 "--disable-custom-all-reduce", "--disable-mm-preprocessor-cache"):
        group.add_argument(flag, action="store_true", default=None,  # None: not given, nothing to log
                           help="accepted and logged: changes nothing here")


def add_fast_path_args(group) -> None:
    """GPU fast-path flags, shared by `fovea serve` and the offline benchmarks."""
    group.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                       help="auto: our Triton kernels on CUDA, the PyTorch reference elsewhere")
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    group.add_argument("--mm-buckets", default=None, help="vision encoder patch-count buckets, e.g. 1024,4096,16384")
    group.add_argument("--skip-warmup", action="store_true", help="capture encoder buckets on first use")
    group.add_argument("--fp32-softmax", action="store_true", help="language-model attention softmax in fp32")
    group.add_argument("--fp32-softmax-vision", action="store_true", help="vision-tower attention softmax in fp32")


def fast_path_args(args: argparse.Namespace) -> dict:
    names = ["attention_backend", "enforce_eager", "mm_buckets", "skip_warmup", "fp32_softmax", "fp32_softmax_vision"]
    return {name: getattr(args, name) for name in names}


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
    where = "this machine only; --host 0.0.0.0 serves others" if host in ("127.0.0.1", "localhost", "::1") else host
    print(f"fovea serve: listening on {host}:{port} ({where}); the model loads next", file=sys.stderr, flush=True)
    return server_socket


def run_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from fovea.frontend.async_llm import AsyncLLM
    from fovea.server.app import ServerOptions, build_app
    from fovea.server.media import MediaPolicy
    from fovea.server.tool_calls import PARSERS

    if args.model_flag is not None:
        if args.model is not None and args.model != args.model_flag:
            sys.exit(f"fovea serve: two models given ({args.model} and --model {args.model_flag})")
        args.model = args.model_flag
    dtype = {"half": "float16", "float": "float32"}.get(args.dtype, args.dtype)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        sys.exit("fovea serve: --enable-auto-tool-choice requires --tool-call-parser")
    if args.tool_call_parser is not None and args.tool_call_parser not in PARSERS:
        sys.exit(f"fovea serve: tool call parser {args.tool_call_parser!r} is not implemented; available: "
                 f"{', '.join(PARSERS)}")
    template = args.chat_template
    if template and Path(template).is_file():
        template = Path(template).read_text()
    elif template and not any(char in template for char in "{}\n"):  # vLLM's test: a template has one of these
        sys.exit(f"fovea serve: --chat-template {template!r} names no file, and is not a template either")
    server_socket = bind(args.host, args.port)  # a busy port fails now, not after the model has loaded
    vllm_only = [name for name in VLLM_ONLY_ARGS if hasattr(args, name)]  # the ones add_vllm_only_args declared
    names = ["max_num_seqs", "max_num_batched_tokens", "max_num_encoder_input_tokens", "block_size",
             "gpu_memory_utilization", "enable_prefix_caching", "limit_mm_per_prompt", "mm_processor_kwargs",
             "mm_processor_workers", "seed", "tensor_parallel_size", "data_parallel_size", "mm_encoder_tp_mode",
             "distributed_executor_backend", "num_gpu_blocks_override", "generation_config", "max_logprobs",
             "revision", "download_dir", "tokenizer", "max_model_len", *vllm_only]
    try:
        engine = AsyncLLM.from_args(args.model, max_restarts=args.max_engine_restarts, dtype=dtype,
                                    **{name: getattr(args, name) for name in names}, **fast_path_args(args))
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"fovea serve: {error}")
    try:
        policy = MediaPolicy(Path(args.allowed_local_media_path) if args.allowed_local_media_path else None,
                             [d.lower() for d in args.allowed_media_domains or []])
        api_key = args.api_key or os.environ.get("VLLM_API_KEY")  # vLLM's variable
        options = ServerOptions(args.served_model_name or [args.model or "fovea-demo"], api_key, template,
                                args.chat_template_content_format, policy, args.max_request_body_mb << 20,
                                trust_request_chat_template=args.trust_request_chat_template,
                                response_role=args.response_role, log_requests=args.enable_log_requests,
                                tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None)
        app = build_app(engine, options)
        server = uvicorn.Server(uvicorn.Config(app, log_level=args.uvicorn_log_level, root_path=args.root_path,
                                               ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                                               access_log=not args.disable_log_requests, timeout_graceful_shutdown=30))
        # an engine that cannot be brought back: stop serving and exit non-zero rather than answer 503 forever
        engine.on_fatal = lambda: setattr(server, "should_exit", True)
        # uvicorn finishes in-flight requests on SIGTERM, then re-raises the signal under the handler found at
        # start; a no-op one turns that into a normal exit (status 0) after the engine is shut down below.
        signal.signal(signal.SIGTERM, lambda *_: None)
        server.run(sockets=[server_socket])
        if app.state.template_sandbox is not None:
            app.state.template_sandbox.close()
    finally:
        engine.shutdown()
    if engine.error is not None:
        sys.exit(f"fovea serve: {engine.error}")
