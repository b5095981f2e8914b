"""Image embeddings given in place of an image (--enable-mm-embeds, vLLM's `image_embeds`): what the vision tower
would have made of it, so the engine skips the tower for that item.

Offline, `multi_modal_data={"image": {"image_embeds": tensor, "image_grid_thw": (t, h, w)}}`; over HTTP, a content
part `{"type": "image_embeds", "image_embeds": {"image_embeds": B64, "image_grid_thw": B64 or [t, h, w]}}` (a bare
B64 string where the model's images all have one size), B64 being a base64 `torch.save` of a tensor, read with
`weights_only` (tensors only, no code). The shape is checked against the model: rows = t x h x w / merge^2 tokens
of the grid, columns = what the tower hands over per token (with Qwen3-VL's DeepStack features); anything else is a
ValueError (a 400) naming the mismatch.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import pickle

import numpy as np
import torch

from fovea.config.model import ModelConfig
from fovea.multimodal.image import ProcessedImage


def is_embeds(source) -> bool:
    return isinstance(source, dict) and "image_embeds" in source


def image_embeds(source: dict, config: ModelConfig) -> ProcessedImage:
    """The embeddings as a processed image (float32 rows in place of pixels), after checking them against the
    model."""
    unknown = set(source) - {"image_embeds", "image_grid_thw"}
    if unknown:
        raise ValueError(f"image embeddings take image_embeds and image_grid_thw, not {sorted(unknown)}")
    embeds = as_tensor(source["image_embeds"], "image_embeds").float()
    merge, width = config.image.merge_size, config.vision.output_width
    grid = source.get("image_grid_thw")
    if grid is None:
        if not config.image.crop_size:
            raise ValueError("image_embeds of this model need an image_grid_thw: its images come in any size")
        side = config.image.crop_size // config.image.patch_size
        grid = (1, side, side)
    grid = tuple(int(v) for v in as_tensor(grid, "image_grid_thw").reshape(-1).tolist())
    if len(grid) != 3 or grid[0] != 1 or min(grid) < 1 or grid[1] % merge or grid[2] % merge:
        raise ValueError(f"image_grid_thw must be (1, h, w) with h and w multiples of {merge}, got {list(grid)}")
    tokens = grid[1] * grid[2] // merge**2
    if embeds.shape != (tokens, width):
        raise ValueError(
            f"image_embeds of shape {tuple(embeds.shape)} do not fit the model: the grid {list(grid)} makes "
            f"{tokens} tokens of {width} values each"
        )
    if not torch.isfinite(embeds).all():
        raise ValueError("image_embeds hold values that are not finite")
    values = np.ascontiguousarray(embeds.numpy())
    digest = hashlib.blake2b(values.data, digest_size=16, person=b"embeds").hexdigest()
    return ProcessedImage(values, grid, f"embeds-{digest}", merge, embeds=True)


def as_tensor(value, what: str) -> torch.Tensor:
    """A tensor, an array, a list of numbers, or a base64 torch.save of a tensor."""
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
            value = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
        except (binascii.Error, pickle.UnpicklingError, ValueError, RuntimeError, EOFError, OSError):
            raise ValueError(f"{what} is not a base64 torch.save of a tensor") from None
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{what} holds a {type(value).__name__}, not a tensor")
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{what} must be a tensor, got {type(value).__name__}") from None
