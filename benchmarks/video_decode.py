"""Which library decodes videos for fovea: PyAV, OpenCV and decord2 on the same 60 s 720p H.264 clip.

The clip is written here with PyAV's libx264 (30 fps, moving shapes over noise, default GOP), then each library
opens it, finds the frame count and rate, and returns the frames Qwen's sampling keeps at fps 2 (120 frames) as
RGB uint8 arrays, in one thread and in the library's own threads. Each run is timed three times; the median is
printed. Run: python benchmarks/video_decode.py [--seconds 60] [--out benchmarks/results/video_decode.json]
(needs `pip install av opencv-python-headless decord2`; a library that is missing is skipped and said so).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time

import numpy as np


def write_clip(path: str, seconds: int, fps: int = 30, width: int = 1280, height: int = 720) -> None:
    import av

    rng = np.random.default_rng(0)
    noise = rng.integers(0, 40, (height, width, 3), dtype=np.uint8)
    ys, xs = np.mgrid[0:height, 0:width]
    with av.open(path, "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(seconds * fps):
            frame = noise.copy()
            cx, cy = (40 + 9 * i) % width, (60 + 5 * i) % height
            frame[(xs - cx) ** 2 + (ys - cy) ** 2 < 90**2] = (200, 80, 30)
            frame[:, (i * 4) % width : (i * 4) % width + 30] = (20, 180, 220)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def kept(total: int, fps: float) -> set[int]:
    count = max(2, int(total / fps * 2) // 2 * 2)
    return set(np.linspace(0, total - 1, count).round().astype(int).tolist())


def pyav(path: str, threaded: bool) -> int:
    import av

    with av.open(path) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO" if threaded else "SLICE"
        stream.thread_count = 0 if threaded else 1
        wanted = kept(stream.frames, float(stream.average_rate))
        frames = [f.to_ndarray(format="rgb24") for i, f in enumerate(container.decode(stream)) if i in wanted]
    return len(frames)


def opencv(path: str, threaded: bool) -> int:
    import cv2

    cv2.setNumThreads(0 if threaded else 1)
    capture = cv2.VideoCapture(path, cv2.CAP_FFMPEG, [cv2.CAP_PROP_N_THREADS, 0 if threaded else 1])
    total, fps = int(capture.get(cv2.CAP_PROP_FRAME_COUNT)), capture.get(cv2.CAP_PROP_FPS)
    wanted, frames = kept(total, fps), []
    for i in range(total):
        if not capture.grab():
            break
        if i in wanted:
            frames.append(cv2.cvtColor(capture.retrieve()[1], cv2.COLOR_BGR2RGB))
    capture.release()
    return len(frames)


def decord2(path: str, threaded: bool) -> int:
    import decord

    reader = decord.VideoReader(path, num_threads=0 if threaded else 1)
    indices = sorted(kept(len(reader), reader.get_avg_fps()))
    return len(reader.get_batch(indices).asnumpy())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    path = os.path.join(tempfile.mkdtemp(), "clip.mp4")
    started = time.perf_counter()
    write_clip(path, args.seconds)
    print(
        f"clip: {args.seconds} s 1280x720 30 fps H.264, {os.path.getsize(path) / 1e6:.1f} MB, "
        f"written in {time.perf_counter() - started:.0f} s"
    )
    rows = []
    for name, decode in (("pyav", pyav), ("opencv", opencv), ("decord2", decord2)):
        for threaded in (False, True):
            try:
                times, count = [], 0
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    count = decode(path, threaded)
                    times.append(time.perf_counter() - start)
            except ImportError as error:
                print(f"{name}: not installed ({error})")
                break
            rows.append(
                {
                    "library": name,
                    "threads": "library's" if threaded else 1,
                    "frames_returned": count,
                    "seconds_median": statistics.median(times),
                    "seconds_all": times,
                }
            )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "clip_seconds": args.seconds,
        "clip_bytes": os.path.getsize(path),
        "cores": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "commit": commit,
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as file:
            json.dump(result, file, indent=1)
    print(f"{'library':10} {'threads':10} {'frames':>6} {'s (median)':>10} {'x realtime':>10}")
    for row in rows:
        print(
            f"{row['library']:10} {str(row['threads']):10} {row['frames_returned']:6d} "
            f"{row['seconds_median']:10.2f} {args.seconds / row['seconds_median']:10.1f}"
        )


if __name__ == "__main__":
    main()
