"""Chat templates sent with requests (only with --trust-request-chat-template) run in worker processes.

A template is a program: Jinja's sandbox keeps it from reaching Python internals, but not from looping for
minutes or building a gigabyte string. So client templates render in separate processes, each with a memory
cap (RLIMIT_AS), a time limit (the worker is killed and replaced when it overruns) and a cap on the output's
length; a request waits at most as long as the time limit for a free worker. The server's own template (the
checkpoint's, or --chat-template) is trusted and renders in process.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import threading

logger = logging.getLogger("fovea")


def _worker_main(model_dir: str, conn, memory_bytes: int, max_chars: int) -> None:
    import resource

    from transformers import AutoTokenizer  # the same tokenizer call the server's own template goes through

    # the server stops its workers (or they see the pipe close); signals to the whole group are not for them
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open("/proc/self/statm") as statm:  # pages of virtual memory in use now, tokenizer loaded
        in_use = int(statm.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (in_use + memory_bytes, in_use + memory_bytes))
    conn.send("ready")
    while True:
        try:
            messages, template, add_generation_prompt = conn.recv()
        except EOFError:  # the server is gone
            return
        try:
            text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
            reply = (True, text) if len(text) <= max_chars else (
                False, f"the chat template wrote {len(text)} characters, more than the {max_chars} allowed")
        except MemoryError:
            reply = (False, "the chat template used more memory than allowed")
        except Exception as error:  # noqa: BLE001 - the template's own failure, reported to its request
            reply = (False, f"the chat template failed on these messages: {type(error).__name__}: {error}")
        conn.send(reply)


class _Worker:
    def __init__(self, model_dir: str, memory_bytes: int, max_chars: int, startup_s: float = 120.0):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(model_dir, child, memory_bytes, max_chars),
                                       name="fovea-template", daemon=True)
        self.process.start()
        child.close()
        if not self.conn.poll(startup_s) or self.conn.recv() != "ready":
            self.kill()
            raise RuntimeError("a chat template worker did not start")

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class TemplateSandbox:
    def __init__(self, model_dir: str, max_chars: int, workers: int = 2, timeout_s: float = 2.0,
                 memory_bytes: int = 512 << 20):
        self.model_dir, self.max_chars = model_dir, max_chars
        self.timeout_s, self.memory_bytes = timeout_s, memory_bytes
        self._idle: queue.Queue[_Worker] = queue.Queue()
        for _ in range(workers):
            self._idle.put(self._new_worker())

    def _new_worker(self) -> _Worker:
        return _Worker(self.model_dir, self.memory_bytes, self.max_chars)

    def _replace(self) -> None:
        try:
            self._idle.put(self._new_worker())
        except Exception:  # noqa: BLE001 - one worker fewer; the others go on
            logger.exception("a chat template worker could not be replaced")

    def render(self, messages: list[dict], template: str, add_generation_prompt: bool) -> str:
        """Blocking (call it from a thread): the rendered prompt, or ValueError saying what went wrong."""
        try:
            worker = self._idle.get(timeout=self.timeout_s)
        except queue.Empty:
            raise ValueError("all chat template workers are busy; retry shortly") from None
        try:
            worker.conn.send((messages, template, add_generation_prompt))
            if not worker.conn.poll(self.timeout_s):
                raise TimeoutError
            ok, result = worker.conn.recv()
        except (TimeoutError, EOFError, OSError):
            logger.warning("a request's chat template overran its limits; its worker is replaced")
            worker.kill()
            threading.Thread(target=self._replace, name="fovea-template-replace", daemon=True).start()
            raise ValueError(f"the chat template did not finish within {self.timeout_s:g} s and "
                             f"{self.memory_bytes >> 20} MiB") from None
        self._idle.put(worker)
        if not ok:
            raise ValueError(result)
        return result

    def close(self) -> None:
        while not self._idle.empty():
            self._idle.get_nowait().kill()
