"""The engine's own process: it owns the model, the KV cache and the scheduler, and does nothing but step.

It shares no interpreter (and no GIL) with the HTTP front end, so nothing the front end does (parsing a large
body, decoding a 3000x2000 JPEG, writing SSE chunks) can delay a step. Two one-way pipes connect them:

  front end -> engine:  ("add", Request)  ("abort", [request ids])  ("shutdown", None)
  engine -> front end:  ("ready", EngineConfig)  ("failed", traceback)  ("outputs", [RequestOutput], EngineStats)
                        ("rejected", request id, message)  ("error", [request ids], message)  ("dead", traceback)

A Request arrives fully prepared (token ids, positions, resized pixel arrays): the engine only copies it in.
Between steps it takes every command waiting; with no work it blocks until one comes. A request the engine
cannot take is rejected alone; a step that raises fails the requests it ran ("error") and the engine goes on.
Only after several failed steps in a row (a broken device, say) does the process give up ("dead"); the front
end then starts a new one.
"""

from __future__ import annotations

import logging
import sys
import traceback
from multiprocessing.connection import Connection

from fovea.engine.config import EngineConfig
from fovea.worker_pool import ignore_group_signals  # stops when the front end says so, after in-flight requests

MAX_FAILED_STEPS_IN_A_ROW = 3
logger = logging.getLogger("fovea")


def run_engine_core(config: EngineConfig, commands: Connection, results: Connection, num_threads: int) -> None:
    import torch

    from fovea.engine.engine import LLMEngine

    ignore_group_signals()
    torch.set_num_threads(num_threads)
    # the image encoder's thread holds the GIL between operators too: hand it back sooner than every 5 ms, so
    # that a decode step (many small operators) does not wait behind it
    sys.setswitchinterval(0.0005)
    try:
        engine = LLMEngine(config)
    except BaseException:  # noqa: BLE001 - the front end reports why start-up failed
        results.send(("failed", traceback.format_exc()))
        return
    results.send(("ready", engine.config))
    results.send(("outputs", [], engine.stats()))  # the gauges of a fresh engine; starts recording latencies
    try:
        _serve(engine, commands, results)
    except (EOFError, BrokenPipeError):
        return  # the front end is gone
    except BaseException:  # noqa: BLE001 - every waiting caller must hear about it
        results.send(("dead", traceback.format_exc()))


def _serve(engine, commands: Connection, results: Connection) -> None:
    failed_in_a_row = 0
    while True:
        wait = None if not engine.has_unfinished_requests() else 0  # idle: sleep until a command comes
        while commands.poll(wait):
            kind, payload = commands.recv()
            if kind == "shutdown":
                return
            if kind == "add":
                try:
                    engine.add_request(payload)
                except ValueError as error:  # this request cannot run here; the others go on
                    results.send(("rejected", payload.request_id, str(error)))
                except Exception as error:  # noqa: BLE001 - a bug hit by this request alone
                    logger.exception("adding request %s failed", payload.request_id)
                    results.send(("error", [payload.request_id], f"{type(error).__name__}: {error}"[:500]))
            else:
                engine.abort_request(payload)
            wait = 0
        try:
            outputs = engine.step() if engine.has_unfinished_requests() else []
            failed_in_a_row = 0
        except Exception as error:  # noqa: BLE001 - StepFailed (its requests are freed) or a scheduler bug
            failed_in_a_row += 1
            if failed_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
                raise
            if not hasattr(error, "request_ids"):
                logger.exception("an engine step failed")
            results.send(("error", getattr(error, "request_ids", []), str(error)))
            outputs = []
        results.send(("outputs", outputs, engine.stats()))
