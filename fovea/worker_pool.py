"""A few long-lived worker processes that answer one message at a time, for work the front end must not do in
its own interpreter: image decoding (CPU-bound, and a crafted image may crash a decoder) and request chat
templates (untrusted programs). A worker that overruns its time limit is killed; one that dies takes only its
current job with it; either way a replacement starts in the background.

A worker's target is `main(conn, *args)`: it sets itself up, sends "ready", then answers every message it
receives (an exception it catches is part of its answer; it should not let one escape).
"""

from __future__ import annotations

import atexit
import collections
import importlib
import logging
import multiprocessing
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

logger = logging.getLogger("fovea")


class WorkerFailed(RuntimeError):
    """The worker died or overran its time limit while handling the message."""


def ignore_group_signals() -> None:
    """Ctrl-C in a terminal, `timeout` and systemd signal the whole process group; a worker stops when its owner
    tells it to or when its pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def answer_jobs(conn, answer: Callable, failed: Callable[[Exception, object], object]) -> None:
    """A worker's loop once it has said "ready": each job's `answer(job)`, or `failed(error, job)` where answering
    raised (the job's requests fail; the worker goes on); it returns when its owner is gone (the pipe closed)."""
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        try:
            reply = answer(job)
        except Exception as error:  # noqa: BLE001 - the job's answer, not the worker's end
            reply = failed(error, job)
        conn.send(reply)


class _PlainProcess:
    """A worker started as `python -m fovea.worker_pool` (what a daemon process, such as the engine, may start:
    multiprocessing refuses it children), with the parts of multiprocessing.Process the pool uses; the two ends
    of a socket pair are its connection, as multiprocessing's own Pipe is."""

    def __init__(self, target, args: tuple):
        ours, theirs = socket.socketpair()
        with theirs:
            fd = theirs.fileno()  # the child has it under the same number
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "fovea.worker_pool"], stdin=subprocess.PIPE, pass_fds=(fd,)
            )
        self.pid = self.popen.pid
        self.conn = Connection(ours.detach())
        self.popen.stdin.write(pickle.dumps((fd, target.__module__, target.__qualname__, args)))
        self.popen.stdin.close()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        self.popen.kill()

    def join(self) -> None:
        self.popen.wait()


class _Worker:
    def __init__(self, target, args: tuple, name: str, startup_s: float, started: set):
        if multiprocessing.current_process().daemon:
            self.process = _PlainProcess(target, args)
            self.conn = self.process.conn
        else:
            context = multiprocessing.get_context("spawn")
            self.conn, child = context.Pipe()
            self.process = context.Process(target=target, args=(child, *args), name=name, daemon=True)
            self.process.start()
            child.close()
        self.started = started
        started.add(self.process)
        if not self.conn.poll(startup_s) or self.conn.recv() != "ready":
            self.kill()
            raise RuntimeError(f"a {name} worker did not start")

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()
        self.started.discard(self.process)


class WorkerPool:
    def __init__(self, target, args: tuple, size: int, name: str, startup_s: float = 120.0):
        self.target, self.args, self.name, self.startup_s = target, args, name, startup_s
        # Workers go to callers strictly in the order they asked: a request whose many images are decoded one
        # after another cannot take a freed worker again ahead of another request's image that waits already.
        self._changed = threading.Condition()
        self._idle: collections.deque[_Worker] = collections.deque()
        self._waiting: collections.deque[object] = collections.deque()  # one ticket per waiting caller, oldest first
        self._started: set = set()  # every process started and not yet killed, busy or starting included
        self._closed = False
        # before multiprocessing's own exit handler, which would SIGTERM (ignored by workers) and join them
        atexit.register(self.close)
        for _ in range(size):
            self._give_back(self._start())

    def _start(self) -> _Worker:
        return _Worker(self.target, self.args, self.name, self.startup_s, self._started)

    def _replace(self) -> None:
        try:
            worker = self._start()
        except Exception:  # noqa: BLE001 - one worker fewer; the others go on
            if not self._closed:
                logger.exception("a %s worker could not be replaced", self.name)
            return
        if self._closed:
            worker.kill()
        else:
            self._give_back(worker)

    def call(self, message, timeout_s: float, wait_s: float | None = None):
        """Blocking (call it from a thread): a free worker's answer to `message`. Waits up to `wait_s` (default:
        `timeout_s`) for a free worker (TimeoutError if none), then up to `timeout_s` for the answer."""
        deadline = time.monotonic() + (timeout_s if wait_s is None else wait_s)
        while True:
            worker = self._take(deadline)
            if worker.process.is_alive():
                break
            self._lost(worker, "died while idle")  # killed from outside (the OOM killer, say): not this job's fault
        try:
            worker.conn.send(message)
            if not worker.conn.poll(timeout_s):
                raise TimeoutError
            answer = worker.conn.recv()
        except (TimeoutError, EOFError, OSError) as error:
            self._lost(worker, "overran its time limit" if isinstance(error, TimeoutError) else "died")
            raise WorkerFailed(self.name) from None
        self._give_back(worker)
        return answer

    def _take(self, deadline: float) -> _Worker:
        """An idle worker, once every caller that asked earlier has had one; TimeoutError past `deadline`."""
        ticket = object()
        with self._changed:
            self._waiting.append(ticket)
            try:
                while not (self._idle and self._waiting[0] is ticket):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"all {self.name} workers are busy")
                    self._changed.wait(left)
                return self._idle.popleft()
            finally:
                self._waiting.remove(ticket)
                self._changed.notify_all()

    def _give_back(self, worker: _Worker) -> None:
        with self._changed:
            self._idle.append(worker)
            self._changed.notify_all()

    def _lost(self, worker: _Worker, why: str) -> None:
        logger.warning("worker %r %s; it is replaced", self.name, why)
        worker.kill()
        threading.Thread(target=self._replace, name=f"{self.name}-replace", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        for process in list(self._started):
            process.kill()
            process.join()
        self._started.clear()


def _plain_worker_main() -> None:
    """`python -m fovea.worker_pool`: a _PlainProcess's child, which runs its target on the connection it was given."""
    fd, module, name, args = pickle.loads(sys.stdin.buffer.read())
    getattr(importlib.import_module(module), name)(Connection(fd), *args)


if __name__ == "__main__":
    _plain_worker_main()
