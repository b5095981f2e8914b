"""Start-up memory profile: run the heaviest step the limits allow once, then give what is left to the KV cache.

The heaviest step is max_num_batched_tokens prompt tokens through the language model, plus one step's worth of
the largest image (or video frame) the limits allow through the vision tower (copies of it up to the encoder
budget), plus fp32 logits for max_num_seqs rows. On a GPU the peak allocation above the resident weights is
measured for the vision tower and the language model apart and summed (the encoder runs beside the language
model). As in vLLM, gpu_memory_utilization is this engine's share of the card, whatever else runs on it: the KV
cache gets that share less what this engine took since it started (weights, captured graphs), that peak and the
encoder cache; two engines at 0.45 fit on one GPU. An engine refuses to start when less than its share is free.
It runs before the KV cache exists, so a limit that cannot fit fails at start-up.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import torch

from fovea.attention.layer import AttentionMetadata
from fovea.config.engine import EngineConfig
from fovea.config.image import largest_side
from fovea.runner.sampler import TOP_P_SORT_ROWS, drop_outside_sorted_top_p

logger = logging.getLogger("fovea")
GIB = 2**30
CACHE_LINE = 64


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), but on the CPU in pages the kernel zeroes on first touch (calloc'd through numpy):
    torch.zeros writes every byte at once, 0.75 s for the CPU's 1 GiB KV cache at each engine start, and a cache
    is mostly never touched by a test or a short session. Aligned to a cache line, as torch's own allocations."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    raw = np.zeros(size + CACHE_LINE, dtype=np.uint8)
    start = -raw.ctypes.data % CACHE_LINE
    return torch.from_numpy(raw[start : start + size]).view(dtype).view(shape)


def largest_image_grid(config: EngineConfig) -> tuple[int, int, int]:
    """(t, h, w) patches of the largest square image, or video frame, the limits allow (the vision tower attends
    within one image or one temporal patch of a video, and a video reaches it in parts of one step's budget); a
    tiled image's t is its tiles."""
    image = config.model.image.with_overrides(config.mm_processor_kwargs)
    if image.max_tiles:  # InternVL: the most tiles, and the thumbnail
        side = image.crop_size // image.patch_size
        return image.max_pixels // image.crop_size**2, side, side
    factor = image.patch_size * image.merge_size
    side = max(factor, largest_side(config.largest_frame_pixels, factor)) // image.patch_size
    return 1, side, side


def dummy_step(model: torch.nn.Module, config: EngineConfig) -> list[tuple[int, int, int]]:
    """Runs the heaviest step once (random weights' output is thrown away); returns the image grids encoded."""
    grids = encode_largest_images(model, config)
    language_model_step(model, config)
    return grids


@torch.inference_mode()
def encode_largest_images(model: torch.nn.Module, config: EngineConfig) -> list[tuple[int, int, int]]:
    """Copies of the largest image max_pixels allows, up to one step's encoder budget, through the vision tower
    (none where encoder workers hold it)."""
    if model.visual is None:
        return []
    device, vision = config.device, config.model.vision
    grid = largest_image_grid(config)
    patches = grid[0] * grid[1] * grid[2]
    copies = max(1, config.encoder_budget // (patches // vision.spatial_merge_size**2))
    grids = [grid] * copies
    model.encode_images(torch.randn(patches * copies, vision.frame_patch_dim, device=device, dtype=config.dtype), grids)
    return grids


@torch.inference_mode()
def language_model_step(model: torch.nn.Module, config: EngineConfig) -> None:
    """max_num_batched_tokens prompt tokens through the language model, fp32 logits for max_num_seqs rows."""
    device, tokens = config.device, config.max_num_batched_tokens
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    positions = torch.arange(tokens, device=device).expand(3, tokens)
    hidden = model(ids, positions, AttentionMetadata.from_lengths([tokens], device))
    rows = hidden[: min(config.max_num_seqs, tokens)]
    logits = model.compute_logits(rows).float()
    probs = logits.softmax(-1)  # the sampler works on fp32 probabilities, a copy of them beside the logits
    if probs.is_cuda:  # and on a GPU sorts top_p rows, a slice of them at a time
        part = probs[:TOP_P_SORT_ROWS]
        drop_outside_sorted_top_p(part, torch.full((len(part),), 0.9, device=part.device))


def free_memory_at_start(config: EngineConfig) -> int:
    """Free bytes on the engine's GPU before it loads anything; fails when its share of the card is not free."""
    free, total = torch.cuda.mem_get_info(config.device)
    wanted = total * config.gpu_memory_utilization
    if free < wanted and not config.kv_cache_memory_bytes:
        raise ValueError(
            f"only {free / GIB:.2f} GiB of the GPU's {total / GIB:.2f} GiB are free, less than "
            f"gpu_memory_utilization {config.gpu_memory_utilization} asks for ({wanted / GIB:.2f} GiB): "
            "lower gpu_memory_utilization, or free the memory other processes hold"
        )
    return free


def kv_cache_budget(total: int, utilization: float, used_by_engine: int, peak_extra: int, reserved: int) -> int:
    """Bytes for the KV cache: the engine's share of the card, less what it took since it started, the step's
    peak above that, and `reserved` (the encoder cache)."""
    return int(total * utilization - used_by_engine - peak_extra - reserved)


def profile_kv_budget(model: torch.nn.Module, config: EngineConfig, free_at_start: int) -> int:
    device = config.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    resident = torch.cuda.memory_allocated(device)
    peak_extra = 0
    for part in (encode_largest_images, language_model_step):  # the encoder runs beside a language-model step
        torch.cuda.reset_peak_memory_stats(device)
        part(model, config)
        torch.cuda.synchronize(device)
        peak_extra += torch.cuda.max_memory_allocated(device) - resident
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    encoder_cache = config.encoder_cache_size * config.model.vision.output_width * config.dtype.itemsize
    used = free_at_start - free
    budget = kv_cache_budget(total, config.gpu_memory_utilization, used, peak_extra, encoder_cache)
    logger.info(
        "memory profile: this engine uses %.2f GiB (weights %.2f GiB), step peak %.2f GiB, encoder cache "
        "%.2f GiB, KV cache %.2f GiB of %.2f GiB x %.2f",
        used / GIB,
        resident / GIB,
        peak_extra / GIB,
        encoder_cache / GIB,
        budget / GIB,
        total / GIB,
        config.gpu_memory_utilization,
    )
    return budget


def fit_max_model_len(config: EngineConfig, capacity: int, kv_cache_bytes: int) -> EngineConfig:
    """The config with max_model_len at most the `capacity` tokens the KV cache holds when it was the model's
    own; an asked max_model_len that one sequence could not fill fails now, not while serving."""
    if capacity < config.max_model_len:
        if not config.max_model_len_from_model:
            gib = kv_cache_bytes / capacity / GIB  # per token
            raise ValueError(
                f"max_model_len {config.max_model_len} needs {config.max_model_len * gib:.2f} GiB of KV cache, "
                f"but only {capacity} tokens ({capacity * gib:.2f} GiB) fit. Lower max_model_len (to at most "
                f"{capacity}), max_num_batched_tokens, max_pixels (mm_processor_kwargs) or limit_mm_per_prompt; "
                "raise gpu_memory_utilization (or kv_cache_memory_bytes / num_gpu_blocks_override); or use a "
                "GPU with more memory."
            )
        logger.info(
            "max_model_len lowered from the model's %d to the %d tokens the KV cache holds",
            config.max_model_len,
            capacity,
        )
        config = dataclasses.replace(config, max_model_len=capacity)  # a longer sequence could never run
    logger.info(
        "KV cache: %d tokens of %s, max concurrency %.2fx for max_model_len %d",
        capacity,
        str(config.kv_dtype).removeprefix("torch."),
        capacity / config.max_model_len,
        config.max_model_len,
    )
    return config
