"""Image and video decoding and resizing in worker processes (--mm-processor-workers), pixels handed over in
shared memory.

Decoding a JPEG (or a video's frames) and resizing it is most of a request's front-end work, and in threads of
one process it all runs under one GIL next to the event loop. Here N processes do it: the front end plans each
image from its header and each video from its file's header (read by a worker too: FFmpeg parses it), cheap
steps after which limits are checked; a worker decodes and resizes it into a shared-memory segment and returns a
`SharedPixels` handle; the handle (a name) is what crosses to the engine, which maps the pixels and frees the
segment (`take`). A worker that crashes on a crafted file, or hangs, fails only that request and is replaced.
`LocalDecoder` is the same interface in the calling thread (the offline API, --mm-processor-workers 0).
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from fovea.multimodal import video_decode
from fovea.multimodal.image import ImageProcessor, PlannedImage, ProcessedImage, planned_grid
from fovea.multimodal.video import PlannedVideo, process_video
from fovea.worker_pool import WorkerFailed, WorkerPool, answer_jobs, ignore_group_signals

SHM_FILES = "/dev/shm"  # where POSIX shared memory segments are files (Linux)


@dataclass(frozen=True)
class SharedPixels:
    """Resized (height, width, 3) uint8 pixels (a video's: (frames, height, width, 3)) in a shared-memory segment.
    Whoever ends up with the handle frees the segment: the engine by `take`, the front end by `release` when the
    request never got there."""

    name: str
    shape: tuple[int, ...]
    borrowed: bool = False  # the segment stays with its owner (a beam search's steps): `take` maps it, frees nothing

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape))

    @classmethod
    def create(cls, pixels: np.ndarray, name: str) -> SharedPixels:
        """In a decoding worker, under the name the front end chose (`new_segment_name`); in the front end (a
        processor-cache hit), under a name of its own."""
        segment = shared_memory.SharedMemory(name, create=True, size=max(pixels.nbytes, 1))
        view = np.ndarray(pixels.shape, np.uint8, buffer=segment.buf)
        view[:] = pixels
        del view  # the segment cannot be closed while an array looks into it
        segment.close()
        return cls(segment.name, tuple(pixels.shape))

    def take(self) -> np.ndarray:
        """The pixels, and the segment freed. Where segments are files (Linux's /dev/shm) the pixels stay in its
        pages, mapped copy-on-write: the name goes now, the pages when the array does. A copy (megabytes an image)
        would be made on the engine's loop, between steps, in the heap its long-lived objects share."""
        file = os.path.join(SHM_FILES, self.name)
        if not os.path.isdir(SHM_FILES):
            return self.peek(free=not self.borrowed)
        if not os.path.exists(file):
            if self.borrowed:  # its owner has ended (a beam search its client left): the request goes with it
                raise ValueError(f"the shared pixels {self.name} were withdrawn by their owner")
            raise FileNotFoundError(f"the shared pixels {self.name} are gone (taken already, or freed)")
        import torch  # loaded where pixels are taken (the engine, or a front end beside a remote one)

        mapped = torch.from_file(file, shared=False, size=max(self.nbytes, 1), dtype=torch.uint8)
        if not self.borrowed:
            self.release()
        return mapped[: self.nbytes].numpy().reshape(self.shape)

    def peek(self, free: bool = False, copy: Callable[[np.ndarray], np.ndarray] = np.copy) -> np.ndarray:
        """A copy of the pixels (made by `copy`); the segment stays for whoever takes it, unless `free`."""
        segment = shared_memory.SharedMemory(name=self.name)
        try:
            view = np.ndarray(self.shape, np.uint8, buffer=segment.buf)
            pixels = copy(view)
            del view
        finally:
            segment.close()
            if free:
                segment.unlink()
        return pixels

    def release(self) -> None:
        """Frees the segment by its name, unmapped: a worker killed between opening it and sizing it leaves an
        empty one, which cannot be mapped."""
        try:
            if os.path.isdir(SHM_FILES):
                os.unlink(os.path.join(SHM_FILES, self.name))
                return
            segment = shared_memory.SharedMemory(name=self.name)
        except FileNotFoundError:
            return  # taken already
        segment.close()
        segment.unlink()


def copy_to_own_pages(pixels: np.ndarray) -> np.ndarray:
    """A copy of `pixels` in an anonymous mapping of its own, unmapped when the last view of it goes. For arrays
    that live long among many short-lived allocations (the processor cache's entries): in malloc's heaps, an entry
    freed between live blocks leaves pages the process keeps."""
    pages = mmap.mmap(-1, max(pixels.nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    copied = np.frombuffer(pages, np.uint8, count=pixels.nbytes).reshape(pixels.shape)
    copied[...] = pixels
    return copied


def segment_prefix(front_end_pid: int) -> str:
    return f"fovea{front_end_pid}_"


def new_segment_name() -> str:
    """In the front end: a segment's name, after the front end, so that what a server leaves in /dev/shm can be
    told apart. The front end chooses it so that it can free the segment of a worker that dies (or is killed)
    after making it and before handing it over."""
    return f"{segment_prefix(os.getpid())}{secrets.token_hex(8)}"


def release_images(images) -> None:
    """Frees the shared segments of processed images that will not reach the engine."""
    release_shared([image.pixels for image in images if isinstance(image.pixels, SharedPixels)])


def release_shared(handles: list[SharedPixels]) -> None:
    for handle in handles:
        handle.release()


def _decode_worker(conn) -> None:
    ignore_group_signals()
    os.nice(10)  # decoding yields the CPU to the engine's decode steps when cores are short
    conn.send("ready")
    answer_jobs(conn, lambda job: _run(*job), _decode_failed)


def _decode_failed(error: Exception, job: tuple) -> ValueError:
    """A bad file is its request's error."""
    if isinstance(error, ValueError):
        return ValueError(str(error))
    return ValueError(f"the {job[0]} could not be decoded: {type(error).__name__}: {error}")


def _run(kind: str, segment: str, *args):
    from fovea.multimodal.image import open_image

    if kind == "probe":
        return video_decode.probe(*args)
    if kind == "video":
        processed = process_video(*args)
    else:  # the same steps as in process (a centre crop after the resize, for CLIP-style processors)
        data, config, height, width, tiles, box = args
        processed = LocalDecoder.process(PlannedImage(open_image(data), config, height, width, data, tiles, box))
    return SharedPixels.create(processed.pixels, segment), processed.content_hash


def default_workers() -> int:
    """One per core, at most 8. They run at a lower priority (nice 10), so they use idle cores without taking
    them from the event loop or, on a CPU-only machine, the engine."""
    return max(1, min(8, os.cpu_count() or 1))


class LocalDecoder:
    """Decoding and resizing in the calling thread."""

    @staticmethod
    def process(planned: PlannedImage | PlannedVideo) -> ProcessedImage:
        if isinstance(planned, PlannedVideo):
            return process_video(planned)
        return ImageProcessor(planned.config).process(planned)

    probe = staticmethod(video_decode.probe)


class ImageWorkers:
    def __init__(self, size: int, timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self.pool = WorkerPool(_decode_worker, (), size, "image decoding")

    def process(self, planned: PlannedImage | PlannedVideo) -> ProcessedImage:
        """Blocking (call it from a thread): the planned image or video decoded and resized by a worker. Pixels
        given in process (the offline API: PIL images, frame arrays) have no bytes to send and are resized here."""
        if planned.data is None:
            return LocalDecoder.process(planned)
        if isinstance(planned, PlannedVideo):
            shared, content_hash = self._call("video", planned)
            return ProcessedImage(
                shared, planned.grid, content_hash, planned.merge_size, planned.second_per_grid_t, planned.timestamps
            )
        shared, content_hash = self._call(
            "image", planned.data, planned.config, planned.height, planned.width, planned.tiles, planned.box
        )
        return ProcessedImage(shared, planned_grid(planned), content_hash, planned.config.merge_size)

    def probe(self, data: bytes) -> video_decode.VideoInfo:
        return self._call("probe", data)

    def _call(self, kind: str, *args):
        what = "image" if kind == "image" else "video"
        segment = new_segment_name()
        try:
            answer = self.pool.call((kind, segment, *args), self.timeout_s)
        except (WorkerFailed, TimeoutError):
            SharedPixels(segment, ()).release()  # made before the worker died, if it got that far (it is dead now)
            raise ValueError(
                f"the {what} could not be decoded (its decoder crashed or took longer than {self.timeout_s:g} s)"
            ) from None
        if isinstance(answer, Exception):
            raise answer
        return answer

    def close(self) -> None:
        self.pool.close()
