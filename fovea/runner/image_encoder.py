"""The vision tower running beside the language model, so that image work never stalls decoding.

The scheduler hands over the images a step reaches (up to the per-step encoder budget); this thread encodes
them while the engine keeps stepping the sequences that are ready, and the embeddings go into the encoder cache
when done. A prompt's prefill stops before an image until then, so a burst of large images raises their own
requests' time to first token, not everybody's inter-token latency. On a GPU the encoder works on its own CUDA
stream and every result carries an event that the language model's stream waits for; on the CPU the two threads
run on different cores (PyTorch releases the GIL inside its operators), and a step's images are cut in `shares`
pieces: the engine's thread, when it has nothing to run but waits for images (a batch of requests that all
start with one), encodes queued pieces itself instead of idling (64 prompts with a 448x448 image each on the
demo model: 5.61 -> 5.03 s). A request arriving meanwhile waits for that piece, at most half of what an engine
that encodes inline, as vLLM's does, makes it wait.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fovea.core.request import MMItem
from fovea.distributed import RanksOutOfStep


@dataclass
class EncodedImages:
    items: list[MMItem]
    embeddings: list[torch.Tensor] | None  # one (tokens, hidden) tensor per item, or None when encoding failed
    error: Exception | None = None
    done: torch.cuda.Event | None = None  # on a GPU: recorded on the encoder's stream after the last kernel


def lower_priority(niceness: int = 10) -> None:
    """Image work yields the CPU to decoding when cores are short: this thread (or process) gets a higher nice
    value (Linux schedules threads one by one); where that is not possible it runs as it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):
        pass


class ImageEncoder:
    def __init__(
        self,
        encode: Callable[[list[MMItem]], list[torch.Tensor]],
        device: torch.device,
        shares: int = 1,
        threads: int = 1,
    ):
        """`shares` > 1 (the CPU, where `encode` may run in two threads at once): pieces a submission is cut
        into, which `collect` with a wait encodes in the caller's thread while any are queued. `threads`: how
        many run `encode` at once (one per encoder worker process, whose calls wait on the worker)."""
        self._encode, self.device, self.shares = encode, device, shares
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self.in_flight: set[str] = set()  # content hashes submitted and not yet collected
        self._threads = [
            threading.Thread(target=self._loop, name="fovea-image-encoder", daemon=True) for _ in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, items: list[MMItem]) -> None:
        self.in_flight.update(item.content_hash for item in items)
        pieces = min(self.shares, len(items))
        for piece in range(pieces):  # in order: the encoder's thread takes the first
            self._jobs.put(items[len(items) * piece // pieces : len(items) * (piece + 1) // pieces])

    def collect(self, wait_s: float = 0.0) -> list[EncodedImages]:
        """What finished since the last call; with `wait_s`, waits that long for the first result (a step with
        nothing else to do), or encodes a queued piece itself. On a GPU the current stream is made to wait for
        each result's kernels."""
        if not self.in_flight:  # nothing submitted is out: most steps (the queue's locks cost at 256 rows a step)
            return []
        if wait_s and self.shares > 1:
            try:
                items = self._jobs.get_nowait()
            except queue.Empty:
                pass
            else:
                if items is None:  # close()'s sentinel: it is the encoder thread's
                    self._jobs.put(None)
                else:
                    with torch.inference_mode():
                        self._run(items)
                    wait_s = 0.0
        finished = []
        try:
            finished.append(self._results.get(timeout=wait_s) if wait_s else self._results.get_nowait())
            while True:
                finished.append(self._results.get_nowait())
        except queue.Empty:
            pass
        for result in finished:
            self.in_flight.difference_update(item.content_hash for item in result.items)
            if result.done is not None:
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(result.done)
                for tensor in result.embeddings or ():
                    tensor.record_stream(stream)  # its memory is not reused before the language model is done
        return finished

    def close(self) -> None:
        """Ends the thread and waits for it: one still freeing its tensors while the interpreter shuts down is
        killed when it next takes the GIL, which aborted the engine process ("terminate called without an active
        exception") at every server stop."""
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=60)

    def _loop(self) -> None:
        lower_priority()
        stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with torch.inference_mode(), stream:
            while (items := self._jobs.get()) is not None:
                self._run(items)
                del items  # an idle encoder keeps no request's pixels alive

    def _run(self, items: list[MMItem]) -> None:
        """Puts the items' results: encoded together, or if that fails, each alone (as a failed step's requests
        run alone), so that only an image that fails by itself fails the requests that show it."""
        try:
            embeddings = self._encode(items)
        except Exception as error:  # noqa: BLE001 - the engine fails the requests waiting for them
            if len(items) == 1 or isinstance(error, RanksOutOfStep):  # (out of step: nothing runs again)
                self._results.put(EncodedImages(items, None, error))
                return
            embeddings = None
        if embeddings is None:  # outside the except block: the errors met alone do not chain this one (and
            for item in items:  # its frame holding all the items)
                self._run([item])
            return
        done = torch.cuda.Event() if self._stream is not None else None
        if done is not None:
            done.record(self._stream)
        self._results.put(EncodedImages(items, embeddings, done=done))
