"""Which frames of a video are kept and the size they are resized to, from Qwen's options (qwen-vl-utils, which
the model was trained with; the steps are in fovea/multimodal/video.py). Settings and arithmetic only, so that the
engine's config and `fovea plan` size memory for the largest video without decoding one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from fovea.config.image import smart_resize

FRAME_FACTOR = 2  # frames per temporal patch


@dataclass(frozen=True)
class VideoOptions:
    """Qwen's names and defaults (qwen-vl-utils); per request through mm_processor_kwargs."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    total_pixels: int = int(128000 * 28 * 28 * 0.9)

    def with_kwargs(self, kwargs: dict | None, capped: bool = False) -> VideoOptions:
        """These options with `mm_processor_kwargs` applied. `capped` (per request): frames and pixels may not go
        above this config's, which the engine sized its memory and encoder cache for."""
        kwargs = {k: v for k, v in (kwargs or {}).items() if k in self.__dataclass_fields__}
        for key, value in kwargs.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ValueError(f"mm_processor_kwargs[{key!r}] must be a positive finite number, got {value!r}")
        if capped:
            bounds = {
                "min_frames": self.max_frames,
                "max_frames": self.max_frames,
                "min_pixels": self.max_pixels,
                "max_pixels": self.max_pixels,
                "total_pixels": self.total_pixels,
            }
            kwargs = {k: min(v, bounds[k]) if k in bounds else v for k, v in kwargs.items()}
        return replace(self, **kwargs)


def frame_indices(total: int, video_fps: float, options: VideoOptions) -> list[int]:
    if total < FRAME_FACTOR:
        raise ValueError(f"a video needs at least {FRAME_FACTOR} frames, this one has {total}")
    lowest = math.ceil(options.min_frames / FRAME_FACTOR) * FRAME_FACTOR
    highest = math.floor(min(options.max_frames, total) / FRAME_FACTOR) * FRAME_FACTOR
    count = min(max(total / video_fps * options.fps, lowest), highest, total)
    count = max(FRAME_FACTOR, math.floor(count / FRAME_FACTOR) * FRAME_FACTOR)
    return np.linspace(0, total - 1, count).round().astype(np.int64).tolist()


def frame_max_pixels(options: VideoOptions, frames: int = FRAME_FACTOR) -> float:
    """The area frames are resized to at most when `frames` are kept (the fewest, two, get the most); a float,
    as the published code passes it on."""
    return max(min(options.max_pixels, options.total_pixels / frames * FRAME_FACTOR), int(options.min_pixels * 1.05))


def frame_size(height: int, width: int, frames: int, options: VideoOptions, factor: int = 28) -> tuple[int, int]:
    return smart_resize(height, width, factor, options.min_pixels, frame_max_pixels(options, frames))
