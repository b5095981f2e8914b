"""Reading video files with PyAV (FFmpeg): what a file holds (frame count, rate, size) and the RGB frames at given
indices. PyAV is the library because it installs as one wheel with FFmpeg inside (H.264, HEVC, VP9, AV1; no
torchvision), is what torchvision's and transformers' own video readers call, and decoded a 60 s 720p H.264 clip
as fast as OpenCV and faster than decord2 here (benchmarks/video_decode.py; docs/offline.md, "Videos").

Every frame up to the last one kept is decoded (inter-frame codecs need their predecessors); only the kept ones are
converted to RGB, which is most of the per-frame cost. Any failure is a ValueError naming the problem: a server
answers 400 for it. This runs in the decoding worker processes when the server has them, so a decoder that
crashes on a crafted file takes down only that worker.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import numpy as np

# the most frames a file may hold (decoding time grows with it even when few are kept): an hour at 30 fps
MAX_VIDEO_FRAMES = int(os.environ.get("FOVEA_MAX_VIDEO_FRAMES", 108000))
MAX_FRAME_PIXELS = int(os.environ.get("FOVEA_MAX_VIDEO_FRAME_PIXELS", 4096 * 2160))


@dataclass(frozen=True)
class VideoInfo:
    frames: int
    fps: float
    height: int
    width: int


def _av():
    try:
        import av
    except ImportError:
        raise ValueError("reading video files needs PyAV: pip install av") from None
    return av


def probe(data: bytes) -> VideoInfo:
    """The frame count, rate and size of an encoded video, from its header (or, where the container does not
    say, by counting packets without decoding them)."""
    av = _av()
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise ValueError("the video file has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            frames = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
            info = VideoInfo(frames, float(rate or 0), stream.height, stream.width)
    except av.error.FFmpegError as error:
        raise ValueError(f"the video could not be read: {error.strerror or error}") from None
    check(info)
    return info


def check(info: VideoInfo) -> None:
    if info.frames <= 0:
        raise ValueError("the video has no frames")
    if info.frames > MAX_VIDEO_FRAMES:
        raise ValueError(f"the video has {info.frames} frames; at most {MAX_VIDEO_FRAMES} are read")
    if info.fps <= 0:
        raise ValueError("the video does not say its frame rate")
    if info.height <= 0 or info.width <= 0 or info.height * info.width > MAX_FRAME_PIXELS:
        raise ValueError(
            f"video frames of {info.width}x{info.height} are outside what is read (at most {MAX_FRAME_PIXELS} pixels)"
        )


def decode(data: bytes, indices: list[int], resize=None) -> list[np.ndarray]:
    """The frames at `indices` (sorted, repeats allowed) as (height, width, 3) uint8, each passed through
    `resize` as soon as it is decoded (so only resized frames are kept)."""
    av = _av()
    wanted: dict[int, int] = {}
    for index in indices:
        wanted[index] = wanted.get(index, 0) + 1
    frames: list[np.ndarray] = []
    last, decoded = max(indices), 0
    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for frame in container.decode(stream):
                if decoded in wanted:
                    rgb = frame.to_ndarray(format="rgb24")
                    frames += [resize(rgb) if resize else rgb] * wanted[decoded]
                decoded += 1
                if decoded > last:
                    break
    except av.error.FFmpegError as error:
        raise ValueError(f"the video could not be decoded: {error.strerror or error}") from None
    if len(frames) < len(indices):
        raise ValueError(f"the video ended after {decoded} decodable frames; its header promised {last + 1} or more")
    return frames
