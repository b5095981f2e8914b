"""Image decoding in worker processes, pixels handed to the engine in shared memory: the same pixels as the
in-process path, a bad or crashing image fails only its own request, and no segment outlives its request."""

from __future__ import annotations

import asyncio
import glob
import os
import threading
import time

import numpy as np
import pytest
from conftest import jpeg_bytes, random_image

from fovea import SamplingParams
from fovea.core.sampling_params import RequestOutputKind
from fovea.frontend.async_llm import AsyncLLM
from fovea.multimodal.image import ImageProcessor
from fovea.multimodal.image_workers import ImageWorkers, SharedPixels, _run, new_segment_name, segment_prefix
from fovea.worker_pool import WorkerFailed

OPTIONS = dict(dtype="float32", max_model_len=2048, num_gpu_blocks_override=300, max_num_seqs=8)


def segments() -> set[str]:
    """The shared-memory segments of a front end in this process (named after it)."""
    return set(glob.glob(f"/dev/shm/{segment_prefix(os.getpid())}*"))


@pytest.fixture(scope="module")
def workers():
    pool = ImageWorkers(2, timeout_s=30)
    yield pool
    pool.close()


@pytest.mark.parametrize("config", ["qwen", "clip"])
def test_workers_give_the_in_process_pixels(workers, config):
    """Qwen's dynamic resolution, and CLIP's shortest-side resize and centre crop (LLaVA), in both places."""
    from fovea.config.image import ImageProcessorConfig

    before = segments()
    processor = ImageProcessor(
        ImageProcessorConfig()
        if config == "qwen"
        else ImageProcessorConfig.center_crop({"crop_size": 336, "size": {"shortest_edge": 336}}, 14, 336)
    )
    for width, height in ((640, 480), (333, 517), (200, 150), (3000, 2000)):  # the last decodes at reduced scale
        planned = processor.plan(jpeg_bytes(random_image(width, height, seed=width)))
        local = processor.process(planned)
        remote = workers.process(processor.plan(planned.data))
        assert isinstance(remote.pixels, SharedPixels) and remote.grid_thw == local.grid_thw
        assert remote.pixels.nbytes == local.pixels.nbytes <= 3 << 20  # what crosses: uint8, under 3 MB
        assert np.array_equal(remote.pixels.take(), local.pixels) and remote.content_hash == local.content_hash
    assert segments() == before  # taken: freed


def test_taken_pixels_stay_in_the_segments_pages_until_the_array_goes():
    """The engine takes an image's pixels without copying them on its loop (megabytes an image): the array reads
    the segment's pages, mapped copy-on-write. The name is gone at once, the pages when the last view goes."""
    pixels = np.asarray(random_image(64, 48, seed=1))
    handle = SharedPixels.create(pixels, new_segment_name())
    taken = handle.take()
    assert np.array_equal(taken, pixels) and f"/dev/shm/{handle.name}" not in segments()

    def mapped() -> list[str]:
        with open("/proc/self/maps") as maps:
            return [line for line in maps if handle.name in line]

    assert mapped()  # the array's memory is the segment's, not a copy
    taken[0, 0] = 255 - pixels[0, 0]  # writable, and private: the pixels were not changed for anyone else
    assert not np.array_equal(taken, pixels)
    part = taken[10:20]
    del taken
    assert mapped()  # a view (a video's frames share their segment) keeps the pages
    del part
    assert not mapped()


def _sleeping_worker(conn) -> None:  # a WorkerPool target: answers each message after sleeping that long
    conn.send("ready")
    while True:
        try:
            seconds = conn.recv()
        except EOFError:
            return
        time.sleep(seconds)
        conn.send(seconds)


def test_a_freed_worker_goes_to_whoever_asked_first():
    """One worker; a caller that asks again the moment it gives the worker back cannot take it ahead of one that
    has been waiting (a request's images are decoded one after another, each asking for a worker anew)."""
    from fovea.worker_pool import WorkerPool

    pool = WorkerPool(_sleeping_worker, (), 1, "sleeper")
    order: list[str] = []
    try:
        busy = threading.Thread(target=lambda: [order.append("busy") for _ in range(8) if pool.call(0.05, 10)])
        busy.start()
        time.sleep(0.02)  # the busy caller holds the worker now
        pool.call(0.0, 10)
        order.append("waiting")
        busy.join()
    finally:
        pool.close()
    assert order.index("waiting") <= 1, order


def test_workers_go_to_requests_in_the_order_they_asked(workers):
    """Two requests of large blank PNGs (cheap to send, costly to decode, tiny once resized) keep both workers
    busy; a small image asked for meanwhile gets the next freed worker instead of waiting behind their queues
    (before: a request that gave a worker back could take it again at once)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (6000, 6000)).save(buf, format="PNG")
    processor = ImageProcessor()
    bomb = buf.getvalue()
    finished: dict[str, list[float]] = {"a": [], "b": [], "small": []}

    def run(name, images):
        for data in images:
            workers.process(processor.plan(data, {"max_pixels": 3136})).pixels.release()
            finished[name].append(time.monotonic())

    threads = [threading.Thread(target=run, args=(name, [bomb] * 4)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # both workers are decoding now
    run("small", [jpeg_bytes(random_image(56, 56, seed=3))])
    for thread in threads:
        thread.join()
    assert finished["small"][0] < min(finished["a"][1], finished["b"][1])


def test_one_request_may_not_decode_more_than_its_share_of_pixels(tiny_dirs, monkeypatch):
    """Decoding costs by source pixels, not tokens: a request's images together are bounded before any is
    decoded (FOVEA_MAX_REQUEST_PIXELS), however small max_pixels makes them."""
    import fovea.multimodal.prompt as prompt
    from fovea.config.model import ModelConfig
    from fovea.multimodal.fetch import ImageTooLarge

    prompts = prompt.PromptProcessor(tiny_dirs["tiny-3b"], ModelConfig.from_dir(tiny_dirs["tiny-3b"]))
    monkeypatch.setattr(prompt, "MAX_REQUEST_PIXELS", 100 * 100)
    images = [jpeg_bytes(random_image(80, 80, seed=s)) for s in (1, 2)]
    text = "<|vision_start|><|image_pad|><|vision_end|>" * 2
    with pytest.raises(ImageTooLarge, match=r"0.0 megapixels before resizing, more than the 0.0 one request may have"):
        prompts.process(text, images)
    assert len(prompts.process(text[: len(text) // 2], images[:1]).images) == 1


def test_a_bad_or_crashing_image_fails_alone(workers):
    processor = ImageProcessor()
    good = jpeg_bytes(random_image(320, 240, seed=1))
    truncated = processor.plan(good[: len(good) // 2])
    with pytest.raises(ValueError, match="not a readable image"):
        workers.process(truncated)
    # a worker dies in the middle of a job (as a decoder crash would take it): that job fails, the next run on
    # its replacement; and a worker that dies while idle costs no job at all
    single = ImageWorkers(1, timeout_s=30)
    expected = processor.process(processor.plan(good)).pixels
    try:
        big = processor.plan(jpeg_bytes(random_image(3000, 2200, seed=2)), {"min_pixels": 6_000_000})
        killer = threading.Timer(0.05, lambda: [p.kill() for p in list(single.pool._started)])
        killer.start()
        with pytest.raises(ValueError, match="decoder crashed"):
            single.process(big)
        killer.join()
        image = single.process(processor.plan(good))  # waits for the replacement
        assert np.array_equal(image.pixels.take(), expected)
        for process in list(single.pool._started):
            process.kill()
            process.join()
        image = single.process(processor.plan(good))
        assert np.array_equal(image.pixels.take(), expected)
    finally:
        single.close()


@pytest.mark.parametrize("made", ["whole", "empty"])
def test_a_worker_that_dies_after_making_its_segment_leaves_none(workers, monkeypatch, made):
    """A worker makes the segment under the name the front end chose, so one that dies (or is killed for its time)
    after making it and before handing it back leaves nothing: the front end frees it. `empty`: killed between
    opening the segment and sizing it (CI saw it once), which leaves a file that cannot be mapped."""
    planned = ImageProcessor().plan(jpeg_bytes(random_image(320, 240, seed=3)))
    before = segments()

    def dies_after_making_it(job, timeout_s):
        if made == "whole":
            _run(*job)  # the worker's part, up to handing the segment back
        else:
            os.close(os.open(f"/dev/shm/{job[1]}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        raise WorkerFailed("image decoding")

    monkeypatch.setattr(workers.pool, "call", dies_after_making_it)
    with pytest.raises(ValueError, match="decoder crashed"):
        workers.process(planned)
    assert segments() == before


def test_no_segment_outlives_its_request(tiny_dirs):
    """A normal request, one refused after its image was decoded, one whose client leaves while its image is
    decoded, and one dropped unsent when another prompt of its batch fails: nothing is left in /dev/shm."""
    before = segments()
    engine = AsyncLLM.from_args(str(tiny_dirs["tiny-3b"]), mm_processor_workers=1, **OPTIONS)
    picture = jpeg_bytes(random_image(640, 480, seed=9))
    image_prompt = {
        "prompt": "<|vision_start|><|image_pad|><|vision_end|>Describe.",
        "multi_modal_data": {"image": picture},
    }
    params = SamplingParams(temperature=0, max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY)

    async def run(**request):
        return [out async for out in engine.generate(**{"sampling_params": params, **request})]

    async def main():
        assert (await run(prompt=image_prompt))[-1].finished
        with pytest.raises(ValueError, match="max_num_seqs"):  # checked after the image was decoded
            await run(prompt=image_prompt, sampling_params=params.clone(n=9))
        leaving = asyncio.ensure_future(
            run(prompt={**image_prompt, "multi_modal_data": {"image": jpeg_bytes(random_image(2000, 1500, seed=10))}})
        )
        await asyncio.sleep(0.05)
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        with pytest.raises(ValueError, match="a prompt must be"):
            await engine.prepare_many([image_prompt, 42], params, "batch")

    try:
        asyncio.run(main())
        deadline = time.time() + 30
        while segments() != before and time.time() < deadline:  # the cancelled decode finishes in the background
            time.sleep(0.1)
    finally:
        engine.shutdown()
    assert segments() == before
