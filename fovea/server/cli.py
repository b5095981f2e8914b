"""`fovea serve`: vLLM's flag names, grouped; builds the engine and runs uvicorn."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

# vLLM flags accepted so launch lines work unchanged, with no effect here (reported at start-up).
IGNORED_FLAGS = ["--trust-remote-code", "--disable-log-stats", "--enable-chunked-prefill", "--disable-frontend-multiprocessing"]


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
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the embedded demo model)")
    serve.add_argument("model", nargs="?", default=None, help="model directory or hub id in the local HF cache")
    net = serve.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1")
    net.add_argument("--port", type=int, default=8000)
    net.add_argument("--served-model-name", nargs="+", default=None, help="names clients may use (several allowed)")
    net.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    net.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    net.add_argument("--trust-request-chat-template", action="store_true",
                     help="accept chat_template in requests (rendered in sandboxed worker processes)")
    net.add_argument("--uvicorn-log-level", default="info",
                     choices=["critical", "error", "warning", "info", "debug", "trace"])
    net.add_argument("--disable-log-requests", action="store_true")
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
    media.add_argument("--allowed-media-domains", nargs="+", default=None, help="the only hosts http(s) images may come from")
    engine = serve.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32", "half", "float"])
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--max-num-encoder-input-tokens", type=int, default=None,
                        help="image tokens handed to the vision encoder per step (default: max-num-batched-tokens)")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--seed", type=int, default=0)
    add_fast_path_args(engine)
    parallel = serve.add_argument_group("parallelism")
    parallel.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs (ranks) per engine")
    parallel.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                          help="engine replicas behind this server, each --tensor-parallel-size GPUs")
    parallel.add_argument("--mm-encoder-tp-mode", default="weights", choices=["weights", "data"],
                          help="vision tower split over the ranks (weights) or whole on each, images shared out (data)")
    parallel.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                          help="ranks and replicas as local processes (mp, default) or actors on a running Ray cluster")
    engine.add_argument("--num-gpu-blocks-override", type=int, default=None)
    for flag in IGNORED_FLAGS:
        engine.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    serve.set_defaults(func=run_serve)


def add_fast_path_args(group) -> None:
    """GPU fast-path flags, shared by `fovea serve` and the offline benchmarks."""
    group.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                       help="triton: our kernels (opt-in until checked on a GPU); auto: the PyTorch reference")
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    group.add_argument("--mm-buckets", default=None, help="vision encoder patch-count buckets, e.g. 1024,4096,16384")
    group.add_argument("--skip-warmup", action="store_true", help="capture encoder buckets on first use")
    group.add_argument("--fp32-softmax", action="store_true", help="language-model attention softmax in fp32")
    group.add_argument("--fp32-softmax-vision", action="store_true", help="vision-tower attention softmax in fp32")


def fast_path_args(args: argparse.Namespace) -> dict:
    names = ["attention_backend", "enforce_eager", "mm_buckets", "skip_warmup", "fp32_softmax", "fp32_softmax_vision"]
    return {name: getattr(args, name) for name in names}


def run_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from fovea.engine.async_engine import AsyncLLM
    from fovea.server.app import ServerOptions, build_app
    from fovea.server.media import MediaPolicy

    ignored = [flag for flag in IGNORED_FLAGS if getattr(args, flag.lstrip("-").replace("-", "_"))]
    if ignored:
        print(f"fovea serve: accepted and ignored: {' '.join(ignored)}", file=sys.stderr)
    dtype = {"half": "float16", "float": "float32"}.get(args.dtype, args.dtype)
    template = args.chat_template
    if template and Path(template).is_file():
        template = Path(template).read_text()
    engine = AsyncLLM.from_args(
        args.model, max_restarts=args.max_engine_restarts, dtype=dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_encoder_input_tokens=args.max_num_encoder_input_tokens, block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=args.enable_prefix_caching,
        limit_mm_per_prompt=args.limit_mm_per_prompt, mm_processor_kwargs=args.mm_processor_kwargs,
        mm_processor_workers=args.mm_processor_workers, seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
        mm_encoder_tp_mode=args.mm_encoder_tp_mode, distributed_executor_backend=args.distributed_executor_backend,
        num_gpu_blocks_override=args.num_gpu_blocks_override, **fast_path_args(args))
    try:
        policy = MediaPolicy(Path(args.allowed_local_media_path) if args.allowed_local_media_path else None,
                             [d.lower() for d in args.allowed_media_domains or []])
        options = ServerOptions(args.served_model_name or [args.model or "fovea-demo"], args.api_key, template,
                                policy, args.max_request_body_mb << 20,
                                trust_request_chat_template=args.trust_request_chat_template)
        app = build_app(engine, options)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                               log_level=args.uvicorn_log_level,
                                               access_log=not args.disable_log_requests, timeout_graceful_shutdown=30))
        # an engine that cannot be brought back: stop serving and exit non-zero rather than answer 503 forever
        engine.on_fatal = lambda: setattr(server, "should_exit", True)
        # uvicorn finishes in-flight requests on SIGTERM, then re-raises the signal under the handler found at
        # start; a no-op one turns that into a normal exit (status 0) after the engine is shut down below.
        signal.signal(signal.SIGTERM, lambda *_: None)
        server.run()
        if app.state.template_sandbox is not None:
            app.state.template_sandbox.close()
    finally:
        engine.shutdown()
    if engine.error is not None:
        sys.exit(f"fovea serve: {engine.error}")
