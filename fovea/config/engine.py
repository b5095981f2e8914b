"""Engine settings, resolved once from the user's arguments and the checkpoint, then passed down. Frozen: what is
derived (the model's own max_model_len, the encoder cache size, the KV cache's limit) makes a new config with
`dataclasses.replace`, never an edit of one that others hold. Defaults: the flag table (fovea/config/flags.py)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from fovea.config.flags import FLAGS, default
from fovea.config.model import ModelConfig, VisionConfig, resolve_model_dir, serving_dtype
from fovea.config.quant import check_flag, layer_quant
from fovea.config.video import media_io_processor_kwargs
from fovea.config.vllm_args import VLLM_ONLY_ARGS, parse_max_model_len, parse_mm_limits, take_vllm_args

logger = logging.getLogger("fovea")


@dataclass(frozen=True)
class EngineConfig:
    # the help of every setting with a flag is in the flag table
    model_dir: Path
    model: ModelConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_seqs: int = default("max_num_seqs")
    max_num_batched_tokens: int = default("max_num_batched_tokens")
    max_num_encoder_input_tokens: int | None = default("max_num_encoder_input_tokens")
    block_size: int = default("block_size")
    enable_prefix_caching: bool = default("enable_prefix_caching")
    encoder_cache_size: int = 0  # embedding rows; 0 = the largest image plus one step's budget
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: default("limit_mm_per_prompt"))
    mm_processor_kwargs: dict | None = default("mm_processor_kwargs")
    hf_overrides: dict | None = default("hf_overrides")  # as given; `model` has them laid over config.json
    media_io_kwargs: dict | None = default("media_io_kwargs")
    enable_mm_embeds: bool = default("enable_mm_embeds")
    mm_processor_workers: int | None = default("mm_processor_workers")
    mm_processor_cache_gb: float = default("mm_processor_cache_gb")
    seed: int = default("seed")
    enforce_eager: bool = default("enforce_eager")
    async_scheduling: bool | None = default("async_scheduling")  # None: schedules_ahead decides
    scheduling_policy: str = default("scheduling_policy")
    stream_interval: int = default("stream_interval")
    max_model_len_from_model: bool = False  # the user left it unset: the KV cache may shorten it
    attention_backend: str = default("attention_backend")
    fp32_softmax: bool = default("fp32_softmax")
    fp32_softmax_vision: bool = default("fp32_softmax_vision")
    mm_buckets: list[int] = field(default_factory=list)  # vision encoder patch counts (--mm-buckets)
    overlap_outputs: bool | None = None  # build a step's outputs while the next runs (fovea/engine/engine.py)
    skip_warmup: bool = default("skip_warmup")
    gpu_memory_utilization: float = default("gpu_memory_utilization")
    kv_cache_memory_bytes: int | None = default("kv_cache_memory_bytes")
    num_gpu_blocks_override: int | None = default("num_gpu_blocks_override")
    tensor_parallel_size: int = default("tensor_parallel_size")
    data_parallel_size: int = default("data_parallel_size")
    mm_encoder_tp_mode: str = default("mm_encoder_tp_mode")
    mm_encoder_workers: int = default("mm_encoder_workers")  # the tower in processes of its own (issue 58)
    mm_encoder_actors: tuple[str, ...] = ()  # set by a Ray server: the names of the encoder actors it started
    # None: mp when tensor_parallel_size > 1. Named with one rank, the engine still takes the distributed path (a
    # group of one: its cost can be measured).
    distributed_executor_backend: str | None = default("distributed_executor_backend")
    generation_config: str = default("generation_config")
    override_generation_config: dict | None = default("override_generation_config")
    max_logprobs: int = default("max_logprobs")
    logprobs_mode: str = default("logprobs_mode")
    quantization: str | None = default("quantization")
    kv_cache_dtype: str = default("kv_cache_dtype")
    reasoning_parser: str | None = default("reasoning_parser")
    enable_lora: bool = default("enable_lora")
    max_loras: int = default("max_loras")
    max_lora_rank: int = default("max_lora_rank")
    max_cpu_loras: int | None = default("max_cpu_loras")

    @property
    def distributed(self) -> bool:
        return self.tensor_parallel_size > 1 or self.distributed_executor_backend is not None

    @property
    def resolved_attention_backend(self) -> str:
        """auto: our Triton kernels on CUDA (they, and the decode CUDA graphs that need them, are the fast path),
        the PyTorch reference elsewhere."""
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.device.type == "cuda" else "torch"

    @property
    def schedules_ahead(self) -> bool:
        """--async-scheduling, unset: on a GPU, where a step scheduled ahead keeps the device busy while the host
        records the last one (benchmarks/README "GPU"); not on the CPU, whose forward the host runs itself."""
        return self.device.type == "cuda" if self.async_scheduling is None else self.async_scheduling

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV cache holds: the model's dtype, or float8 e4m3 (--kv-cache-dtype fp8)."""
        return self.dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    @property
    def encoder_budget(self) -> int:
        """Image tokens handed to the encoder per step (one whole image always goes, however large): the encoder
        runs beside the language model, so this bounds how much image work starts at once, not a step's length."""
        return self.max_num_encoder_input_tokens or self.max_num_batched_tokens

    @property
    def largest_frame_pixels(self) -> float:
        """The most pixels the vision tower sees at once: the largest image, or a video's largest frame (two
        frames kept), that the limits allow."""
        image = self.model.image.with_overrides(self.mm_processor_kwargs)
        if self.model.video_token_id is None:
            return image.max_pixels
        video = self.model.video.with_kwargs(self.mm_processor_kwargs)
        return max(image.max_pixels, video.largest_frame_pixels(image.patch_size * image.merge_size))

    @classmethod
    def from_args(cls, model: str | Path | None = None, **args) -> EngineConfig:
        """From vLLM-style engine arguments (what `LLM(...)` and `fovea serve` take)."""
        known = {f.name for f in fields(cls)} - {"model_dir", "model", "mm_encoder_actors"}
        known |= {"dtype", "device", "max_model_len"}
        hub = {"revision", "download_dir", "tokenizer"}
        unknown = set(args) - known - hub - VLLM_ONLY_ARGS
        if unknown:
            raise TypeError(f"unexpected engine arguments {sorted(unknown)}")
        args = take_vllm_args(args)
        where = {"revision": args.pop("revision", None), "download_dir": args.pop("download_dir", None)}
        model_dir = resolve_model_dir(model, **where)
        tokenizer = args.pop("tokenizer", None)
        if tokenizer is not None and resolve_model_dir(tokenizer, **where).resolve() != model_dir.resolve():
            raise ValueError(f"tokenizer={tokenizer!r}: a tokenizer other than the model's own is not supported yet")
        args = {k: v for k, v in args.items() if v is not None}
        args["max_model_len"] = parse_max_model_len(args.get("max_model_len"))
        args["limit_mm_per_prompt"] = parse_mm_limits(args.get("limit_mm_per_prompt"), default("limit_mm_per_prompt"))
        return cls.build(model_dir, **args)

    @classmethod
    def build(
        cls,
        model_dir: Path,
        dtype: str | torch.dtype = default("dtype"),
        device: str = "auto",
        max_model_len: int | None = default("max_model_len"),
        **options,
    ) -> EngineConfig:
        hf_overrides = options.get("hf_overrides")
        if hf_overrides is not None and not isinstance(hf_overrides, dict):
            raise TypeError(f"hf_overrides must be a dict of config.json keys, got {type(hf_overrides).__name__}")
        model = ModelConfig.from_dir(model_dir, hf_overrides)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        torch_dtype = serving_dtype(model.torch_dtype, dtype, torch.device(device).type)
        limit = model.max_context
        max_model_len_from_model = max_model_len is None
        if max_model_len_from_model:
            max_model_len = limit
        elif max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context ({limit} positions)")
        options["mm_buckets"] = parse_buckets(options.get("mm_buckets"), model.image.encoder_unit)
        config = cls(
            model_dir=Path(model_dir),
            model=model,
            dtype=torch_dtype,
            device=torch.device(device),
            max_model_len=max_model_len,
            max_model_len_from_model=max_model_len_from_model,
            **options,
        )
        if config.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(
                f"kv_cache_dtype {config.kv_cache_dtype!r} is not supported: auto, or fp8 (e4m3; fp8_e5m2 is not)"
            )
        for flag in FLAGS:  # what the command line's choices check, for LLM(...) too
            value = getattr(config, flag.name, None) if flag.choices and flag.name != "dtype" else None
            if value is not None and value not in flag.choices:
                raise ValueError(f"{flag.name} must be one of {', '.join(flag.choices)}; got {value!r}")
        check_flag(config.quantization, model.text.quant)
        if model.bidirectional_images:  # a chunk holds an image whole (scheduler.py)
            per_image = model.image.tokens_per_image
            if config.max_num_batched_tokens < per_image:
                raise ValueError(
                    f"max_num_batched_tokens ({config.max_num_batched_tokens}) must hold one image's {per_image} "
                    "tokens: this model's image tokens see each other both ways, so an image is never cut"
                )
        if config.generation_config not in ("auto", "vllm") and not Path(config.generation_config).is_dir():
            raise ValueError(f"generation_config must be auto, vllm or a directory, got {config.generation_config!r}")
        media_io_processor_kwargs(config.media_io_kwargs)  # a bad one fails at start, naming the key
        if config.mm_processor_cache_gb < 0:
            raise ValueError(f"mm_processor_cache_gb must be 0 (off) or more, got {config.mm_processor_cache_gb}")
        if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
            raise ValueError(f"max_cpu_loras ({config.max_cpu_loras}) must be at least max_loras ({config.max_loras})")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "encoder_budget",
            "max_logprobs",
            "max_loras",
            "max_lora_rank",
            "stream_interval",
        ):
            if getattr(config, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(config, name)}")
        if not 0 < config.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {config.gpu_memory_utilization}")
        config = whole_tower_where_it_cannot_split(config)
        check_tensor_parallel(config)
        if not config.encoder_cache_size:  # a video's parts are at most one step's budget or one temporal patch
            vision = config.model.vision
            max_item_tokens = int(config.largest_frame_pixels) // (vision.patch_size * vision.spatial_merge_size) ** 2
            config = dataclasses.replace(config, encoder_cache_size=max_item_tokens + config.encoder_budget)
        return config


def parse_buckets(text: str | list[int] | None, merge_unit: int) -> list[int]:
    """'1024,4096' or [1024, 4096] -> sorted patch counts, each a positive multiple of merge_unit (the
    model's ImageProcessorConfig.encoder_unit: the patches of one token, or of one whole fixed-size image)."""
    if not text:
        return []
    values = [int(v) for v in text.split(",")] if isinstance(text, str) else [int(v) for v in text]
    bad = [v for v in values if v <= 0 or v % merge_unit]
    if bad:
        raise ValueError(f"mm_buckets must be positive multiples of {merge_unit} patches, got {bad}")
    return sorted(set(values))


def tower_split_obstacles(vision: VisionConfig, size: int) -> list[str]:
    """Why the vision tower cannot be split over `size` ranks (none: it can): its heads or MLP width do not
    divide, or a norm spans all its heads (InternViT-6B: 25 heads, q/k norms over all of them)."""
    if size <= 1:
        return []
    counts = {"heads": vision.num_heads, "MLP width": vision.intermediate_size}
    why = [f"{count} {what}" for what, count in counts.items() if count % size]
    return why + (["a q/k norm over all heads"] if vision.qk_norm else [])


def whole_tower_where_it_cannot_split(config: EngineConfig) -> EngineConfig:
    """mm_encoder_tp_mode data where the vision tower cannot be split over the ranks. vLLM serves such towers
    split (padded with empty heads); whole on each rank, the same command line serves here."""
    size = config.tensor_parallel_size
    why = tower_split_obstacles(config.model.vision, size) if config.mm_encoder_tp_mode == "weights" else []
    if not why:
        return config
    logger.warning(
        "the vision tower (%s) cannot be split over %d ranks: it runs whole on each, the images shared out "
        "(mm_encoder_tp_mode data)",
        ", ".join(why),
        size,
    )
    return dataclasses.replace(config, mm_encoder_tp_mode="data")


def check_quantization_blocks(text, size: int) -> None:
    """Each rank's share of a block-quantized MLP (gate|up's rows, down's columns) must be whole blocks, as in vLLM
    (Qwen3-VL-235B-A22B-FP8's experts, 1536 wide in 128 x 128 blocks, split over 8 ranks are 192 a rank)."""
    quant = text.quant
    if quant is None or quant.block is None or size == 1:
        return
    sparse = set(text.moe.sparse_layers) if text.moe is not None else set()
    dense = next((i for i in range(text.num_layers) if i not in sparse), None)
    mlps = []
    if sparse and layer_quant(quant, min(sparse), ("mlp.experts",)) is not None:
        mlps.append(("experts' MLP width", text.moe.intermediate_size))
    if dense is not None and layer_quant(quant, dense, ("mlp.down_proj",)) is not None:
        mlps.append(("MLP width", text.intermediate_size))
    for what, width in mlps:
        share = width // size
        if share % quant.block[0] or share % quant.block[1]:
            raise ValueError(
                f"the model's {what} ({width}) over tensor_parallel_size {size} is {share} a rank: not whole "
                f"quantization blocks of {quant.block[0]} x {quant.block[1]}; choose a smaller size"
            )


def check_model_split(text, size: int) -> None:
    """Raises ValueError, with the numbers, when the language model cannot be split over `size` ranks."""
    widths = [("attention heads", text.num_heads), ("MLP width", text.intermediate_size)]
    if text.moe is not None:
        widths.append(("experts' MLP width", text.moe.intermediate_size))
    for what, count in widths:
        if count % size:
            raise ValueError(
                f"the model's {what} ({count}) do not divide over tensor_parallel_size {size}; "
                "choose a size that divides it"
            )
    check_quantization_blocks(text, size)
    kv = text.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise ValueError(
            f"the model's {kv} KV heads cannot be split or replicated over tensor_parallel_size "
            f"{size}: one must divide the other"
        )


def check_tensor_parallel(config: EngineConfig) -> None:
    """Fails at start-up, with the numbers, when the model cannot be split over tensor_parallel_size ranks."""
    size, text = config.tensor_parallel_size, config.model.text
    if size < 1 or config.data_parallel_size < 1:
        raise ValueError(
            f"tensor_parallel_size and data_parallel_size must be at least 1, got {size} and "
            f"{config.data_parallel_size}"
        )
    if config.mm_encoder_workers < 0:
        raise ValueError(f"mm_encoder_workers must be 0 or more, got {config.mm_encoder_workers}")
    check_model_split(text, size)
    gpus = size * config.data_parallel_size
    if (
        gpus > 1
        and config.device.type == "cuda"
        and gpus > torch.cuda.device_count()
        and config.distributed_executor_backend != "ray"
    ):
        raise ValueError(
            f"tensor_parallel_size {size} x data_parallel_size {config.data_parallel_size} needs "
            f"{gpus} GPUs, this machine has {torch.cuda.device_count()}; use "
            "--distributed-executor-backend ray for several nodes"
        )
