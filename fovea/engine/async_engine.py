"""The engine as a server uses it: the engine steps in its own process while asyncio callers add, stream and
abort requests from this one.

`generate()` prepares the request here, in a worker thread (chat template, tokenization, image download,
decoding and resizing), so neither the event loop nor the engine waits for it; then ships the ready Request to
the engine process (engine_core) and yields the request's outputs as they come back. Leaving the iteration
early (a client disconnects) aborts the request, which frees its KV blocks. If the engine process dies, every
waiting caller gets EngineDeadError and /health says so.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from typing import AsyncIterator, Callable

from fovea.engine.config import EngineConfig
from fovea.engine.engine_core import run_engine_core
from fovea.engine.input_processor import InputProcessor
from fovea.engine.request import RequestOutput
from fovea.engine.sampling_params import SamplingParams, default_sampling_params
from fovea.engine.stats import EngineStats


class EngineDeadError(RuntimeError):
    pass


class AsyncLLM:
    def __init__(self, config: EngineConfig, on_stats: Callable[[EngineStats], None] | None = None,
                 startup_timeout: float = 600.0):
        import torch

        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no fork of threads or CUDA state
        command_reader, self._commands = context.Pipe(duplex=False)
        self._results, result_writer = context.Pipe(duplex=False)
        self.process = context.Process(target=run_engine_core, name="fovea-engine", daemon=True,
                                       args=(config, command_reader, result_writer, torch.get_num_threads()))
        self.process.start()
        command_reader.close()
        result_writer.close()
        self.config = self._wait_until_ready(startup_timeout)  # max_model_len may have shrunk to the KV cache
        self.inputs = InputProcessor(self.config)
        self.tokenizer = self.inputs.tokenizer
        self.default_params = default_sampling_params(self.config.model_dir)
        self.stats = EngineStats()
        self.on_stats = on_stats
        self.error: str | None = None
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        # Sending a request with large pixel arrays can block until the engine reads it between steps: a thread
        # does it, not the event loop. Another thread hands results to the streams' event loops.
        threading.Thread(target=self._send_loop, name="fovea-engine-send", daemon=True).start()
        threading.Thread(target=self._receive_loop, name="fovea-engine-receive", daemon=True).start()

    @classmethod
    def from_args(cls, model: str | None = None, on_stats=None, **engine_args) -> "AsyncLLM":
        return cls(EngineConfig.from_args(model, **engine_args), on_stats)

    def _wait_until_ready(self, timeout: float) -> EngineConfig:
        deadline = time.monotonic() + timeout
        while not self._results.poll(0.2):
            if not self.process.is_alive() or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"the engine process did not start (exit code {self.process.exitcode})")
        kind, payload = self._results.recv()
        if kind != "ready":
            self.process.join(timeout=10)
            raise RuntimeError(f"the engine failed to start:\n{payload}")
        return payload

    async def generate(self, prompt=None, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, messages: list[dict] | None = None,
                       mm_processor_kwargs: dict | None = None,
                       chat_template: str | None = None) -> AsyncIterator[RequestOutput]:
        """Streams the outputs of one request: `prompt` in any form LLM.generate takes, or chat `messages`.
        Bad input raises ValueError here, before anything reaches the engine."""
        self._check_alive()
        arrival = time.time()  # latencies count the preparation below
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        request = await asyncio.to_thread(self._make_request, request_id, prompt, messages,
                                          sampling_params or self.default_params, mm_processor_kwargs,
                                          chat_template, arrival)
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        self._outbox.put(("add", request))
        finished = False
        try:
            self._check_alive()  # after registering: a death from now on reaches this stream
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True  # nothing left to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def _make_request(self, request_id, prompt, messages, params, mm_processor_kwargs, chat_template, arrival):
        processed = (self.inputs.process_chat(messages, mm_processor_kwargs, chat_template) if messages is not None
                     else self.inputs.process(prompt, mm_processor_kwargs))
        return self.inputs.make_request(request_id, processed, params, arrival)

    def abort(self, request_id: str) -> None:
        self._outbox.put(("abort", [request_id]))

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.error}")

    def shutdown(self) -> None:
        """Aborts what is running and stops the engine process."""
        if self._stopped:
            return
        self._stopped = True
        self._outbox.put(("shutdown", None))
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    # ------------------------------------------------------------------------------------ pipe threads

    def _send_loop(self) -> None:
        while True:
            message = self._outbox.get()
            try:
                self._commands.send(message)
            except (BrokenPipeError, OSError):
                return  # the engine is gone; the receive loop reports it
            if message[0] == "shutdown":
                return

    def _receive_loop(self) -> None:
        try:
            while True:
                message = self._results.recv()
                if message[0] == "outputs":
                    _, outputs, self.stats = message
                    for output in outputs:
                        self._deliver(output.request_id, output)
                    if self.on_stats is not None:
                        try:
                            self.on_stats(self.stats)
                        except Exception:  # noqa: BLE001 - metrics must never stop the outputs
                            logging.getLogger(__name__).exception("the stats callback failed")
                elif message[0] == "rejected":
                    self._deliver(message[1], ValueError(message[2]))
                else:  # "dead": a step failed
                    self._fail_all(message[1])
                    return
        except (EOFError, OSError):
            if not self._stopped:
                self._fail_all(f"the engine process exited (code {self.process.exitcode})")

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs = stream
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
                self._streams.pop(request_id, None)

    def _fail_all(self, reason: str) -> None:
        self.error = reason
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDeadError(f"the engine stopped: {reason}"))
