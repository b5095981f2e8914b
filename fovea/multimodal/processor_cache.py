"""The front end's multimodal processor cache (--mm-processor-cache-gb, vLLM's default 4): decoded and resized
images and videos kept by what determines them, the encoded bytes and the resize plan (size, frames kept, the
processor's settings), so that the same picture sent again (a chat's history resends every image each turn; an
eval asks many questions about one image) skips decoding and resizing.

It wraps a decoder (image_workers.py's processes, or LocalDecoder in the calling thread) with the same interface.
Bounded in bytes of pixels, least recently used first out; images given as PIL objects or frames given as arrays
have no bytes to key on and pass through. A hit hands the engine its own copy (a fresh shared-memory segment
where the decoder uses them), since the engine frees what it takes. Each entry's pixels have pages of their own
(`copy_to_own_pages`): megabytes kept for minutes in the preparation threads' heaps, among their short-lived
allocations, left those heaps fragmented when they went.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict

from fovea.multimodal.image import PlannedImage, ProcessedImage
from fovea.multimodal.image_workers import ImageWorkers, SharedPixels, copy_to_own_pages, new_segment_name
from fovea.multimodal.video import PlannedVideo


class ProcessorCache:
    def __init__(self, decoder, capacity_bytes: int):
        self.decoder, self.capacity = decoder, capacity_bytes
        self.entries: OrderedDict[tuple, ProcessedImage] = OrderedDict()  # pixels as a NumPy array
        self.size = self.queries = self.hits = 0
        self._lock = threading.Lock()  # the preparation pool's threads share it

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
            self.size = 0

    def probe(self, data: bytes):
        return self.decoder.probe(data)

    def process(self, planned: PlannedImage | PlannedVideo) -> ProcessedImage:
        key = cache_key(planned)
        if key is None:
            return self.decoder.process(planned)
        with self._lock:
            self.queries += 1
            kept = self.entries.get(key)
            if kept is not None:
                self.entries.move_to_end(key)
                self.hits += 1
        if kept is not None:  # a new segment where the decoder hands pixels over in shared memory
            shares = isinstance(self.decoder, ImageWorkers)
            pixels = SharedPixels.create(kept.pixels, new_segment_name()) if shares else kept.pixels.copy()
            return dataclasses.replace(kept, pixels=pixels)
        processed = self.decoder.process(planned)
        if isinstance(processed.pixels, SharedPixels):
            pixels = processed.pixels.peek(copy=copy_to_own_pages)
        else:
            pixels = copy_to_own_pages(processed.pixels)
        if pixels.nbytes <= self.capacity:
            with self._lock:
                if key not in self.entries:
                    self.entries[key] = dataclasses.replace(processed, pixels=pixels)
                    self.size += pixels.nbytes
                while self.size > self.capacity:
                    _, oldest = self.entries.popitem(last=False)
                    self.size -= oldest.pixels.nbytes
        return processed


def cache_key(planned: PlannedImage | PlannedVideo) -> tuple | None:
    """What the processed pixels follow from: the encoded bytes and the plan (None: no bytes to key on)."""
    if planned.data is None:
        return None
    digest = hashlib.blake2b(planned.data, digest_size=20).digest()
    if isinstance(planned, PlannedImage):
        return ("image", digest, planned.config, planned.height, planned.width)
    plan = dataclasses.replace(planned, data=None, frames=None)
    return ("video", digest, repr(plan))
