"""Which frames of a video are kept and the size they are resized to. Settings and arithmetic only, so that the
engine's config and `fovea plan` size memory for the largest video without decoding one; the steps are in
fovea/multimodal/video.py. Three rules, one interface (`frame_indices`, `frame_size`, `largest_frame_pixels`):
- `VideoOptions`, Qwen2-VL's and Qwen2.5-VL's (qwen-vl-utils, which those models were trained with): an even
  count of frames, each frame's area bounded on its own (and by a total that shrinks frames of long videos);
- `TimestampedVideoOptions`, Qwen3-VL's (transformers' Qwen3VLVideoProcessor with the released
  video_preprocessor_config.json): n = int(total / video_fps * fps) frames clamped to [min_frames, max_frames]
  and to total (an odd count is padded with its last frame), and one area bound for all frames together
  (`size`: shortest_edge 4096, longest_edge 25165824 pixels) on 32-pixel multiples; optionally
  (`cap_pixels_per_frame`, off in transformers today) each frame at most max_video_tokens tokens or its even
  share of the total. The frames' times go into the prompt as text before each temporal patch;
- `TiledVideoOptions`, InternVL's: each kept frame is one tile, an image of its own (multimodal/prompt.py).
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

    timestamps = False  # the frames' times are in the M-RoPE positions (a stretched t index), not in the text
    frames_per_patch = FRAME_FACTOR

    def frame_indices(self, total: int, video_fps: float) -> list[int]:
        return frame_indices(total, video_fps, self)

    def frame_size(self, height: int, width: int, frames: int, factor: int = 28) -> tuple[int, int]:
        return frame_size(height, width, frames, self, factor)

    def largest_frame_pixels(self, factor: int = 28, frames: int = FRAME_FACTOR) -> float:
        """The most pixels one frame may get when `frames` are kept (the fewest, two, get the most)."""
        return frame_max_pixels(self, frames)


@dataclass(frozen=True)
class TimestampedVideoOptions:
    """Qwen3-VL's names and defaults (transformers' Qwen3VLVideoProcessor, the released size); per request through
    mm_processor_kwargs. `min_pixels` / `max_pixels` there are the images' settings, not these."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    shortest_edge: int = 4096  # the fewest pixels of all kept frames together
    longest_edge: int = 25165824  # the most pixels of all kept frames together
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768  # with cap_pixels_per_frame: the most tokens of one frame

    timestamps = True
    frames_per_patch = FRAME_FACTOR

    @classmethod
    def from_preprocessor(cls, config: dict) -> TimestampedVideoOptions:
        """From a checkpoint's video_preprocessor_config.json (defaults where it is silent)."""
        size = config.get("size") or {}
        names = {"fps", "min_frames", "max_frames", "cap_pixels_per_frame", "max_video_tokens"}
        given = {k: v for k, v in config.items() if k in names and v is not None}
        given |= {k: size[k] for k in ("shortest_edge", "longest_edge") if k in size}
        return cls().with_kwargs(given)

    def with_kwargs(self, kwargs: dict | None, capped: bool = False) -> TimestampedVideoOptions:
        """As VideoOptions.with_kwargs; `capped` also keeps the total area at this config's."""
        kwargs = {k: v for k, v in (kwargs or {}).items() if k in self.__dataclass_fields__}
        for key, value in kwargs.items():
            if key == "cap_pixels_per_frame":
                if not isinstance(value, bool):
                    raise ValueError(
                        f"mm_processor_kwargs['cap_pixels_per_frame'] must be true or false, got {value!r}"
                    )
            elif not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ValueError(f"mm_processor_kwargs[{key!r}] must be a positive finite number, got {value!r}")
        if capped:
            for key in ("min_frames", "max_frames", "shortest_edge", "longest_edge", "max_video_tokens"):
                if key in kwargs:
                    kwargs[key] = min(kwargs[key], getattr(self, "max_frames" if key == "min_frames" else key))
        return replace(self, **kwargs)

    def frame_indices(self, total: int, video_fps: float) -> list[int]:
        if total < FRAME_FACTOR:
            raise ValueError(f"a video needs at least {FRAME_FACTOR} frames, this one has {total}")
        count = min(max(int(total / video_fps * self.fps), self.min_frames), self.max_frames, total)
        count = max(FRAME_FACTOR, int(count))
        return np.linspace(0, total - 1, count).round().astype(np.int64).tolist()

    def _frames_max_pixels(self, frames: int, factor: int) -> float:
        if not self.cap_pixels_per_frame:
            return self.longest_edge
        per_frame = min(self.max_video_tokens * factor * factor, self.longest_edge // frames)
        return max(per_frame, int(self.shortest_edge * 1.05)) * frames

    def frame_size(self, height: int, width: int, frames: int, factor: int = 32) -> tuple[int, int]:
        if min(height, width) < factor:  # a side under one patch group is scaled up first
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        limit = self._frames_max_pixels(frames, factor)
        return smart_resize(height, width, factor, self.shortest_edge, limit, frames=frames)

    def largest_frame_pixels(self, factor: int = 32, frames: int = FRAME_FACTOR) -> float:
        """The most pixels one frame may get when `frames` are kept, sharing the total."""
        return self._frames_max_pixels(frames, factor) / frames


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


def media_io_processor_kwargs(media_io: dict | None) -> dict:
    """vLLM's media_io_kwargs (how media are loaded) as the processor settings they come to here: video
    `num_frames` (that many frames, evenly spread; for Qwen2-VL and Qwen2.5-VL an even count) and `fps` (frames
    kept per second); image `image_mode` RGB (images are always converted to RGB). Capped, like
    mm_processor_kwargs, by the server's own limits."""
    if not media_io:
        return {}
    if not isinstance(media_io, dict) or set(media_io) - {"video", "image"}:
        raise ValueError(f"media_io_kwargs takes video and image settings, got {media_io!r}")
    video, image = media_io.get("video") or {}, media_io.get("image") or {}
    unknown = [f"video.{key}" for key in set(video) - {"num_frames", "fps"}]
    unknown += [f"image.{key}" for key in set(image) - {"image_mode"}]
    if unknown:
        raise ValueError(f"media_io_kwargs {sorted(unknown)} are not supported: video num_frames and fps, image_mode")
    if image.get("image_mode", "RGB") != "RGB":
        raise ValueError(f"media_io_kwargs image_mode {image['image_mode']!r}: images are read as RGB only")
    kwargs = {}
    if "num_frames" in video:
        frames = video["num_frames"]
        if not isinstance(frames, int) or isinstance(frames, bool) or frames < FRAME_FACTOR:
            raise ValueError(f"media_io_kwargs video num_frames must be an integer of at least 2, got {frames!r}")
        kwargs.update(min_frames=frames, max_frames=frames)  # as many as asked, whatever the rate
    if "fps" in video:
        kwargs["fps"] = video["fps"]
    return kwargs


@dataclass(frozen=True)
class TiledVideoOptions:
    """InternVL's rule: each kept frame resized whole to one `side` x `side` tile (no grid of tiles, no thumbnail),
    the frames one apart (no temporal patches). A file keeps `max_frames` frames (32, vLLM's video loader's count
    and the published chat example's default), or `fps` a second when given, at most max_frames and the frames
    there are; each is the middle one of its equal share of the video (transformers' InternVLVideoProcessor's
    sample_frames with its initial shift; the published example's segments too). Frames handed over in memory
    are all kept, as transformers and vLLM keep them, up to max_frames. Per request through
    mm_processor_kwargs (vLLM's media_io_kwargs video num_frames sets max_frames)."""

    side: int = 448
    max_frames: int = 32
    fps: float | None = None

    timestamps = False
    frames_per_patch = 1

    def with_kwargs(self, kwargs: dict | None, capped: bool = False) -> TiledVideoOptions:
        """These options with `mm_processor_kwargs`' max_frames and fps applied (max_frames at most this
        config's when `capped`: the engine sized its budgets for it)."""
        kwargs = {k: v for k, v in (kwargs or {}).items() if k in ("max_frames", "fps")}
        for key, value in kwargs.items():
            number = isinstance(value, int) if key == "max_frames" else isinstance(value, (int, float))
            if not number or isinstance(value, bool) or not 0 < value < math.inf:
                kind = "a positive integer" if key == "max_frames" else "a positive finite number"
                raise ValueError(f"mm_processor_kwargs[{key!r}] must be {kind}, got {value!r}")
        if capped and "max_frames" in kwargs:
            kwargs["max_frames"] = min(kwargs["max_frames"], self.max_frames)
        return replace(self, **kwargs)

    def frame_indices(self, total: int, video_fps: float) -> list[int]:
        if total < 1:
            raise ValueError("the video has no frames")
        count = self.max_frames if self.fps is None or not video_fps else int(total / video_fps * self.fps)
        count = max(1, min(count, self.max_frames, total))
        step = total / count
        return [int(step / 2 + index * step) for index in range(count)]

    def frame_size(self, height: int, width: int, frames: int, factor: int = 28) -> tuple[int, int]:
        return self.side, self.side

    def largest_frame_pixels(self, factor: int = 28, frames: int = 1) -> float:
        return self.side * self.side
