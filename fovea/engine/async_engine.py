"""The engine for a server: it steps on its own thread while asyncio callers add, stream and abort requests.

`generate()` prepares the request (chat template, image decoding and resizing) in a worker thread, so neither
the event loop nor the engine's steps wait for it, then hands it to the engine thread and yields the
request's outputs as the engine produces them. Leaving the iteration early (a client disconnects) aborts the
request, which frees its KV blocks at once. A failing step fails the requests in flight, not the process.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from typing import AsyncIterator

from fovea.engine.config import EngineConfig
from fovea.engine.engine import LLMEngine
from fovea.engine.request import RequestOutput
from fovea.engine.sampling_params import SamplingParams, default_sampling_params


class EngineDeadError(RuntimeError):
    pass


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.default_params = default_sampling_params(engine.config.model_dir)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stopped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fovea-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, model: str | None = None, **engine_args) -> "AsyncLLM":
        return cls(LLMEngine(EngineConfig.from_args(model, **engine_args)))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(self, prompt=None, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, messages: list[dict] | None = None,
                       mm_processor_kwargs: dict | None = None,
                       chat_template: str | None = None) -> AsyncIterator[RequestOutput]:
        """Streams the outputs of one request: `prompt` in any form LLM.generate takes, or chat `messages`.
        Bad input raises ValueError here, before anything reaches the engine."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.error!r}")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        request = await asyncio.to_thread(self._make_request, request_id, prompt, messages,
                                          sampling_params or self.default_params, mm_processor_kwargs, chat_template)
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        self._send("add", request)
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send("abort", request_id)

    def _make_request(self, request_id, prompt, messages, params, mm_processor_kwargs, chat_template):
        inputs = self.engine.inputs
        processed = (inputs.process_chat(messages, mm_processor_kwargs, chat_template) if messages is not None
                     else inputs.process(prompt, mm_processor_kwargs))
        return inputs.make_request(request_id, processed, params)

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    def _send(self, command: str, payload) -> None:
        self._commands.put((command, payload))
        self._wakeup.set()

    # ------------------------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while not self._stopped:
            self._apply_commands()
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except BaseException as error:  # noqa: BLE001 - every waiting caller must hear about it
                self.error = error
                self._fail_all(error)
                return
            for output in outputs:
                self._deliver(output.request_id, output)

    def _apply_commands(self) -> None:
        while True:
            try:
                command, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                if payload.request_id in self._streams:  # its caller may have left while it was queued
                    self.engine.add_request(payload)
            else:
                self.engine.abort_request(payload)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs = stream
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
                self._streams.pop(request_id, None)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDeadError(f"engine step failed: {error!r}"))
