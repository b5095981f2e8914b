"""Resized uint8 pixels to the vision tower's input, on whatever device the pixels are on (the engine's).

Images cross from the front end as uint8 (height, width, 3) arrays, a quarter of the bytes of float32 patches
and half again for a still image's single frame. Here they are rescaled, normalized and cut into patches with
each merge group contiguous, in the same float32 operations and order as transformers' PIL processor, so on the
CPU the patches equal its `pixel_values` bit for bit (frames=2: the still image repeated, as it sends it).
"""

from __future__ import annotations

import torch

from fovea.multimodal.image import ImageProcessorConfig


def patchify(pixels: torch.Tensor, config: ImageProcessorConfig, frames: int = 1) -> torch.Tensor:
    """(height, width, channels) uint8 -> (patches, channels * frames * patch * patch) float32."""
    p, m = config.patch_size, config.merge_size
    height, width, channels = pixels.shape
    gh, gw = height // p, width // p
    # (group_row, group_col, sub_row, sub_col, channel, py, px): merge groups contiguous
    grouped = pixels.reshape(gh // m, m, p, gw // m, m, p, channels).permute(0, 3, 1, 4, 6, 2, 5)
    x = grouped.reshape(gh * gw, channels, 1, p * p).to(torch.float32)
    mean = torch.tensor(config.image_mean, dtype=torch.float32, device=pixels.device)[None, :, None, None]
    std = torch.tensor(config.image_std, dtype=torch.float32, device=pixels.device)[None, :, None, None]
    # float32 v / 255 equals the reference's float32(v * (1/255) in float64) for every uint8 v (tested), and the
    # subtraction and division are the reference's float32 operations in the same order
    x = (x / 255 - mean) / std
    return x.expand(-1, -1, frames, -1).reshape(gh * gw, -1)
