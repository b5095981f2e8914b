"""`fovea bench serve`: vLLM's `bench serve` flags, workloads and result format."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path

from fovea.config.flags import add_engine_flags, add_vllm_only_flags, engine_kwargs
from fovea.engine.profiler import profiler_dir

# vLLM's --backend values for OpenAI-compatible servers, and the endpoint each speaks to
BACKEND_ENDPOINTS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}
VLLM_THROUGHPUT_FIELDS = (
    "elapsed_time",
    "num_requests",
    "total_num_tokens",
    "requests_per_second",
    "tokens_per_second",
)
SAMPLING_FLAGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks with vLLM's workloads and metric definitions")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser("serve", help="measure an OpenAI-compatible server (fovea, vLLM, ...)")
    target = serve.add_argument_group("server")
    target.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (else --host/--port)")
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=8000)
    target.add_argument(
        "--backend",
        default=None,
        choices=list(BACKEND_ENDPOINTS),
        help="openai and vllm: /v1/completions; openai-chat: /v1/chat/completions (default: the "
        "one --endpoint names, else openai)",
    )
    target.add_argument(
        "--endpoint", default=None, choices=sorted(set(BACKEND_ENDPOINTS.values())), help="default: the backend's"
    )
    target.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    target.add_argument("--served-model-name", default=None, help="the name to send, when --model is a path")
    target.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    target.add_argument("--tokenizer-mode", default="auto", choices=["auto", "hf", "slow"], help="(no effect)")
    target.add_argument("--trust-remote-code", action="store_true", help="(no effect: tokenizers only count tokens)")
    target.add_argument("--api-key", default=None)
    target.add_argument("--header", nargs="+", default=[], metavar="KEY=VALUE", help="headers on every request")
    target.add_argument("--request-id-prefix", default=None, help="requests carry x-request-id PREFIX0, PREFIX1, ...")
    target.add_argument(
        "--ready-check-timeout-sec", type=int, default=600, help="how long to wait for the server to answer (0: not)"
    )
    target.add_argument("--insecure", action="store_true", help="https without checking the server's certificate")
    target.add_argument("--lora-modules", nargs="+", default=None, help="served adapters, one named per request")
    target.add_argument("--lora-assignment", default="random", choices=["random", "round-robin"])
    add_workload_args(serve)
    load = serve.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals; 1 = Poisson")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument(
        "--ramp-up-strategy", default=None, choices=["linear", "exponential"], help="the rate from start to end"
    )
    load.add_argument("--ramp-up-start-rps", type=int, default=None)
    load.add_argument("--ramp-up-end-rps", type=int, default=None)
    load.add_argument("--ignore-eos", action="store_true", help="(random and random-mm always ignore EOS, as vLLM)")
    load.add_argument(
        "--probe-request-rate",
        type=float,
        default=0.0,
        help="one-token text requests at this rate beside the workload (outside --max-concurrency), timed apart",
    )
    sampling = serve.add_argument_group("sampling (sent only when given: else the server's defaults apply)")
    for flag, kind in (
        ("--temperature", float),
        ("--top-p", float),
        ("--top-k", int),
        ("--min-p", float),
        ("--frequency-penalty", float),
        ("--presence-penalty", float),
        ("--repetition-penalty", float),
    ):
        sampling.add_argument(flag, type=kind, default=None)
    sampling.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    sampling.add_argument("--logprobs", type=int, default=None, help="top log-probabilities asked for per token")
    sampling.add_argument("--use-beam-search", action="store_true", help="requests ask for beam search")
    load.add_argument("--num-warmups", type=int, default=0)
    load.add_argument(
        "--profile", action="store_true", help="the server profiles the run (it needs VLLM_TORCH_PROFILER_DIR set)"
    )
    out = serve.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", default=None, help="SLOs in ms: ttft:500 tpot:50 e2el:5000")
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    out.add_argument("--metric-percentiles", default="99")
    out.add_argument("--save-result", action="store_true")
    out.add_argument("--append-result", action="store_true", help="add the result as a line of the result file")
    out.add_argument("--save-detailed", action="store_true", help="also per-request lengths, times and texts")
    out.add_argument("--result-dir", default=".")
    out.add_argument("--result-filename", default=None)
    out.add_argument("--label", default=None)
    out.add_argument("--metadata", nargs="*", default=[], help="KEY=VALUE pairs stored in the result")
    out.add_argument("--disable-tqdm", action="store_true")
    out.add_argument("--plot", default=None, metavar="FILE.png", help="TTFT / ITL distributions, chunks/s over time")
    # vLLM's flags for what fovea bench does not have: refused by name (run_bench_serve says why)
    for flag in ("--plot-timeline", "--plot-dataset-stats", "--skip-tokenizer-init"):
        out.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    out.add_argument("--timeline-itl-thresholds", default=None, help=argparse.SUPPRESS)
    out.add_argument("--self-timed", action=argparse.BooleanOptionalAction, default=None, help=argparse.SUPPRESS)
    serve.set_defaults(func=run_bench_serve)

    throughput = kinds.add_parser("throughput", help="offline throughput, in process (fovea or transformers)")
    throughput.add_argument("--model", default=None, help="model directory (default: the embedded demo model)")
    throughput.add_argument(
        "--backend",
        default="fovea",
        choices=["fovea", "vllm-chat", "vllm", "hf"],
        help="fovea and vllm-chat: each prompt a chat; vllm: the prompt as it is; hf: transformers' generate",
    )
    throughput.add_argument("--compare", default=None, choices=["hf"], help="also run this backend; print both")
    throughput.add_argument("--endpoint", default="/v1/chat/completions", help=argparse.SUPPRESS)
    add_workload_args(throughput, default_prompts=64)
    # vLLM's names: --dataset for --dataset-path (its old one), --prefix-len for --random-prefix-len
    throughput.add_argument("--dataset", dest="dataset_path", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    throughput.add_argument("--prefix-len", dest="random_prefix_len", type=int, default=argparse.SUPPRESS)
    throughput.add_argument("--hf-max-batch-size", type=int, default=None, help="hf: batches of at most this many")
    throughput.add_argument("--lora-path", default=None, help="an adapter each request runs with (--enable-lora)")
    throughput.add_argument("--async-engine", action="store_true", help="(the in-process engine either way)")
    add_engine_flags(throughput)
    add_vllm_only_flags(throughput)
    add_sampling_args(throughput)
    throughput.add_argument("--output-json", default=None)
    throughput.set_defaults(func=run_bench_throughput)

    latency = kinds.add_parser("latency", help="end-to-end latency of one offline batch")
    latency.add_argument("--model", default=None, help="model directory (default: the embedded demo model)")
    latency.add_argument("--input-len", type=int, default=32)
    latency.add_argument("--output-len", type=int, default=128)
    latency.add_argument("--batch-size", type=int, default=8)
    latency.add_argument("--num-iters", type=int, default=30)
    latency.add_argument("--num-iters-warmup", type=int, default=10)
    add_engine_flags(latency)
    add_vllm_only_flags(latency)
    add_sampling_args(latency)
    latency.add_argument("--output-json", default=None)
    latency.set_defaults(func=run_bench_latency)

    mm = kinds.add_parser("mm-processor", help="image preprocessing ms/image, fovea vs transformers")
    mm.add_argument("--sizes", default="1280x720,640x480,3000x2000", help="WIDTHxHEIGHT,...")
    mm.add_argument("--iters", type=int, default=30)
    mm.add_argument("--output-json", default=None)
    mm.set_defaults(func=run_bench_mm_processor)

    kernels = kinds.add_parser("kernels", help="attention kernels against the measured bandwidth and matmul rate")
    kernels.add_argument("--out", default=None, help="write the raw rows as JSON here")
    kernels.add_argument("--quick", action="store_true", help="tiny sizes (a CPU check of the script)")
    kernels.set_defaults(func=run_bench_kernels)


def add_workload_args(
    parser,
    default_prompts: int = 1000,
    datasets=("random", "random-mm", "sharegpt", "jsonl", "custom", "hf", "prefix_repetition"),
):
    data = parser.add_argument_group("workload")
    data.add_argument("--dataset-name", default="random", choices=list(datasets))
    data.add_argument(
        "--dataset-path",
        default=None,
        help="the sharegpt JSON or jsonl file; hf: a hub dataset id or its parquet files",
    )
    data.add_argument("--num-prompts", type=int, default=default_prompts)
    data.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    data.add_argument("--output-len", type=int, default=None, help="sets every dataset's output length")
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0)
    data.add_argument("--random-prefix-len", type=int, default=0)
    data.add_argument("--random-batch-size", type=int, default=1, help="(vLLM's, for embedding models: only 1 here)")
    data.add_argument("--random-mm-base-items-per-request", type=int, default=1)
    data.add_argument("--random-mm-num-mm-items-range-ratio", type=float, default=0.0)
    data.add_argument(
        "--random-mm-limit-mm-per-prompt",
        type=json.loads,
        default=None,
        help='items per request by modality (default {"image": 255, "video": 1})',
    )
    data.add_argument(
        "--random-mm-bucket-config",
        default="{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}",
        help="{(height, width, frames): weight}; frames > 1 is a video (MP4 at 30 fps)",
    )
    data.add_argument("--sharegpt-output-len", type=int, default=None)
    data.add_argument("--custom-output-len", type=int, default=256, help="custom (jsonl): rows without output_len")
    data.add_argument("--skip-chat-template", action="store_true", help="custom: prompts sent as they are")
    data.add_argument(
        "--chat-template-kwargs",
        type=json.loads,
        default=None,
        help="custom: JSON for the chat template, e.g. thinking",
    )
    repetition = {"prefix-len": 256, "suffix-len": 256, "num-prefixes": 10, "output-len": 128}  # vLLM's defaults
    for name, value in repetition.items():
        data.add_argument(f"--prefix-repetition-{name}", type=int, default=value)
    if "hf" in datasets:
        data.add_argument("--hf-name", default=None, help="hf: the hub dataset a local --dataset-path copies")
        data.add_argument("--hf-split", default="train")
        data.add_argument("--hf-subset", default=None)
        data.add_argument("--hf-output-len", type=int, default=None)
    data.add_argument("--seed", type=int, default=0, help="seeds the workload and, offline, the engine (default: 0)")
    data.add_argument("--disable-shuffle", action="store_true", help="sharegpt, custom, hf: rows in their order")
    data.add_argument(
        "--no-stream",
        action="store_true",
        help="hf: fetch the whole split and shuffle all its rows (else a shard at a time)",
    )
    data.add_argument(
        "--no-oversample", action="store_true", help="fewer usable rows than --num-prompts: run those (else repeat)"
    )


def write_json(path: str | None, result: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2))
        print(f"result written to {path}")


def run_bench_kernels(args: argparse.Namespace) -> dict:
    from fovea.bench.kernels import bench_kernels

    return bench_kernels(args.out, args.quick)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's offline benchmarks' sampling and run flags."""
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (at temperature 1 when above 1)")
    parser.add_argument("--use-beam-search", action="store_true", help="a beam search of --n beams per prompt")
    parser.add_argument("--disable-detokenize", action="store_true", help="outputs as token ids only")
    parser.add_argument("--profile", action="store_true", help="the torch profiler (VLLM_TORCH_PROFILER_DIR)")


def offline_run(args: argparse.Namespace):
    from fovea.bench.offline import OfflineRun

    if args.profile and not profiler_dir():
        raise ValueError("--profile needs VLLM_TORCH_PROFILER_DIR set: where the trace is written")
    lora_path = getattr(args, "lora_path", None)
    if lora_path and not args.enable_lora:
        raise ValueError("--lora-path needs --enable-lora")
    return OfflineRun(detokenize=not args.disable_detokenize, lora_path=lora_path, profile=args.profile, seed=args.seed)


def run_bench_throughput(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from fovea.bench.offline import throughput
    from fovea.config.model import resolve_model_dir

    model = str(resolve_model_dir(args.model))
    requests = build_requests(args, AutoTokenizer.from_pretrained(model))
    backends = [args.backend] + ([args.compare] if args.compare and args.compare != args.backend else [])
    engine = engine_kwargs(args)
    how, most = offline_run(args), args.hf_max_batch_size
    runs = {
        name: throughput(model, requests, name, engine, args.n, args.use_beam_search, how, most) for name in backends
    }
    for name, run in runs.items():
        print(
            f"{name:<6} Throughput: {run['requests_per_second']:.2f} requests/s, {run['tokens_per_second']:.2f} "
            f"total tokens/s, {run['output_tokens_per_second']:.2f} output tokens/s"
        )
    first = runs[backends[0]]
    result = {
        "model": model,
        "num_prompts": args.num_prompts,
        "dataset_name": args.dataset_name,
        # vLLM's file: the run's figures at the top (the first backend's); each backend's below
        **{k: first[k] for k in VLLM_THROUGHPUT_FIELDS},
        **{name: {k: v for k, v in run.items() if k != "outputs"} for name, run in runs.items()},
    }
    if len(runs) == 2:
        first, second = (runs[name] for name in backends)
        result["ratio"] = first["output_tokens_per_second"] / second["output_tokens_per_second"]
        result["identical_outputs"] = sum(a == b for a, b in zip(first["outputs"], second["outputs"]))
        print(
            f"{backends[0]}/{backends[1]}: {result['ratio']:.2f}x output tokens/s; identical greedy outputs "
            f"{result['identical_outputs']}/{len(requests)}"
        )
    write_json(args.output_json, result)
    return result


def run_bench_latency(args: argparse.Namespace) -> dict:
    from fovea.bench.offline import latency
    from fovea.config.model import resolve_model_dir

    result = latency(
        str(resolve_model_dir(args.model)),
        args.input_len,
        args.output_len,
        args.batch_size,
        args.num_iters,
        args.num_iters_warmup,
        engine_kwargs(args),
        args.n,
        args.use_beam_search,
        offline_run(args),
    )
    print(f"Avg latency: {result['avg_latency']:.4f} seconds")
    for p, value in result["percentiles"].items():
        print(f"{p}% percentile latency: {value:.4f} seconds")
    write_json(args.output_json, result)
    return result


def build_requests(args, tokenizer):
    """The workload; where a dataset (sharegpt, custom, hf) has fewer usable rows than --num-prompts, rows drawn
    again at random make up the count, as vLLM does, unless --no-oversample."""
    from fovea.bench import datasets

    if args.random_batch_size != 1:
        raise ValueError("--random-batch-size batches prompts for embedding models, which fovea does not serve")
    if args.dataset_name in ("random", "random-mm", "prefix_repetition") and args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} makes its prompts: it takes no --dataset-path")
    if args.input_len is not None:  # vLLM's general lengths, over each dataset's own
        args.random_input_len = args.input_len
    if args.output_len is not None:
        for name in ("random", "sharegpt", "custom", "hf", "prefix_repetition"):
            setattr(args, f"{name}_output_len", args.output_len)
    requests = workload(args, tokenizer)
    if args.endpoint != "/v1/chat/completions" and any(r.images or r.videos for r in requests):
        raise ValueError("images and videos need --backend openai-chat (--endpoint /v1/chat/completions)")
    if len(requests) < args.num_prompts and args.dataset_name in ("sharegpt", "custom", "hf"):
        print(f"{args.dataset_name} gave {len(requests)} of {args.num_prompts} requests", file=sys.stderr)
        if not args.no_oversample:
            requests = datasets.oversampled(requests, args.num_prompts, args.seed)
    return requests


def workload(args, tokenizer):
    from fovea.bench import datasets

    if args.dataset_name in ("sharegpt", "jsonl", "custom", "hf") and not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    order = None if args.disable_shuffle else args.seed  # (None: the rows in their order)
    if args.dataset_name == "hf":
        from fovea.bench.hf_datasets import hf_requests

        return hf_requests(
            args.dataset_path,
            tokenizer,
            args.num_prompts,
            args.hf_name,
            args.hf_split,
            args.hf_subset,
            args.hf_output_len,
            order,
            args.no_stream,
        )
    if args.dataset_name == "sharegpt":
        return datasets.sharegpt_requests(
            args.dataset_path, tokenizer, args.num_prompts, args.sharegpt_output_len, order
        )
    if args.dataset_name == "jsonl":
        return datasets.jsonl_requests(args.dataset_path, tokenizer, args.num_prompts, args.random_output_len)
    if args.dataset_name == "custom":  # vLLM's name for jsonl: shuffled; completions get the chat template
        requests = datasets.jsonl_requests(
            args.dataset_path, tokenizer, args.num_prompts, args.custom_output_len, order
        )
        if args.endpoint != "/v1/chat/completions" and not args.skip_chat_template:
            for request in requests:
                chat = [{"role": "user", "content": request.prompt}]
                request.prompt = tokenizer.apply_chat_template(
                    chat, add_generation_prompt=True, tokenize=False, **(args.chat_template_kwargs or {})
                )
                request.prompt_len = len(tokenizer.encode(request.prompt, add_special_tokens=False))
        return requests
    if args.dataset_name == "prefix_repetition":
        return datasets.prefix_repetition_requests(
            tokenizer,
            args.num_prompts,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
            args.seed,
            shuffle=not args.disable_shuffle,
        )
    common = dict(range_ratio=args.random_range_ratio, prefix_len=args.random_prefix_len, seed=args.seed)
    if args.dataset_name == "random":
        return datasets.random_requests(
            tokenizer, args.num_prompts, args.random_input_len, args.random_output_len, **common
        )
    if args.endpoint != "/v1/chat/completions":
        raise ValueError("--dataset-name random-mm needs --backend openai-chat (--endpoint /v1/chat/completions)")
    return datasets.random_mm_requests(
        tokenizer,
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        base_items=args.random_mm_base_items_per_request,
        items_range_ratio=args.random_mm_num_mm_items_range_ratio,
        limits=args.random_mm_limit_mm_per_prompt,
        buckets=datasets.parse_bucket_config(args.random_mm_bucket_config),
        **common,
    )


def wait_until_ready(client, base_url: str, headers: dict, timeout_s: int) -> None:
    """Until the server answers (anything but 503: a server still starting), up to `timeout_s`, as vLLM's
    --ready-check-timeout-sec waits for a server started beside the benchmark."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client.get(base_url + "/v1/models", headers=headers, timeout=30).status_code != 503:
                return
            why = "it answers 503"
        except httpx.HTTPError as error:
            why = f"{type(error).__name__}: {error}"
        if time.monotonic() >= deadline:
            raise ValueError(f"could not reach the server at {base_url} in {timeout_s} s ({why})")
        time.sleep(min(1.0, max(deadline - time.monotonic(), 0)))


def toggle_profiler(client, base_url: str, headers: dict, action: str) -> None:
    """--profile: POST /start_profile before the run (its warm-ups included) and /stop_profile after, as vLLM's."""
    reply = client.post(f"{base_url}/{action}_profile", headers=headers, timeout=60)
    if reply.status_code == 404:
        raise ValueError(f"--profile: {base_url} has no /{action}_profile (start it with VLLM_TORCH_PROFILER_DIR set)")
    if reply.status_code != 200:
        raise ValueError(f"--profile: /{action}_profile answered {reply.status_code}: {reply.text[:200]}")


def served_models(client, base_url: str, headers: dict) -> list[dict]:
    """The server's model cards; a clear error when the server cannot be reached or refuses the key."""
    import httpx

    try:
        reply = client.get(base_url + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as error:
        raise ValueError(f"could not reach the server at {base_url} ({type(error).__name__}: {error})") from None
    if reply.status_code != 200:
        hint = " (give the key with --api-key or OPENAI_API_KEY)" if reply.status_code == 401 else ""
        raise ValueError(f"{base_url}/v1/models answered {reply.status_code}{hint}: {reply.text[:200]}")
    return reply.json()["data"]


def check_ramp_up(args) -> None:
    """vLLM's rules: both ends given, start at most end (above 0 for exponential), no --request-rate beside."""
    start, end = args.ramp_up_start_rps, args.ramp_up_end_rps
    if start is None or end is None:
        raise ValueError("--ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps")
    if start < 0 or start > end or (args.ramp_up_strategy == "exponential" and start == 0):
        raise ValueError(
            f"--ramp-up-start-rps {start} must be at most --ramp-up-end-rps {end} (and above 0 to ramp up exponentially)"
        )
    if args.request_rate != float("inf"):
        raise ValueError("--ramp-up-strategy sets the request rate: leave out --request-rate")


def served_tokenizer(cards: list[dict], model: str) -> str | None:
    """The directory the server loaded `model` from (an adapter's base model's), where this machine sees it:
    its tokenizer is the one the server counts with."""
    by_id = {card["id"]: card for card in cards}
    card = by_id.get(model)
    if card is not None and card.get("parent") in by_id:
        card = by_id[card["parent"]]
    root = (card or {}).get("root")
    return root if root and Path(root).is_dir() else None


def load_bench_tokenizer(name: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"no tokenizer at {name!r}: not a directory here, and the hub gave none ({reason}); pass --tokenizer DIR"
        ) from None


def refuse_missing_flags(args: argparse.Namespace) -> None:
    """vLLM bench flags for what fovea bench has not got, refused naming why (not ignored)."""
    if args.self_timed is not None:  # (vLLM's rule for every other dataset too)
        raise ValueError("--self-timed/--no-self-timed need a dataset of timed requests (vLLM's timed_trace)")
    if args.skip_tokenizer_init:
        raise ValueError("--skip-tokenizer-init: every workload here is built and counted with the tokenizer")
    if args.plot_timeline or args.plot_dataset_stats:
        raise ValueError("--plot-timeline and --plot-dataset-stats are not drawn here; --plot FILE.png draws the run")


def run_bench_serve(args: argparse.Namespace) -> dict:
    import httpx

    from fovea.bench import serve
    from fovea.bench.metrics import METRIC_TITLES, compute_metrics, format_table, parse_goodput, probe_metrics

    refuse_missing_flags(args)
    args.backend = args.backend or ("openai-chat" if args.endpoint == "/v1/chat/completions" else "openai")
    endpoint = args.endpoint or BACKEND_ENDPOINTS[args.backend]
    if endpoint != BACKEND_ENDPOINTS[args.backend]:
        raise ValueError(f"--backend {args.backend} speaks to {BACKEND_ENDPOINTS[args.backend]}, not {endpoint}")
    args.endpoint = endpoint  # the workload builders check it (images need the chat endpoint)
    # vLLM's client: random prompts run to the lengths asked, whatever the model would end with
    args.ignore_eos = args.ignore_eos or args.dataset_name in ("random", "random-mm")
    extra_body = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    extra_body.update({"use_beam_search": True} if args.use_beam_search else {})
    extra_body.update(args.extra_body or {})
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY")  # as vLLM's bench client reads it
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    headers.update(item.partition("=")[::2] for item in args.header)
    if args.ramp_up_strategy is not None:
        check_ramp_up(args)
    client = httpx.Client(verify=not args.insecure)
    if args.ready_check_timeout_sec > 0:
        wait_until_ready(client, base_url, headers, args.ready_check_timeout_sec)
    given_tokenizer = args.tokenizer or (args.model if args.served_model_name else None)
    named = args.served_model_name or args.model
    cards = [] if named and given_tokenizer else served_models(client, base_url, headers)
    model = named or cards[0]["id"]
    tokenizer_id = given_tokenizer or served_tokenizer(cards, model) or model  # the server's own, before the hub
    selected = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    unknown = set(selected) - set(METRIC_TITLES)
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {sorted(unknown)}; choose from {', '.join(METRIC_TITLES)}")
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    goodput = parse_goodput(args.goodput)
    metadata = dict(item.partition("=")[::2] for item in args.metadata)
    requests = build_requests(args, load_bench_tokenizer(tokenizer_id))  # images encoded once, here
    if args.profile:
        toggle_profiler(client, base_url, headers, "start")
    cpu_start = time.process_time()
    try:
        results, duration, probes = asyncio.run(
            serve.run(
                requests,
                base_url,
                endpoint,
                model,
                request_rate=args.request_rate,
                burstiness=args.burstiness,
                max_concurrency=args.max_concurrency,
                extra_body=extra_body,
                ignore_eos=args.ignore_eos,
                num_warmups=args.num_warmups,
                headers=headers,
                seed=args.seed,
                progress=not args.disable_tqdm,
                logprobs=args.logprobs,
                request_id_prefix=args.request_id_prefix,
                ramp_up=(args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps),
                lora_modules=args.lora_modules,
                lora_assignment=args.lora_assignment,
                probe_rate=args.probe_request_rate,
                verify_ssl=not args.insecure,
            )
        )
    finally:  # a profile left running would grow in the server's memory
        if args.profile:
            toggle_profiler(client, base_url, headers, "stop")
        client.close()
    client_cpu_s = time.process_time() - cpu_start
    queued = (args.max_concurrency is not None, args.request_rate != float("inf"))
    metrics = compute_metrics(results, duration, goodput, selected, percentiles, queued) | probe_metrics(probes)
    print(format_table(metrics, selected, percentiles, args.max_concurrency))
    # a client near one full core may be what limits the figures above
    print(f"client CPU: {client_cpu_s:.2f} s ({100 * client_cpu_s / duration:.0f}% of one core)")
    if args.plot:
        from fovea.bench.plot import plot

        plot(results, args.plot, f"{model}: {args.dataset_name}, {args.num_prompts} prompts")
        print(f"plot written to {args.plot}")
    failures = [r.error for r in results if not r.success]
    if failures:
        print(f"first failure: {failures[0]}", file=sys.stderr)
    if len(failures) == len(results):  # no figure above means anything: no result file, a non-zero exit
        raise ValueError(f"no request completed ({len(failures)} failed); the first failure: {failures[0]}")
    rate = "inf" if args.request_rate == float("inf") else args.request_rate
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model,
        "tokenizer_id": tokenizer_id,
        "num_prompts": args.num_prompts,
        "request_rate": rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "client_cpu_s": client_cpu_s,
        **metadata,
        **metrics,
    }
    if args.ramp_up_strategy is not None:
        ramp = ("ramp_up_strategy", "ramp_up_start_rps", "ramp_up_end_rps")
        result.update({name: getattr(args, name) for name in ramp})
    if args.save_detailed:
        result.update(
            input_lens=[r.prompt_len for r in results],
            output_lens=[r.output_tokens for r in results],
            start_times=[r.start_time for r in results],
            ttfts=[r.ttft for r in results],
            itls=[r.itl for r in results],
            generated_texts=[r.generated_text for r in results],
            errors=[r.error for r in results],
        )
    if args.save_result or args.save_detailed or args.append_result:
        name = args.result_filename or (
            f"{args.label or 'fovea'}-{rate}qps"
            f"{f'-concurrency{args.max_concurrency}' if args.max_concurrency else ''}-"
            f"{Path(model).name}-{result['date']}.json"
        )
        path = Path(args.result_dir) / name
        if args.append_result:  # one JSON object a line, as vLLM appends them
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as out:
                out.write(("\n" if out.tell() else "") + json.dumps(result))
        else:
            write_json(str(path), result)
    return result


def run_bench_mm_processor(args: argparse.Namespace) -> list[dict]:
    from fovea.bench.mm_processor import compare, format_rows

    try:
        sizes = [tuple(int(v) for v in size.lower().split("x")) for size in args.sizes.split(",")]
    except ValueError:
        raise ValueError(f"--sizes takes WIDTHxHEIGHT[,WIDTHxHEIGHT...], got {args.sizes!r}") from None
    rows = compare(sizes, args.iters)
    print(format_rows(rows))
    write_json(args.output_json, {"rows": rows})
    return rows
