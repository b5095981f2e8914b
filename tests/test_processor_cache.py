"""The front end's multimodal processor cache (--mm-processor-cache-gb): a repeated image or video, sent as the same
bytes and resized the same way, is not decoded again; other sizes, other bytes, and what does not fit are."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from conftest import jpeg_bytes, random_image, video_file

from fovea.config.engine import EngineConfig
from fovea.frontend.input_processor import InputProcessor
from fovea.multimodal.image_workers import ImageWorkers, LocalDecoder, release_images


class Counting(LocalDecoder):
    def __init__(self):
        self.decoded = 0

    def process(self, planned):
        self.decoded += 1
        return LocalDecoder.process(planned)


def chat(*parts):
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(data).decode()}}


def video_part(data: bytes) -> dict:
    return {
        "type": "video_url",
        "video_url": {"url": "data:video/x-matroska;base64," + base64.b64encode(data).decode()},
    }


def inputs_with(model_dir, decoder, **engine_args) -> InputProcessor:
    return InputProcessor(EngineConfig.from_args(str(model_dir), dtype="float32", **engine_args), decoder)


def test_repeats_are_decoded_once_and_give_the_same_pixels(tiny_dirs):
    decoder = Counting()
    inputs = inputs_with(tiny_dirs["tiny-3b"], decoder)
    boat, other = jpeg_bytes(random_image(320, 240, seed=1)), jpeg_bytes(random_image(320, 240, seed=2))
    clip = video_file(np.stack([np.asarray(random_image(96, 64, seed=s)) for s in range(4)]), fps=2)
    first = inputs.process_chat(chat(image_part(boat), video_part(clip)))
    again = inputs.process_chat(chat(image_part(boat), video_part(clip)))
    assert decoder.decoded == 2 and inputs.processor_cache.hits == 2 and inputs.processor_cache.queries == 4
    assert again.token_ids == first.token_ids
    for a, b in zip(first.images, again.images, strict=True):
        assert np.array_equal(a.pixels, b.pixels) and a.content_hash == b.content_hash and a.grid_thw == b.grid_thw
        assert a.pixels is not b.pixels  # the engine gets its own copy
    inputs.process_chat(chat(image_part(other)))  # other bytes
    inputs.process_chat(chat(image_part(boat)), mm_processor_kwargs={"max_pixels": 160 * 120})  # another size
    assert decoder.decoded == 4 and inputs.processor_cache.hits == 2
    inputs.processor_cache.clear()  # /reset_mm_cache: the next repeat is decoded again
    inputs.process_chat(chat(image_part(other)))
    assert decoder.decoded == 5 and inputs.processor_cache.size > 0


def test_least_recently_used_goes_first_and_zero_turns_it_off(tiny_dirs):
    images = [jpeg_bytes(random_image(280, 280, seed=s)) for s in range(3)]  # 280 x 280 x 3 bytes each, resized
    decoder = Counting()
    inputs = inputs_with(tiny_dirs["tiny-3b"], decoder, mm_processor_cache_gb=2.5 * 280 * 280 * 3 / 2**30)
    for i in (0, 1, 0, 2, 1, 0):  # room for two: 2 pushes 1 out (0 was used later), then 1 pushes 0 out
        inputs.process_chat(chat(image_part(images[i])))
    assert decoder.decoded == 5 and inputs.processor_cache.hits == 1
    assert inputs.processor_cache.size <= 2.5 * 280 * 280 * 3
    off = inputs_with(tiny_dirs["tiny-3b"], Counting(), disable_mm_preprocessor_cache=True)  # vLLM's older switch
    assert off.processor_cache is None and off.config.mm_processor_cache_gb == 0
    with pytest.raises(ValueError, match="mm_processor_cache_gb must be 0"):
        inputs_with(tiny_dirs["tiny-3b"], None, mm_processor_cache_gb=-1)


def test_a_repeated_image_costs_no_decoding_worker_time(tiny_dirs):
    """With decoding processes: the second request sends no job to a worker, and the engine still gets its pixels
    in a shared-memory segment of its own."""
    workers = ImageWorkers(1)
    jobs = []
    call = workers.pool.call
    workers.pool.call = lambda job, timeout: jobs.append(job[0]) or call(job, timeout)
    try:
        inputs = inputs_with(tiny_dirs["tiny-3b"], workers)
        data = jpeg_bytes(random_image(300, 200, seed=5))
        prompts = [inputs.process_chat(chat(image_part(data))) for _ in range(2)]
        assert jobs == ["image"]
        first, second = (prompt.images[0].pixels for prompt in prompts)
        assert first.name != second.name and np.array_equal(first.take(), second.take())
    finally:
        for prompt in prompts:
            release_images(prompt.images)
        workers.close()


def mapping_of(start: int, size: int) -> str | None:
    """The line of /proc/self/maps of the mapping that holds the bytes [start, start + size)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(bound, 16) for bound in line.split()[0].split("-"))
            if low <= start and start + size <= high:
                return line
    return None


@pytest.mark.parametrize("with_workers", [False, True])
def test_kept_pixels_have_pages_of_their_own_until_they_go(tiny_dirs, with_workers):
    """An entry lives for minutes among the preparation threads' short-lived allocations; in malloc's heaps it
    would leave a hole there when it goes. Its pixels are a mapping of their own, unmapped when it is pushed out."""
    decoder = ImageWorkers(1) if with_workers else LocalDecoder()
    try:
        inputs = inputs_with(tiny_dirs["tiny-3b"], decoder, mm_processor_cache_gb=1.5 * 280 * 280 * 3 / 2**30)
        images = [jpeg_bytes(random_image(280, 280, seed=s)) for s in range(2)]
        release_images(inputs.process_chat(chat(image_part(images[0]))).images)
        (entry,) = inputs.processor_cache.entries.values()
        kept, start = entry.pixels, entry.pixels.__array_interface__["data"][0]
        del entry
        line = mapping_of(start, kept.nbytes)
        # anonymous, writable, and the pixels start a page (malloc's blocks start 16 bytes into theirs)
        assert start % 4096 == 0 and line.split()[1].startswith("rw") and line.split()[4] == "0"
        release_images(inputs.process_chat(chat(image_part(images[1]))).images)  # room for one: pushes it out
        assert len(inputs.processor_cache.entries) == 1 and mapping_of(start, kept.nbytes)  # a view keeps it
        del kept
        assert mapping_of(start, 4096) is None  # unmapped when it went
    finally:
        if with_workers:
            decoder.close()
