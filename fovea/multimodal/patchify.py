"""Resized uint8 pixels to the vision tower's input, on whatever device the pixels are on (the engine's).

Images cross from the front end as uint8 (height, width, 3) arrays, a quarter of the bytes of float32 patches
and half again for a still image's single frame. Here they are rescaled, normalized and cut into patches with
each merge group contiguous, in the same float32 operations and order as transformers' PIL processor, so on the
CPU the patches equal its `pixel_values` bit for bit (frames=2: the still image repeated, as it sends it).
"""

from __future__ import annotations

import numpy as np
import torch

from fovea.config.image import ImageProcessorConfig


def patchify(pixels: torch.Tensor, config: ImageProcessorConfig, frames: int = 1) -> torch.Tensor:
    """A still image's (height, width, channels) uint8 -> (patches, channels * frames * patch * patch) float32
    (frames=2: the image as its own second frame); a video's (T, height, width, channels) -> (T / 2 * patches,
    channels * 2 * patch * patch), each patch holding its two consecutive frames."""
    p, m = config.patch_size, config.merge_size
    video = pixels.ndim == 4
    clip = pixels if video else pixels[None]
    count, height, width, channels = clip.shape
    span = config.temporal_patch_size if video else 1
    gt, gh, gw = count // span, height // p, width // p
    # (time, group_row, group_col, sub_row, sub_col, channel, frame, py, px): merge groups contiguous
    grouped = clip.reshape(gt, span, gh // m, m, p, gw // m, m, p, channels).permute(0, 2, 5, 3, 6, 8, 1, 4, 7)
    x = grouped.reshape(gt * gh * gw, channels, span, p * p).to(torch.float32)
    mean = torch.tensor(config.image_mean, dtype=torch.float32, device=pixels.device)[None, :, None, None]
    std = torch.tensor(config.image_std, dtype=torch.float32, device=pixels.device)[None, :, None, None]
    # float32 v / 255 equals the reference's float32(v * (1/255) in float64) for every uint8 v (tested), and the
    # subtraction and division are the reference's float32 operations in the same order
    x = (x / 255 - mean) / std
    return (x if video else x.expand(-1, -1, frames, -1)).reshape(gt * gh * gw, -1)


def batch_patches(pixels: list[np.ndarray], config: ImageProcessorConfig, device, dtype) -> torch.Tensor:
    """Several items' uint8 pixels (images, videos) -> their patches one after another, in `dtype` on `device`: one
    frame per still image, or, when a video is among them, `temporal_patch_size` (a still image then counts as
    its own second frame: the patches have one width)."""
    video = any(item.ndim == 4 for item in pixels)
    frames = config.temporal_patch_size if video else 1
    return torch.cat([patchify(torch.from_numpy(item).to(device), config, frames) for item in pixels]).to(dtype)
