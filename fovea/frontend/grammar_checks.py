"""Requests' grammars compiled in child processes before the engine sees one: the grammar library is native code
that recurses, and a grammar it crashes on (a chain of 5,000 Lark rules is a segmentation fault, not an
exception) must cost that request a 400 and a new child process, never the server or the engine.

Each child holds llguidance's view of the tokenizer (built once, as the engine's compiler does) and answers one
grammar at a time over its pipes, a JSON line each way. The first child starts with the first grammar to check, as
vLLM starts its grammar backend: a server that never sees one spends neither its ~2 s of CPU nor its ~160 MB, and
the first structured request waits for the vocabulary to be read once (time that does not count against its
limit). A child that outruns FOVEA_GRAMMAR_TIMEOUT is killed (the build cannot be interrupted otherwise) and that
grammar is refused at once from then on; a child that dies is started again for the next check. Grammars that
compiled are remembered, so a repeated schema costs nothing.

    python -m fovea.frontend.grammar_checks   # a child: its first line is the tokenizer, then grammars
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict

from fovea.core.sampling_params import WHERE, StructuredOutputsParams, lark_grammar
from fovea.engine import structured_outputs
from fovea.engine.structured_outputs import compile_matcher, ll_tokenizer, tokenizer_json, too_slow_error

REMEMBERED = 1024  # grammars known to compile, and known to be too slow


class _Child:
    """A child process and its pipes; answers are read from its unbuffered pipe, whole lines at a time."""

    def __init__(self, setup: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "fovea.frontend.grammar_checks"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.received = b""
        try:
            self.send(setup)
        except EOFError:  # it died before reading its first line
            self.stop()
            raise RuntimeError("a grammar-check process died as it started") from None

    def send(self, line: str) -> None:
        try:
            self.process.stdin.write(line.encode() + b"\n")
            self.process.stdin.flush()
        except OSError:  # it died
            raise EOFError from None

    def receive(self, deadline: float | None) -> dict:
        """The next answer; TimeoutError past `deadline` (None: no limit), EOFError if the child died."""
        while b"\n" not in self.received:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0 or not select.select([self.process.stdout], [], [], wait)[0]:
                raise TimeoutError
            chunk = os.read(self.process.stdout.fileno(), 1 << 16)
            if not chunk:
                raise EOFError
            self.received += chunk
        line, self.received = self.received.split(b"\n", 1)
        return json.loads(line)

    def stop(self) -> int:
        self.process.kill()
        return self.process.wait()


class GrammarChecks:
    """`check(params)` raises ValueError unless the grammar compiles, in time, in a child process."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, children: int = 2):
        self._tokenizer, self._vocab_size, self._eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self._setup: str | None = None  # the child's first line, made with the first child
        self._idle: queue.LifoQueue = queue.LifoQueue()  # a started child first; None: one to start when needed
        for _ in range(children):
            self._idle.put(None)
        self._passed: OrderedDict[tuple, None] = OrderedDict()
        self._too_slow: OrderedDict[tuple, None] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        """`params` as the engine should compile them: a GBNF grammar as the child converted it to Lark."""
        key = params.key()
        with self._lock:
            if key in self._passed:
                self._passed.move_to_end(key)
                return self._passed[key]
            if key in self._too_slow:
                raise too_slow_error()
        child = self._idle.get()  # time queued behind other checks does not count against the limit
        try:
            if child is None or child.process.poll() is not None:
                child = None  # (the slot stays empty if the next one cannot start)
                child = _Child(self._child_setup())
            error, grammar = self._ask(child, params)
        except TimeoutError:
            child.stop()
            child = None
            self._remember(self._too_slow, key, None)
            raise too_slow_error() from None
        except EOFError:
            status = child.stop()
            child = None
            raise ValueError(f"{WHERE}: the grammar crashed the grammar compiler (exit status {status})") from None
        finally:
            self._idle.put(child)
        if error:
            raise ValueError(error)
        if grammar != params.grammar:  # converted (in the child: it costs CPU time, bounded there)
            params = dataclasses.replace(params, grammar=grammar)
        self._remember(self._passed, key, params)
        return params

    def _child_setup(self) -> str:
        with self._lock:
            if self._setup is None:
                tokenizer = tokenizer_json(self._tokenizer)
                self._setup = json.dumps(
                    {"tokenizer": tokenizer, "vocab_size": self._vocab_size, "eos": self._eos_token_ids}
                )
        return self._setup

    def _ask(self, child: _Child, params: StructuredOutputsParams) -> tuple[str | None, str | None]:
        """(why the grammar fails or None, the grammar as Lark)."""
        child.send(json.dumps(dataclasses.asdict(params)))
        child.receive(None)  # it starts on the grammar (after reading the vocabulary, once: not the grammar's time)
        answer = child.receive(time.monotonic() + structured_outputs.COMPILE_TIMEOUT_S)
        return answer["error"], answer["grammar"]

    def _remember(self, known: OrderedDict, key: tuple, value) -> None:
        with self._lock:
            known[key] = value
            if len(known) > REMEMBERED:
                known.popitem(last=False)

    def close(self) -> None:
        while not self._idle.empty():
            child = self._idle.get()
            if child is not None:
                child.stop()


def _serve() -> None:
    """A child: answers {"ready": true} before each grammar it starts on, then {"error": null or the reason,
    "grammar": the grammar form as Lark}."""
    answers = os.fdopen(os.dup(1), "w")  # the library's own messages go to stderr, not into the answers
    os.dup2(2, 1)
    setup = json.loads(sys.stdin.readline())
    tokenizer = ll_tokenizer(setup["tokenizer"], setup["vocab_size"], setup["eos"])
    for line in sys.stdin:
        answers.write('{"ready": true}\n')
        answers.flush()
        params, error = StructuredOutputsParams(**json.loads(line)), None
        try:
            if params.grammar is not None:
                params = dataclasses.replace(params, grammar=lark_grammar(params.grammar))
            compile_matcher(tokenizer, params)
        except ValueError as failure:
            error = str(failure)
        answers.write(json.dumps({"error": error, "grammar": params.grammar}) + "\n")
        answers.flush()


if __name__ == "__main__":
    _serve()
