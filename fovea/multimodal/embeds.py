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


EMBED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GRID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def image_embeds(source: dict, config: ModelConfig) -> ProcessedImage:
    """The embeddings as a processed image (float32 rows in place of pixels), after checking them against the
    model. The grid comes first: it says how many rows to expect, and nothing larger is converted or read."""
    unknown = set(source) - {"image_embeds", "image_grid_thw"}
    if unknown:
        raise ValueError(f"image embeddings take image_embeds and image_grid_thw, not {sorted(unknown)}")
    merge, width = config.image.merge_size, config.vision.output_width
    grid = source.get("image_grid_thw")
    if grid is None:
        if not config.image.crop_size:
            raise ValueError("image_embeds of this model need an image_grid_thw: its images come in any size")
        side = config.image.crop_size // config.image.patch_size
        grid = (1, side, side)
    grid = read_grid(grid)
    tiles = "t" if config.image.max_tiles else "1"  # InternVL: t tiles (its thumbnail counted)
    if (grid[0] != 1 and tiles == "1") or min(grid) < 1 or grid[1] % merge or grid[2] % merge:
        raise ValueError(f"image_grid_thw must be ({tiles}, h, w) with h and w multiples of {merge}, got {list(grid)}")
    tokens = grid[0] * grid[1] * grid[2] // merge**2
    embeds = as_tensor(source["image_embeds"], "image_embeds", EMBED_DTYPES)
    if tuple(embeds.shape) != (tokens, width):
        raise ValueError(
            f"image_embeds of shape {tuple(embeds.shape)[:4]} do not fit the model: the grid {list(grid)} makes "
            f"{tokens} tokens of {width} values each"
        )
    check_storage(embeds, "image_embeds")
    values = np.ascontiguousarray(embeds.float().numpy())
    if not np.isfinite(values).all():
        raise ValueError("image_embeds hold values that are not finite")
    digest = hashlib.blake2b(values.data, digest_size=16, person=b"embeds")
    digest.update(repr((grid, str(embeds.dtype), tuple(embeds.shape))).encode())  # two grids are two inputs
    return ProcessedImage(values, grid, f"embeds-{digest.hexdigest()}", merge, embeds=True)


def read_grid(value) -> tuple[int, int, int]:
    """(t, h, w): three integers, read only once they are known to be three."""
    if isinstance(value, (list, tuple)):
        if len(value) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ValueError("image_grid_thw must be three integers (t, h, w)")
        return tuple(value)
    grid = as_tensor(value, "image_grid_thw", GRID_DTYPES)
    if grid.numel() != 3:
        raise ValueError("image_grid_thw must be three integers (t, h, w)")
    check_storage(grid, "image_grid_thw")
    return tuple(int(v) for v in grid.reshape(-1).tolist())


def check_storage(tensor: torch.Tensor, what: str) -> None:
    """Every element has bytes of its own in the tensor's storage (an expanded tensor has a stride of 0: a few
    bytes that claim gigabytes)."""
    if any(stride < 1 for stride, size in zip(tensor.stride(), tensor.shape) if size > 1):
        raise ValueError(f"{what} must be a dense tensor (it repeats its storage)")
    extent = tensor.storage_offset() + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    if tensor.numel() and (extent + 1) * tensor.element_size() > tensor.untyped_storage().nbytes():
        raise ValueError(f"{what} reaches past its storage")


def as_tensor(value, what: str, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """A strided CPU tensor of one of `dtypes`, from a tensor, an array, a list of numbers, or a base64
    torch.save of a tensor; nothing of it is converted or read here."""
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
            value = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
        except (binascii.Error, pickle.UnpicklingError, ValueError, RuntimeError, EOFError, OSError, TypeError):
            raise ValueError(f"{what} is not a base64 torch.save of a tensor") from None
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{what} holds a {type(value).__name__}, not a tensor")
    elif not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"{what} must be a tensor, got {type(value).__name__}") from None
    if value.layout != torch.strided or value.device.type != "cpu":
        raise ValueError(f"{what} must be a dense tensor on the CPU, not {value.layout} on {value.device.type}")
    if value.dtype not in dtypes:
        if value.dtype == torch.float64 and torch.float32 in dtypes:  # numpy's and Python's floats
            return value
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{what} must hold {names}, not {str(value.dtype).removeprefix('torch.')}")
    return value
