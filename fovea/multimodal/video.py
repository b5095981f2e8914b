"""Videos for Qwen2-VL, Qwen2.5-VL and Qwen3-VL: which frames are kept, the size they are resized to, and their time.

Qwen3-VL's rule (config/video.py, TimestampedVideoOptions) keeps frames and sizes them its own way, and its
frames' time is text: each temporal patch gets the mean of its two frames' times (index / source fps), written
`<1.5 seconds>` before it in the prompt (prompt.py). The rest of this note is Qwen2.5-VL's.

Qwen's published video path (qwen-vl-utils, which the model was trained with), step by step:
- frames kept: n = total / video_fps * fps, clamped to [min_frames rounded up to even, min(max_frames, total)
  rounded down to even] and to total, then rounded down to even (two frames make one temporal patch); their
  indices are n evenly spaced over [0, total - 1], rounded;
- size: smart_resize of the source size with factor 28, min_pixels, and max_pixels = max(min(max_pixels,
  total_pixels / n * 2), min_pixels * 1.05) (a long video gets smaller frames);
- time: the kept frames' rate is n / total * video_fps, so one temporal patch (2 frames) spans
  second_per_grid_t = 2 / that rate seconds, which stretches the M-RoPE time index (mrope_positions.py).
Frames handed over in memory without a rate are taken as already sampled at fps (transformers' processor and vLLM
do the same): all are kept, an odd count padded with its last frame.
Frames are resized one by one like still images (PIL bicubic on uint8). A video is planned before any pixel is
decoded (frames kept, their size, so its token count), as images are: a file's header says its frame count, rate
and size (video_decode.py), and a prompt too long is refused before decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from fovea.config.video import FRAME_FACTOR, TiledVideoOptions, TimestampedVideoOptions, VideoOptions
from fovea.multimodal import video_decode
from fovea.multimodal.image import ProcessedImage, encoded_bytes, pixels_hash
from fovea.multimodal.video_decode import VideoInfo


def as_frames(video) -> tuple[list, float | None]:
    """vLLM's forms: a (T, H, W, 3) uint8 array, a list of PIL images or arrays, or (frames, metadata) with
    metadata["fps"]. Returns the frames and the source fps (None when unknown)."""
    fps = None
    if isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], dict):
        video, fps = video[0], video[1].get("fps")
    if isinstance(video, np.ndarray):
        if video.ndim != 4 or video.shape[-1] != 3 or video.dtype != np.uint8:
            raise ValueError(f"a video array must be (frames, height, width, 3) uint8, got {video.dtype} {video.shape}")
        return list(video), fps
    if isinstance(video, (list, tuple)) and video and all(isinstance(f, (Image.Image, np.ndarray)) for f in video):
        return list(video), fps
    raise ValueError(
        "a video is a file (bytes, a path or a URL), a (frames, height, width, 3) uint8 array, a "
        "list of frames, or (frames, {'fps': ...})"
    )


def video_list(value) -> list:
    """multi_modal_data["video"] as a list of videos: one video is a file, an array, a list of frames or (frames,
    metadata); several are a list of those."""
    if value is None or (isinstance(value, list) and not value):
        return []
    first = value[0] if isinstance(value, list) else None
    several = isinstance(first, (list, tuple, bytes, str)) or (isinstance(first, np.ndarray) and first.ndim == 4)
    return list(value) if several else [value]  # a list of (height, width, 3) arrays is one video's frames


def is_encoded(source) -> bool:
    return isinstance(source, (bytes, bytearray, memoryview, str)) or hasattr(source, "__fspath__")


@dataclass
class PlannedVideo:
    """A video whose kept frames and their size are known and whose pixels are not decoded yet: `frames` in
    memory (offline arrays) or `data`, an encoded file (decoded by a worker process when the server has them)."""

    indices: list[int]
    height: int
    width: int
    grid: tuple[int, int, int]
    second_per_grid_t: float
    merge_size: int
    frames: list | None = None
    data: bytes | None = None
    timestamps: tuple[float, ...] | None = None  # Qwen3-VL: each temporal patch's time in seconds, as text

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w // self.merge_size**2


def plan_video(
    source,
    options: VideoOptions | TimestampedVideoOptions | TiledVideoOptions,
    probe=video_decode.probe,
    patch_size: int = 14,
    merge_size: int = 2,
) -> PlannedVideo:
    """`probe(data) -> VideoInfo` reads a file's header (in a worker process on a server)."""
    frames = data = None
    if is_encoded(source):
        data = encoded_bytes(source, "video")[0]
        info = probe(data)
    else:
        frames, fps = as_frames(source)
        first = frames[0]
        height, width = first.shape[:2] if isinstance(first, np.ndarray) else (first.height, first.width)
        info = VideoInfo(len(frames), fps or options.fps, height, width)
    if frames is not None and fps is None and len(frames) <= options.max_frames:
        # frames given without a rate are already sampled at fps: all are kept, and an odd count gets its last frame
        # repeated to whole temporal patches, as transformers' video processor does (and vLLM, which hands it them)
        indices, video_fps = list(range(len(frames))), info.fps
    else:
        indices, video_fps = options.frame_indices(info.frames, info.fps), info.fps
    per_patch = options.frames_per_patch
    # (InternVL's frames, without a rate, have no time step: their positions do not depend on it)
    second_per_grid_t = per_patch / (len(indices) / info.frames * info.fps) if info.fps else 0.0
    sampled = len(indices)  # Qwen3-VL sizes frames by the count before padding
    indices += indices[-1:] * (-len(indices) % per_patch)
    height, width = options.frame_size(
        info.height, info.width, sampled if options.timestamps else len(indices), patch_size * merge_size
    )
    grid = (len(indices) // per_patch, height // patch_size, width // patch_size)
    timestamps = None
    if options.timestamps:  # each temporal patch: the mean time of its first and last frame
        times = [index / video_fps for index in indices]
        timestamps = tuple((times[i] + times[i + 1]) / 2 for i in range(0, len(times), FRAME_FACTOR))
    return PlannedVideo(indices, height, width, grid, second_per_grid_t, merge_size, frames, data, timestamps)


def process_video(planned: PlannedVideo) -> ProcessedImage:
    """The kept frames decoded and resized: pixels (T, H, W, 3) uint8 with T even, grid (T / 2, H / 14, W / 14)."""
    size = (planned.width, planned.height)

    def resized(frame) -> np.ndarray:
        image = Image.fromarray(frame) if isinstance(frame, np.ndarray) else frame.convert("RGB")
        return np.asarray(image if image.size == size else image.resize(size, resample=Image.BICUBIC))

    if planned.data is not None:
        pixels = np.stack(video_decode.decode(planned.data, planned.indices, resized))
    else:
        pixels = np.stack([resized(planned.frames[index]) for index in planned.indices])
    # the time step is part of what the tokens mean (their positions): two fps of the same frames never share cache
    content_hash = pixels_hash(pixels, planned.grid) + f"-t{planned.second_per_grid_t!r}"
    return ProcessedImage(
        pixels, planned.grid, content_hash, planned.merge_size, planned.second_per_grid_t, planned.timestamps
    )


def frame_images(video: ProcessedImage) -> list[ProcessedImage]:
    """InternVL's video as its frames, each an image of one tile (their tokens lie apart, each after "FrameN: " in
    the text). Frames in shared memory stay one segment, each image naming its frame of it (`frames`)."""
    _, height, width = video.grid_thw
    in_memory = isinstance(video.pixels, np.ndarray)
    return [
        ProcessedImage(
            video.pixels[index : index + 1] if in_memory else video.pixels,
            (1, height, width),
            f"{video.content_hash}-f{index}",
            video.merge_size,
            frames=None if in_memory else (index, index + 1),
        )
        for index in range(video.grid_thw[0])
    ]
