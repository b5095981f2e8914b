"""`fovea plan MODEL --gpu-memory GiB`: what fits on a GPU, worked out from config.json alone (no GPU, no weights).

Weights: the model's exact parameters (it is built on the meta device, quantized layers as the checkpoint's
quantization_config says), each at its stored size: quantized weights and their integer packing as stored, the
rest (scales included) at the dtype's size. KV cache per token: layers x KV heads x head_dim x 2 (K and V) x the
cache's value size (the dtype's, or 1 byte with --kv-cache-dtype fp8; both capacities are shown). Activations are estimates for eager PyTorch:
the widest moment of a layer is its MLP (gate, up and their product: 3 x intermediate per token, plus a few
hidden-size rows), for the language model over one step's max_num_batched_tokens and for the vision tower over the
patches of the largest image the limits allow (4 patches per image token) and over one step's part of a video
(whole temporal patches up to max_num_batched_tokens tokens); sampling adds fp32 logits and probabilities for
max_num_seqs rows. What is left of gpu_memory x utilization goes to the KV cache. Videos are listed with the
tokens they take in a prompt (sampled at fps 2), up to the largest the limits allow (max_frames frames).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fovea.config.engine import check_model_split, tower_split_obstacles
from fovea.config.flags import default
from fovea.config.image import largest_side
from fovea.config.model import ModelConfig, serving_dtype
from fovea.models.registry import family

IMAGE_SIZES = [(448, 448), (1280, 720), (1920, 1080), (3840, 2160)]  # width x height, as a user would send them
VIDEO_CLIPS = [(10, 1280, 720), (60, 1280, 720), (600, 1920, 1080)]  # seconds, width, height (30 fps)
GIB = 2**30


@dataclass
class MemoryPlan:
    weights_bytes: int
    kv_bytes_per_token: int
    lm_activation_bytes: int
    images: list[tuple[int, int, int, int]]  # width, height, image tokens, vision-tower activation bytes
    videos: list[tuple[str, int, int, int]]  # what, frames kept, tokens, vision-tower activation bytes per step
    kv_tokens: int
    max_model_len: int
    dtype: str  # the dtype the engine would serve in on a GPU
    quantization: str | None = None  # the checkpoint's quantized weights (method, format)
    kv_tokens_by_dtype: dict[str, int] | None = None  # the KV capacity in the model's dtype and in fp8

    @property
    def max_concurrency(self) -> float:
        return self.kv_tokens / self.max_model_len


def meta_model(config: ModelConfig, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model as the engine builds it (quantized layers included), on the meta device: shapes, no memory."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return family(config.architecture).Model(config)
    finally:
        torch.set_default_dtype(previous)


def count_parameters(config: ModelConfig) -> int:
    return sum(p.numel() for p in meta_model(config).parameters())


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes of every weight as the engine holds it in `dtype` (quantized weights, packed integers and float32
    scales as stored, the rest in `dtype`), and of the vision tower's."""
    model = meta_model(config, dtype)
    tower = model.visual.parameters() if model.visual is not None else ()
    return tuple(sum(p.numel() * p.element_size() for p in params) for params in (model.parameters(), tower))


def plan_memory(
    model_dir,
    gpu_memory_gib: float,
    dtype: str = default("dtype"),
    max_model_len: int | None = default("max_model_len"),
    max_num_batched_tokens: int = default("max_num_batched_tokens"),
    max_num_seqs: int = default("max_num_seqs"),
    gpu_memory_utilization: float = default("gpu_memory_utilization"),
    tensor_parallel_size: int = default("tensor_parallel_size"),
    mm_encoder_tp_mode: str = default("mm_encoder_tp_mode"),
    kv_cache_dtype: str = default("kv_cache_dtype"),
    max_pixels: int | None = None,
    hf_overrides: dict | None = default("hf_overrides"),
) -> MemoryPlan:
    config = ModelConfig.from_dir(model_dir, hf_overrides)
    text, vision = config.text, config.vision
    served = serving_dtype(config.torch_dtype, dtype, "cuda")
    size = served.itemsize
    total, tower = weight_bytes(config, served)
    # whole on every rank: a tower run data-parallel, asked or chosen (engine.py)
    whole = tower if mm_encoder_tp_mode == "data" or tower_split_obstacles(vision, tensor_parallel_size) else 0
    weights = (total - whole) // tensor_parallel_size + whole
    # KV heads split over the ranks, or replicated (one per rank) when there are fewer heads than ranks
    kv_heads = max(1, text.num_kv_heads // tensor_parallel_size)
    kv_values = text.num_layers * kv_heads * text.head_dim * 2  # per token
    kv_value_bytes = {str(served).removeprefix("torch."): size, "fp8": 1}
    kv_per_token = kv_values * (size if kv_cache_dtype == "auto" else 1)
    mlp = max(text.intermediate_size, text.moe.top_k * text.moe.intermediate_size if text.moe else 0)
    lm = max_num_batched_tokens * (3 * mlp + 4 * text.hidden_size) * size // tensor_parallel_size
    lm += max_num_seqs * text.vocab_size * 4 * 2
    processor = config.image.with_overrides({"max_pixels": max_pixels} if max_pixels else None)
    factor = processor.patch_size * processor.merge_size

    def vision_activations(tokens: int) -> int:
        patches = tokens * processor.merge_size**2
        activations = patches * (3 * vision.intermediate_size + 4 * vision.hidden_size) * size
        return activations + patches * vision.frame_patch_dim * 4 + tokens * vision.output_width * size

    images = []
    for width, height in IMAGE_SIZES + [(largest_side(processor.max_pixels, factor),) * 2]:
        tokens = processor.tokens(height, width)
        images.append((width, height, tokens, vision_activations(tokens)))
    options = config.video.with_kwargs({"max_pixels": max_pixels} if max_pixels else None)
    clips = (
        [
            (f"{seconds} s {width}x{height}", options.frame_indices(seconds * 30, 30), (height, width))
            for seconds, width, height in VIDEO_CLIPS
        ]
        if config.video_token_id is not None or config.video_text is not None
        else []
    )
    most = options.max_frames // 2 * 2  # the largest video: max_frames kept, frames as large as that allows
    side = largest_side(options.largest_frame_pixels(factor, most), factor)
    if clips:
        clips.append((f"largest ({most} frames)", range(most), (side, side)))
    videos = []
    for what, kept, (height, width) in clips:
        h, w = options.frame_size(height, width, len(kept), factor)
        per_patch = (h // factor) * (w // factor)
        tokens = -(-len(kept) // options.frames_per_patch) * per_patch  # odd counts padded to whole temporal patches
        step = min(tokens, max(per_patch, max_num_batched_tokens // per_patch * per_patch))
        videos.append((what, len(kept), tokens, vision_activations(step)))
    peak = max(lm, max(a for *_, a in images + videos))
    budget = max(0, gpu_memory_gib * GIB * gpu_memory_utilization - weights - peak)
    max_model_len = max_model_len or config.max_context
    quant = text.quant
    return MemoryPlan(
        weights,
        kv_per_token,
        lm,
        images,
        videos,
        int(budget // kv_per_token),
        max_model_len,
        str(served).removeprefix("torch."),
        None if quant is None else f"{quant.method} ({quant.source})",
        {name: int(budget // (kv_values * value)) for name, value in kv_value_bytes.items()},
    )


def smallest_fitting_size(model_dir, gpu_memory_gib: float, **options) -> int | None:
    """The smallest tensor_parallel_size (a power of two the model splits over: heads, widths, quantization
    blocks) whose per-GPU plan fits."""
    text = ModelConfig.from_dir(model_dir, options.get("hf_overrides")).text
    for size in (1, 2, 4, 8, 16, 32):
        try:
            check_model_split(text, size)
        except ValueError:
            continue
        plan = plan_memory(model_dir, gpu_memory_gib, tensor_parallel_size=size, **options)
        if plan.kv_tokens >= plan.max_model_len:
            return size
    return None


def format_plan(plan: MemoryPlan, title: str) -> str:
    lines = [
        title,
        f"{'weights':<34}{plan.weights_bytes / GIB:>10.2f} GiB",
    ]
    if plan.quantization:
        lines.append(f"{'  quantized':<34}{plan.quantization:>14}")
    lines += [
        f"{'KV cache per token':<34}{plan.kv_bytes_per_token / 1024:>10.1f} KiB",
        f"{'LM step activations (estimate)':<34}{plan.lm_activation_bytes / GIB:>10.2f} GiB",
        "",
        f"{'image (w x h)':<16}{'tokens':>8}{'vision activations (estimate)':>34}",
    ]
    lines += [f"{f'{w}x{h}':<16}{tokens:>8}{activations / GIB:>30.2f} GiB" for w, h, tokens, activations in plan.images]
    if plan.videos:  # none for a model that takes no videos
        lines += ["", f"{'video (frames kept)':<24}{'frames':>7}{'tokens':>8}{'vision activations per step':>31}"]
    lines += [
        f"{what:<24}{frames:>7}{tokens:>8}{activations / GIB:>27.2f} GiB"
        + ("  (over max_model_len)" if tokens > plan.max_model_len else "")
        for what, frames, tokens, activations in plan.videos
    ]
    lines += [
        "",
        f"KV cache: {plan.kv_tokens} tokens, max concurrency {plan.max_concurrency:.2f}x for max_model_len "
        f"{plan.max_model_len}",
    ]
    lines += [
        f"  KV cache in {name}{' (--kv-cache-dtype fp8)' if name == 'fp8' else ''}: {tokens} tokens, "
        f"{tokens / plan.max_model_len:.2f}x"
        for name, tokens in (plan.kv_tokens_by_dtype or {}).items()
    ]
    if plan.kv_tokens < plan.max_model_len:
        lines.append(
            "does not fit: lower max_model_len, max_num_batched_tokens, max_pixels or limit_mm_per_prompt; "
            "raise gpu_memory_utilization; or use more GPUs (--tensor-parallel-size)"
        )
    return "\n".join(lines)
