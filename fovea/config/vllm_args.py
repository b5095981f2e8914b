"""vLLM engine arguments that fovea takes only so that launch lines and scripts written for vLLM run unchanged.

Three kinds, settled here once for `LLM(...)`, `fovea serve` and the benches: arguments that change nothing here
(accepted, logged), arguments neutral only at some values (other values fail, naming what is not implemented,
rather than run something else than asked), and vLLM's spellings of values fovea has (`--max-model-len 32k`).
"""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger("fovea")

# no effect on what fovea computes or how fast
NO_EFFECT = {
    "trust_remote_code": "fovea runs its own model code",
    "disable_log_stats": "stats cost nothing measurable here",
    "disable_custom_all_reduce": "fovea has no custom all-reduce",
    "max_seq_len_to_capture": "decode CUDA graphs are captured by batch size",
    "compilation_config": "fovea does not use torch.compile",
    "swap_space": "preempted requests are recomputed, not swapped",
    "tokenizer_revision": "the tokenizer comes with the model's revision",
    "enable_chunked_prefill": "fovea always chunks long prompts (the tokens are the same)",
    "disable_frontend_multiprocessing": "the engine always runs in its own process",
    "enable_prompt_tokens_details": "usage has prompt_tokens_details.cached_tokens whenever the prefix cache served",
    "prefix_caching_hash_algo": "cached KV blocks are keyed by blake2b digests of their tokens",
    "disable_cascade_attn": "fovea has no cascade attention",
    "cuda_graph_sizes": "decode CUDA graphs are captured by batch size, up to max_num_seqs",
    "max_cudagraph_capture_size": "decode CUDA graphs are captured by batch size, up to max_num_seqs",
    "max_parallel_loading_workers": "each rank reads the checkpoint once, file by file",
    "pt_load_map_location": "only safetensors checkpoints load",
    "max_num_partial_prefills": "prompts are cut into each step's budget in arrival order",
    "max_long_partial_prefills": "prompts are cut into each step's budget in arrival order",
    "long_prefill_token_threshold": "prompts are cut into each step's budget in arrival order",
    "disable_chunked_mm_input": "the tokens are the same whether an image's placeholders span steps or not",
    "skip_mm_profiling": "the start-up profile always runs the vision tower's largest step",
    "mm_shm_cache_max_object_size_mb": "decoded images travel in shared-memory segments of their own size",
    "mm_encoder_attn_backend": "the vision tower runs fovea's own attention",
    "structured_outputs_config": "structured outputs run on llguidance",
    "guided_decoding_backend": "structured outputs run on llguidance",
    "enable_expert_parallel": "MoE experts are split over the ranks by tensor parallelism",
    "api_server_count": "one front-end process serves; its preparation work runs in pools of threads and processes",
    "safetensors_load_strategy": "each rank reads the checkpoint once, file by file",
    "show_hidden_metrics_for_version": "no metric of fovea's is hidden",
    "cudagraph_capture_sizes": "decode CUDA graphs are captured by batch size, up to max_num_seqs",
    "enable_log_deltas": "--enable-log-outputs logs each request's text once, when it finishes",
    "log_error_stack": "a failure while running a request is logged with its stack whatever this says",
    "data_parallel_supervisor_port": "fovea has no external load-balancing mode (one server, --data-parallel-size)",
    "cohere_format": "it is for Cohere's tokenizer mode, which fovea does not have",
}

# value(s) at which the argument changes nothing; any other value asks for something fovea does not do
ONLY_AT = {
    "pipeline_parallel_size": ((1, None), "pipeline parallelism is not implemented; use --tensor-parallel-size"),
    "load_format": (("auto", "safetensors", None), "only safetensors checkpoints load"),
    "cpu_offload_gb": ((0, None), "offloading weights to the CPU is not implemented"),
    "tokenizer_mode": (("auto", "hf", None), "only the checkpoint's Hugging Face tokenizer is supported"),
    "worker_cls": (("auto", None), "custom worker classes are not supported"),
    "model_impl": (("auto", None), "fovea runs its own model code"),
    # vLLM's encoder instances, fed by a proxy, hand their outputs to the language model's through a connector
    "speculative_config": ((None, {}), "speculative decoding is not implemented"),
    "enable_sleep_mode": ((None, False), "sleep mode is not implemented"),
    "kv_transfer_config": ((None, {}), "disaggregated prefill (KV transfer between instances) is not implemented"),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "otlp_traces_endpoint": ((None,), "OpenTelemetry tracing is not implemented"),
    "collect_detailed_traces": ((None,), "OpenTelemetry tracing is not implemented"),
    "video_pruning_rate": ((None, 0, 0.0), "pruning video tokens is not implemented"),
    "interleave_mm_strings": ((None, False), "media placeholders inside string content are not implemented"),
    "tool_parser_plugin": ((None, ""), "tool parser plugins are not supported; --tool-call-parser hermes is built in"),
    "task": ((None, "auto", "generate"), "fovea serves text generation only (no pooling or embedding models)"),
    "runner": ((None, "auto", "generate"), "fovea serves text generation only (no pooling or embedding models)"),
    "convert": ((None, "auto", "none"), "fovea serves text generation only (no pooling or embedding models)"),
    "override_pooler_config": ((None, {}), "fovea serves text generation only (no pooling or embedding models)"),
    "config_format": ((None, "auto", "hf"), "only Hugging Face config.json files are read"),
    "hf_config_path": ((None,), "config.json is read from the model's directory (--hf-overrides changes it)"),
    "model_loader_extra_config": ((None, {}), "the checkpoint's safetensors load one way"),
    "calculate_kv_scales": (
        (None, False),
        "fp8 KV scales come from the checkpoint (else 1.0); computing them is not implemented",
    ),
    "kv_offloading_size": ((None,), "offloading the KV cache to CPU memory is not implemented"),
    "enable_dbo": ((None, False), "dual-batch overlap is not implemented"),
    "headless": ((None, False), "data parallelism over hosts runs on Ray (--distributed-executor-backend ray)"),
    "data_parallel_address": ((None,), "data parallelism over hosts runs on Ray (--distributed-executor-backend ray)"),
    "io_processor_plugin": ((None,), "IO processor plugins are not supported"),
    "tool_server": ((None,), "built-in tool servers (the Responses API's browsing and code tools) are not implemented"),
    "middleware": ((None, []), "custom ASGI middleware is not supported"),
    "enable_ssl_refresh": ((None, False), "reloading changed certificate files is not implemented; restart"),
    "h11_max_header_count": (
        (None, 256),
        "request heads are bounded by size (--h11-max-incomplete-event-size), not by their number of headers",
    ),
    "enable_offline_docs": ((None, False), "the API docs pages are not bundled (--disable-fastapi-docs drops them)"),
    "tokens_only": ((None, False), "a tokens-only (disaggregated) front end is not implemented"),
    "enable_per_request_metrics": ((None, False), "per-request timings in responses are not implemented"),
    "fingerprint_mode": ((None, "none"), "responses carry no system_fingerprint"),
    "fingerprint_value": ((None,), "responses carry no system_fingerprint"),
    "mm_encoder_only": (
        (None, False),
        "an encoder-only instance is not how fovea splits the encoder (--mm-encoder-workers)",
    ),
    "ec_transfer_config": (
        (None,),
        "encoder instances behind a proxy are not how fovea splits the encoder: one server with "
        "--mm-encoder-workers N runs the vision tower in N workers of its own (processes on this host, Ray actors "
        "on any node with --distributed-executor-backend ray)",
    ),
}

# vLLM's older spellings of a setting fovea has: (the setting, its value when the old switch is on)
SWITCHES = {"disable_mm_preprocessor_cache": ("mm_processor_cache_gb", 0)}
# vLLM's environment variables that stand for a setting fovea has (a switch the arguments leave off)
ENVIRONMENT = {"VLLM_SKIP_WARMUP": ("skip_warmup", True)}

VLLM_ONLY_ARGS = set(NO_EFFECT) | set(ONLY_AT) | set(SWITCHES) | {"hf_token"}


def take_vllm_args(args: dict) -> dict:
    """`args` without the arguments above; those that change nothing are logged, the others raise ValueError,
    and older switches (SWITCHES) become the setting they stand for."""
    for name, value in args.items():
        if name in ONLY_AT and value not in ONLY_AT[name][0]:
            raise ValueError(f"{name}={value!r}: {ONLY_AT[name][1]}")
    args = dict(args)
    token = args.get("hf_token")
    if isinstance(token, str) and token:  # (True: the token `huggingface-cli login` saved, which the hub reads anyway)
        os.environ["HF_TOKEN"] = token  # the hub's downloads, here and in the processes started from here
        logger.info("hf_token given: the hub's downloads use it")
    for name, (setting, value) in SWITCHES.items():
        if args.pop(name, None):
            args[setting] = value
    for variable, (setting, value) in ENVIRONMENT.items():
        if not args.get(setting) and os.environ.get(variable, "").lower() in ("1", "true"):
            args[setting] = value
            logger.info("%s is set: %s=%r", variable, setting, value)
    noted = [name for name in args if name in NO_EFFECT and args[name] is not None]
    for name in noted:
        logger.info("accepted and ignored %s=%r: %s", name, args[name], NO_EFFECT[name])
    return {name: value for name, value in args.items() if name not in VLLM_ONLY_ARGS}


# the sizes vLLM's start-up profile takes for a modality's dummy inputs, beside its count (--limit-mm-per-prompt)
MM_PROFILE_SIZES = {"image": {"width", "height"}, "video": {"num_frames", "width", "height"}}


def parse_mm_limits(given: dict | None, defaults: dict[str, int]) -> dict[str, int]:
    """--limit-mm-per-prompt: each modality's count, or vLLM's {"count": N, "width": ..., "height": ...} (a video's
    "num_frames" too). Those sizes are accepted and logged as ignored: fovea's start-up profile runs the largest
    image max_pixels allows, whatever they say (mm_processor_kwargs lowers it). A modality left out, or a dict
    without a count, keeps its default bound: each image or video may need a full-size decode in the front end."""
    if not isinstance(given or {}, dict):
        raise ValueError(f'limit_mm_per_prompt must be a JSON object such as {{"image": 4}}, got {given!r}')
    limits = dict(defaults)
    for kind, value in (given or {}).items():
        if kind not in MM_PROFILE_SIZES:
            raise ValueError(f"limit_mm_per_prompt: {kind!r} is not a modality fovea serves (image, video)")
        if isinstance(value, dict):
            unknown = set(value) - {"count"} - MM_PROFILE_SIZES[kind]
            if unknown:
                raise ValueError(
                    f"limit_mm_per_prompt[{kind!r}] takes count and {', '.join(sorted(MM_PROFILE_SIZES[kind]))}, "
                    f"not {sorted(unknown)}"
                )
            sizes = {key: size for key, size in value.items() if key != "count"}
            if sizes:
                logger.info(
                    "accepted and ignored limit_mm_per_prompt[%r] %s: the start-up profile runs the largest image "
                    "(or video frame) max_pixels allows",
                    kind,
                    sizes,
                )
            value = value.get("count", defaults.get(kind))
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"limit_mm_per_prompt[{kind!r}] must be a count of 0 or more, got {value!r}")
        limits[kind] = value
    return limits


def parse_max_model_len(text: str | int | None) -> int | None:
    """vLLM's forms: an integer, `auto` or -1 (the model's own limit), or a size with a suffix: k/m/g are powers
    of 1000 (25.6k = 25600), K/M/G powers of 1024 (32K = 32768)."""
    if text is None or isinstance(text, int):
        return None if text == -1 else text
    text = text.strip()
    if text.lower() == "auto" or text == "-1":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", text)
    if not match:
        raise ValueError(f"max_model_len must be an integer, auto, or a size like 32k or 32K; got {text!r}")
    number, suffix = match.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[suffix]
    value = float(number) * scale
    if value != int(value) or value < 1:
        raise ValueError(f"max_model_len {text!r} is not a whole number of tokens")
    return int(value)


def max_model_len_arg(text: str) -> int | None:
    """`--max-model-len` for argparse: vLLM's forms, a clear usage error for anything else."""
    import argparse

    try:
        return parse_max_model_len(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
