"""Every engine setting in one table: name, default, help, type. `EngineConfig` takes its defaults from it, and
`fovea serve`, `fovea bench throughput|latency`, `fovea plan` and `fovea eval` their flags, so `LLM(**kwargs)` and
every command use (and `--help` shows) the same default: vLLM's, where vLLM has the setting."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fovea.config.vllm_args import NO_EFFECT, ONLY_AT, SWITCHES, VLLM_ONLY_ARGS, max_model_len_arg


def dotted_flags(argv: list[str]) -> list[str]:
    """vLLM's `--flag.key value` (and `--flag.key=value`, deeper keys too): the keys of a JSON flag given one at a
    time, made into one `--flag '{...}'`, over the keys of a `--flag VALUE` given as well. Values are read as JSON
    where they parse (2, true), else as strings."""
    out, nested = [], {}
    tokens = iter(argv)
    for token in tokens:
        name, equals, value = token.partition("=")
        if not (token.startswith("--") and "." in name):
            out.append(token)
            continue
        flag, *path = name.split(".")
        value = value if equals else next(tokens, "")
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
        node = nested.setdefault(flag, {})
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    for flag, keys in nested.items():
        kept, given, rest = [], {}, iter(out)
        for token in rest:
            if token != flag and not token.startswith(flag + "="):
                kept.append(token)
                continue
            text = token.partition("=")[2] if "=" in token else next(rest, "")
            try:
                given.update(json_arg(text))
            except argparse.ArgumentTypeError:  # not a JSON object: left for the parser to refuse
                kept += [flag, text]
        out = kept + [flag, json.dumps({**given, **keys})]
    return out


def json_arg(text: str) -> dict:
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


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def lora_module_arg(text: str) -> LoRAModule:
    """--lora-modules: name=path, or vLLM's JSON form {"name": ..., "path": ..., "base_model_name": ...}."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
            return LoRAModule(value["name"], value["path"], value.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as error:
            raise argparse.ArgumentTypeError(f'{text!r}: a JSON module needs "name" and "path" ({error})') from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected name=path")
    return LoRAModule(name, path)


# --reasoning-parser: (start, end) of the reasoning part. qwen3: reasoning where the prompt (a thinking template)
# or the output opens it; deepseek_r1 (vLLM's for DeepSeek-R1 and QwQ): from the output's first token,
# whether or not the tag is written, up to the end tag
REASONING_TAGS = {"qwen3": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>")}
REASONING_FROM_START = {"deepseek_r1"}


def reasoning_opened(parser: str, prompt: str | None) -> bool:
    """Whether an output is reasoning from its first token (before any tag of its own)."""
    return parser in REASONING_FROM_START or (prompt or "").rstrip().endswith(REASONING_TAGS[parser][0])


@dataclass(frozen=True)
class Flag:
    name: str  # the EngineConfig field, LLM keyword and (dashed) flag
    default: Any
    help: str
    group: str = "engine"
    type: Callable | None = None  # None: the default's type (a switch for booleans)
    choices: tuple | None = None
    short: str | None = None


FLAGS = (
    Flag(
        "dtype",
        "auto",
        "weights and activations; auto: the checkpoint's (bf16 for fp32 ones on a GPU)",
        choices=("auto", "bfloat16", "float16", "float32", "half", "float"),
    ),
    Flag(
        "max_model_len",
        None,
        "tokens per sequence: 32768, 32k (32000), 32K (32768), or auto (the model's own, "
        "shortened to what the KV cache holds)",
        type=max_model_len_arg,
    ),
    Flag("max_num_seqs", 256, "sequences running at once"),
    Flag("max_num_batched_tokens", 8192, "tokens per engine step (prompts are chunked to fit)"),
    Flag(
        "max_num_encoder_input_tokens",
        None,
        "image tokens handed to the vision encoder per step (default: max-num-batched-tokens)",
        type=int,
    ),
    Flag("block_size", 16, "tokens per KV-cache block"),
    Flag("gpu_memory_utilization", 0.9, "this engine's share of the GPU's memory (weights, activations, KV cache)"),
    Flag(
        "kv_cache_memory_bytes",
        None,
        "KV-cache bytes per GPU, instead of sizing it by gpu-memory-utilization",
        type=int,
    ),
    Flag("num_gpu_blocks_override", None, "KV-cache blocks, instead of the memory profile's count", type=int),
    Flag(
        "enable_prefix_caching",
        True,
        "reuse the KV cache of prompt prefixes (images included) seen before",
        type=argparse.BooleanOptionalAction,
    ),
    Flag("seed", 0, "seed of requests that set none"),
    Flag(
        "generation_config",
        "auto",
        "auto: sampling defaults from the checkpoint's generation_config.json; vllm: none; or a directory holding one",
    ),
    Flag(
        "override_generation_config",
        None,
        'sampling defaults over the generation config\'s, e.g. {"temperature": 0.5, "max_new_tokens": 512}',
        type=json_arg,
    ),
    Flag(
        "hf_overrides",
        None,
        "config.json keys laid over the checkpoint's; a sub-config's (text_config, vision_config) key by key, e.g. "
        '{"text_config": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, '
        '"original_max_position_embeddings": 32768}}}',
        type=json_arg,
    ),
    Flag(
        "quantization",
        None,
        "the checkpoint's quantized weights: fp8, compressed-tensors or awq, read from its config.json "
        "(quantization_config); given, it must name the checkpoint's own",
        type=str,
        short="-q",
    ),
    Flag(
        "kv_cache_dtype",
        "auto",
        "KV cache values: auto (the model's dtype) or fp8 (e4m3, scaled by the checkpoint's k/v scales, else 1.0)",
        choices=("auto", "fp8", "fp8_e4m3"),
    ),
    Flag("max_logprobs", 20, "most logprobs a request may ask for"),
    Flag(
        "logprobs_mode",
        "raw_logprobs",
        "what logprobs hold: the model's log-probabilities or logits (raw_*), or those the token was drawn from "
        "(processed_*: after bias, penalties, temperature and top_k/top_p/min_p, -inf where filtered out)",
        choices=("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"),
    ),
    Flag(
        "reasoning_parser",
        None,
        "a thinking model's <think>...</think> part: the chat message's reasoning, and structured outputs and "
        "forced tool calls start after it (qwen3; deepseek_r1: reasoning from the first token up to </think>)",
        type=str,
        choices=tuple(REASONING_TAGS),
    ),
    Flag(
        "attention_backend",
        "auto",
        "auto: our Triton kernels on CUDA, the PyTorch reference elsewhere",
        choices=("auto", "torch", "triton"),
    ),
    Flag("enforce_eager", False, "no CUDA graphs"),
    Flag(
        "async_scheduling",
        None,
        "schedule and queue each step before the previous one's tokens are back (they are read on the device); "
        "steps with structured outputs, min_tokens or n > 1 forks wait for them (default: on for a GPU engine, "
        "off on the CPU, as in vLLM)",
        type=argparse.BooleanOptionalAction,
    ),
    Flag(
        "stream_interval",
        1,
        "a streamed request's tokens are reported every this many (its first and its last at once): fewer, "
        "larger chunks cost the engine and the front end less per token",
    ),
    Flag(
        "scheduling_policy",
        "fcfs",
        "fcfs: requests in arrival order; priority: by each request's priority (lower first, as in vLLM), then "
        "arrival, and when KV blocks run out the running request with the highest value is preempted first",
        choices=("fcfs", "priority"),
    ),
    Flag("mm_buckets", None, "vision encoder patch-count buckets, e.g. 1024,4096,16384", type=str),
    Flag("skip_warmup", False, "capture encoder buckets on first use"),
    Flag("fp32_softmax", False, "language-model attention softmax in fp32"),
    Flag("fp32_softmax_vision", False, "vision-tower attention softmax in fp32"),
    # bounded by default: each image or video may need a full-size decode (up to 8192x8192; a video file up to
    # 256 MiB) in the front end, so an unbounded count is a CPU and memory lever for a single request
    Flag(
        "limit_mm_per_prompt",
        {"image": 16, "video": 2},
        'images and videos a prompt may hold, e.g. {"image": 4}',
        "images",
        json_arg,
    ),
    Flag("mm_processor_kwargs", None, 'e.g. {"min_pixels": 3136, "max_pixels": 1003520}', "images", json_arg),
    Flag(
        "media_io_kwargs",
        None,
        'how media are loaded, for every request (a request\'s own come on top), e.g. {"video": {"num_frames": 16}} '
        "(video num_frames, fps)",
        "images",
        json_arg,
    ),
    Flag(
        "mm_processor_cache_gb",
        4.0,
        "GiB of decoded, resized images and videos the front end keeps by their bytes and size: the same one again "
        "skips decoding (0: off)",
        "images",
        float,
    ),
    Flag(
        "enable_mm_embeds",
        False,
        "images may be given as the vision tower's output (image_embeds parts, multi_modal_data image_embeds), "
        "which skips the tower",
        "images",
    ),
    Flag(
        "mm_processor_workers",
        None,
        "processes that decode and resize images (default: one per core, at most 8; 0: in the front end's threads)",
        "images",
        int,
    ),
    Flag("enable_lora", False, "serve LoRA adapters (PEFT directories) beside the base model", "lora"),
    Flag("max_loras", 1, "adapters in one batch", "lora"),
    Flag("max_lora_rank", 16, "highest adapter rank accepted", "lora"),
    Flag(
        "max_cpu_loras",
        None,
        "adapters kept loaded, least recently used dropped (default: max-loras)",
        "lora",
        int,
    ),
    Flag("tensor_parallel_size", 1, "GPUs (ranks) per engine", "parallelism", short="-tp"),
    Flag(
        "data_parallel_size",
        1,
        "engine replicas behind a server, each tensor-parallel-size GPUs",
        "parallelism",
        short="-dp",
    ),
    Flag(
        "mm_encoder_tp_mode",
        "weights",
        "vision tower split over the ranks (weights) or whole on each, images shared out (data)",
        "parallelism",
        choices=("weights", "data"),
    ),
    Flag(
        "mm_encoder_workers",
        0,
        "vision towers in worker processes of their own, on this host (encoder disaggregation); 0: the engine's",
        "parallelism",
    ),
    Flag(
        "distributed_executor_backend",
        None,
        "ranks and replicas as local processes (mp, default) or actors on a running Ray cluster",
        "parallelism",
        str,
        choices=("mp", "ray"),
    ),
    Flag("revision", None, "branch, tag or commit of a hub id", "hub", str),
    Flag("download_dir", None, "Hugging Face cache directory for hub ids", "hub", str),
    Flag("tokenizer", None, "must be the model's own (a separate one is not supported)", "hub", str),
)
BY_NAME = {flag.name: flag for flag in FLAGS}
# what `fovea plan` can take into account, from config.json alone
PLAN_FLAGS = (
    "dtype",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "mm_encoder_tp_mode",
    "kv_cache_dtype",
    "hf_overrides",
)
EVAL_FLAGS = ("dtype", "max_model_len", "max_num_seqs")  # laid over a registry entry's engine settings


def default(name: str) -> Any:
    """The one default of an engine setting (a fresh copy: some are dicts)."""
    value = BY_NAME[name].default
    return dict(value) if isinstance(value, dict) else value


def add_engine_flags(parser: argparse.ArgumentParser, names=None, given_only: bool = False, title: str | None = None):
    """`names` (default: all) as flags, in groups (all in one group named `title` when given; returned then).
    `given_only`: the parser's default is None, so that a caller can tell what the user gave (fovea eval lays
    the flags over its registry entry); the help still shows the engine's default. Without a title, returns the
    groups by name (a command adds its own flags to them)."""
    groups: dict[str, Any] = {}
    for flag in FLAGS if names is None else [BY_NAME[name] for name in names]:
        if "--" + flag.name.replace("_", "-") in parser._option_string_actions:
            continue  # the command has it already (bench's --seed, which as in vLLM seeds the engine too)
        key = title or flag.group
        group = groups.get(key) or groups.setdefault(key, parser.add_argument_group(key))
        value = default(flag.name)
        dashed = ["--" + flag.name.replace("_", "-")] + ([flag.short] if flag.short else [])
        shown = "none" if value is None else json.dumps(value) if isinstance(value, dict) else value
        help_text = flag.help if "(default" in flag.help else f"{flag.help} (default: {shown})"
        options: dict[str, Any] = {"default": None if given_only else value, "help": help_text}
        if flag.type is argparse.BooleanOptionalAction or (flag.type is None and isinstance(value, bool)):
            options["action"] = argparse.BooleanOptionalAction if flag.type else "store_true"
        else:
            options["type"] = flag.type or type(value)
            if flag.choices:
                options["choices"] = list(flag.choices)
        group.add_argument(*dashed, **options)
    return groups.get(title) if title else groups


# how vLLM's command line spells each of vllm_args.py's arguments: a switch (--x and --no-x), or a value of this
# type (a list of them when the type is in a list); -pp, -O and -asc as vLLM's short forms
SWITCH = "switch"
VLLM_ARG_KINDS = {
    "data_parallel_supervisor_port": int,
    "cohere_format": str,
    "h11_max_header_count": int,
    "fingerprint_mode": str,
    "fingerprint_value": str,
    "pipeline_parallel_size": int,
    "load_format": str,
    "tokenizer_mode": str,
    "model_impl": str,
    "worker_cls": str,
    "cpu_offload_gb": float,
    "swap_space": float,
    "tokenizer_revision": str,
    "max_seq_len_to_capture": int,
    "compilation_config": str,
    "prefix_caching_hash_algo": str,
    "ec_transfer_config": json_arg,
    "kv_transfer_config": json_arg,
    "speculative_config": json_arg,
    "logits_processors": [str],
    "cuda_graph_sizes": [int],
    "max_cudagraph_capture_size": int,
    "max_parallel_loading_workers": int,
    "pt_load_map_location": str,
    "max_num_partial_prefills": int,
    "max_long_partial_prefills": int,
    "long_prefill_token_threshold": int,
    "mm_shm_cache_max_object_size_mb": int,
    "mm_encoder_attn_backend": str,
    "structured_outputs_config": str,
    "guided_decoding_backend": str,
    "api_server_count": int,
    "otlp_traces_endpoint": str,
    "collect_detailed_traces": str,
    "video_pruning_rate": float,
    "tool_parser_plugin": str,
    "hf_token": str,
    "safetensors_load_strategy": str,
    "show_hidden_metrics_for_version": str,
    "cudagraph_capture_sizes": [int],
    "task": str,
    "runner": str,
    "convert": str,
    "override_pooler_config": json_arg,
    "config_format": str,
    "hf_config_path": str,
    "model_loader_extra_config": json_arg,
    "kv_offloading_size": float,
    "data_parallel_address": str,
    "io_processor_plugin": str,
    "tool_server": str,
    "middleware": [str],
}
SHORT = {"pipeline_parallel_size": "-pp", "compilation_config": "-O", "api_server_count": "-asc"}


def add_vllm_only_flags(parser: argparse.ArgumentParser) -> None:
    """Accepted so that vLLM launch lines run: they change nothing here, or fail naming what is not implemented
    (fovea/config/vllm_args.py)."""
    group = parser.add_argument_group("vLLM flags kept for launch lines (see fovea/config/vllm_args.py)")
    parser.set_defaults(vllm_only_args=sorted(VLLM_ONLY_ARGS))
    for name in sorted(VLLM_ONLY_ARGS):
        kind = VLLM_ARG_KINDS.get(name, SWITCH)
        if name in NO_EFFECT:
            what = f"accepted and logged: {NO_EFFECT[name]}"
        elif name in ONLY_AT:
            values, why = ONLY_AT[name]
            shown = [str(value) for value in values if value not in (None, [], {}, "")]
            what = f"{why}; accepted only {'as ' + ' or '.join(shown) if shown else 'when left out'}"
        elif name in SWITCHES:
            setting, value = SWITCHES[name]
            what = f"vLLM's older switch: the same as --{setting.replace('_', '-')} {value}"
        else:  # hf_token
            what = "a Hugging Face token for the hub's downloads (else HF_TOKEN's, or the saved login's)"
        names = [SHORT[name]] if name in SHORT else []
        names.append("--" + name.replace("_", "-"))
        options = dict(default=None, help=what)
        if kind == SWITCH:
            options["action"] = argparse.BooleanOptionalAction
        elif isinstance(kind, list):
            options.update(type=kind[0], nargs="+")
        else:
            options["type"] = kind
        group.add_argument(*names, **options)


def engine_kwargs(args: argparse.Namespace, names=None) -> dict:
    """The engine keywords an `add_engine_flags` parser read (only those the user gave, for a given_only one)."""
    chosen = [flag.name for flag in FLAGS] if names is None else list(names)
    chosen += getattr(args, "vllm_only_args", [])  # those add_vllm_only_flags declared (eval's --task is its own)
    values = {name: getattr(args, name) for name in chosen if hasattr(args, name)}
    if "dtype" in values and values["dtype"] is not None:
        values["dtype"] = {"half": "float16", "float": "float32"}.get(values["dtype"], values["dtype"])
    return values
