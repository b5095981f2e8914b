"""One engine-core process as the front end sees it: started, waited for, spoken to through two pipe threads.

Sending a request with large pixel arrays can block until the engine reads it between steps, so a thread sends,
not the event loop; another thread receives and hands every message to `on_message`. When the process stops
without being asked to (it died, or gave up after failing steps), `on_exit` hears why, once, and whether it was
fatal (a tensor-parallel worker stopped: restarting would not help). With the Ray backend the "process" is an
actor, perhaps on another node (ray_replicas.py), and the pipes are one socket connection.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable

from fovea.config.engine import EngineConfig
from fovea.core.messages import AddRequest, Dead, Fatal, FromEngine, Ready, Shutdown, ToEngine
from fovea.engine.engine_core import run_engine_core

logger = logging.getLogger("fovea")


class EngineProcess:
    def __init__(
        self,
        config: EngineConfig,
        on_message: Callable[[FromEngine], None],
        on_exit: Callable[[EngineProcess, str, bool], None],
        startup_timeout: float = 600.0,
    ):
        import torch

        if config.distributed_executor_backend == "ray":  # an actor, on whichever node has its GPUs
            from fovea.frontend.ray_replicas import RayEngineCore

            self.process = RayEngineCore(config, torch.get_num_threads())
            self.remote = True
            self._commands = self._results = self.process.connection
        else:
            self.remote = False
            context = multiprocessing.get_context("spawn")  # a fresh interpreter: no fork of threads or CUDA state
            command_reader, self._commands = context.Pipe(duplex=False)
            self._results, result_writer = context.Pipe(duplex=False)
            self.process = context.Process(
                target=run_engine_core,
                name="fovea-engine",
                daemon=True,
                args=(config, command_reader, result_writer, torch.get_num_threads()),
            )
            self.process.start()
            command_reader.close()
            result_writer.close()
        self.config = self._wait_until_ready(startup_timeout)  # max_model_len may have shrunk to the KV cache
        self._on_message, self._on_exit = on_message, on_exit
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._adding = threading.Lock()  # a place and the send that takes it, together
        self.requests_sent = 0
        self.stopped = False
        threading.Thread(target=self._send_loop, name="fovea-engine-send", daemon=True).start()
        threading.Thread(target=self._receive_loop, name="fovea-engine-receive", daemon=True).start()

    def _wait_until_ready(self, timeout: float) -> EngineConfig:
        deadline = time.monotonic() + timeout
        while not self._results.poll(0.2):
            if not self.process.is_alive() or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"the engine process did not start (exit code {self.process.exitcode})")
        message = self._results.recv()
        if not isinstance(message, Ready):
            self.process.join(timeout=10)
            raise RuntimeError(f"the engine failed to start:\n{getattr(message, 'traceback', message)}")
        return message.config

    def send(self, message: ToEngine) -> None:
        self._outbox.put(message)

    def add(self, request) -> int:
        """Sends an AddRequest; returns its place among those this engine was sent (1, 2, ...), in the order it
        reads them (HeldRequests.requests_read counts them)."""
        with self._adding:
            self.requests_sent += 1
            self._outbox.put(AddRequest(request))
            return self.requests_sent

    def stop(self) -> None:
        """Asks the process to finish (what runs is dropped) and waits for it; kills it if it does not go."""
        if self.stopped:
            return
        self.stopped = True
        self._outbox.put(Shutdown())
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def _send_loop(self) -> None:
        while True:
            message = self._outbox.get()
            if self.remote and isinstance(message, AddRequest):  # the actor's node cannot see our shared memory
                message.request.take_shared_pixels()
            try:
                self._commands.send(message)
            except (BrokenPipeError, OSError):
                return  # the engine is gone; the receive loop reports it
            if isinstance(message, Shutdown):
                return

    def _receive_loop(self) -> None:
        fatal = False
        try:
            while True:
                message = self._results.recv()
                if isinstance(message, Dead):
                    reason = f"it gave up after failing steps:\n{message.traceback}"
                    break
                if isinstance(message, Fatal):
                    reason, fatal = message.message, True
                    break
                try:
                    self._on_message(message)
                except Exception:  # noqa: BLE001 - a failing handler must not stop the outputs of everyone
                    logger.exception("handling a message from the engine failed")
        except (EOFError, OSError):
            self.process.join(timeout=5)
            reason = f"the engine process exited (code {self.process.exitcode})"
        if not self.stopped:
            self.stopped = True
            self._outbox.put(Shutdown())  # lets the send thread end
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()
            self._on_exit(self, reason, fatal)
