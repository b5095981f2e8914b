"""The engine's own process: it owns the model, the KV cache and the scheduler, and does nothing but step.

It shares no interpreter (and no GIL) with the HTTP front end, so nothing the front end does (parsing a large
body, decoding a 3000x2000 JPEG, writing SSE chunks) can delay a step. Two one-way pipes connect them, carrying the
messages of fovea/core/messages.py.

A RequestInput arrives fully prepared (token ids, positions, resized pixel arrays): the engine only copies it in.
Between steps it takes every command waiting; with no work it blocks until one comes. A request the engine
cannot take is rejected alone; a request a step fails is failed alone (RequestsFailed) and the engine goes on,
however many there are. Only after several steps in a row fail with no request to blame (a broken device, say)
does the process give up (Dead); the front end then starts a new one, as it does at once when a failed step left
the tensor-parallel ranks out of step (a worker that left out of step too). A tensor-parallel worker that crashes
or is killed is Fatal: the server exits with its message.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

from fovea.config.engine import EngineConfig
from fovea.core.memory import freeze_startup_heap, watch_memory
from fovea.core.messages import (
    AbortRequests,
    AddRequest,
    Dead,
    Fatal,
    HeldRequests,
    Profile,
    Ready,
    Rejected,
    RemoveLoRA,
    RequestsFailed,
    ResetCache,
    Shutdown,
    StartFailed,
    StepOutputs,
)
from fovea.engine.profiler import StepProfiler, profiler_dir
from fovea.runner.tp_workers import RanksOutOfStep, WorkerDied
from fovea.worker_pool import ignore_group_signals  # stops when the front end says so, after in-flight requests

MAX_FAILED_STEPS_IN_A_ROW = 3
STATS_EVERY_S = 0.05
HELD_EVERY_S = 2.0  # how soon a request the engine lost fails while others run (StepOutputs.held)
logger = logging.getLogger("fovea")


def run_engine_core(config: EngineConfig, commands: Connection, results: Connection, num_threads: int) -> None:
    import torch

    from fovea.engine.engine import LLMEngine

    ignore_group_signals()
    watch_memory("the engine")
    torch.set_num_threads(num_threads)
    if config.device.type == "cuda" and config.device.index is not None:
        torch.cuda.set_device(config.device)  # a data-parallel replica's first GPU
    # the image encoder's thread holds the GIL between operators too: hand it back sooner than every 5 ms, so
    # that a decode step (many small operators) does not wait behind it
    sys.setswitchinterval(0.0005)
    lock = threading.Lock()  # a worker's watcher thread may report while the main thread sends

    def send(message) -> None:
        with lock:
            results.send(message)

    def worker_failed(error: Exception) -> None:  # even while idle, blocked on the command pipe
        if lock.acquire(timeout=10):  # out of step: a new engine process starts with new ranks
            results.send(Dead(str(error)) if isinstance(error, RanksOutOfStep) else Fatal(str(error)))
        os._exit(1)

    try:
        engine = LLMEngine(config, on_worker_failure=worker_failed)  # its front end makes the outputs
        engine.grammars.warm_up()  # before the server answers: the first structured request is not slow
    except BaseException:  # noqa: BLE001 - the front end reports why start-up failed
        send(StartFailed(traceback.format_exc()))
        return
    freeze_startup_heap()  # a full garbage collection no longer walks the model and the libraries
    send(Ready(engine.config))
    send(StepOutputs([], engine.stats()))  # the gauges of a fresh engine; starts recording latencies
    try:
        _serve(engine, commands, send)
    except (EOFError, BrokenPipeError):
        return  # the front end is gone
    except WorkerDied as error:
        send(Fatal(str(error)))
    except BaseException:  # noqa: BLE001 - every waiting caller must hear about it
        send(Dead(traceback.format_exc()))
    finally:
        engine.close()


def _serve(engine, commands: Connection, send: Callable[[object], None]) -> None:
    from fovea.engine.engine import StepFailed  # loaded with the engine, in this process only

    failed_in_a_row, last_stats, last_held, requests_read = 0, time.monotonic(), time.monotonic(), 0
    folder = profiler_dir()
    profiler = StepProfiler(folder) if folder is not None else None
    while True:
        wait = None if not engine.has_unfinished_requests() else 0  # idle: sleep until a command comes
        while commands.poll(wait):
            match commands.recv():
                case Shutdown():
                    return
                case AddRequest(request):
                    requests_read += 1
                    try:
                        engine.add_request(request)
                    except ValueError as error:  # this request cannot run here; the others go on
                        send(Rejected(request.request_id, str(error)))
                    except Exception as error:  # noqa: BLE001 - a bug hit by this request alone
                        logger.exception("adding request %s failed", request.request_id)
                        send(RequestsFailed([request.request_id], f"{type(error).__name__}: {error}"[:500]))
                case AbortRequests(request_ids):
                    engine.abort_request(request_ids)
                case RemoveLoRA(lora_int_id):
                    engine.remove_lora(lora_int_id)
                case Profile(start) if profiler is not None:
                    if start:
                        profiler.start()
                    else:
                        profiler.stop()
                case ResetCache("prefix"):
                    if not engine.blocks.reset_prefix_cache():
                        logger.warning("the prefix cache was not reset: requests hold KV blocks")
                case ResetCache("mm"):
                    engine.encoder_cache.reset()
            wait = 0
        try:
            outputs = engine.step_deltas() if engine.has_unfinished_requests() else []
            failed_in_a_row = 0
        except (WorkerDied, RanksOutOfStep):  # a worker gone is Fatal; ranks out of step need a new process
            raise
        except StepFailed as failure:  # its requests were failed and freed: nothing else is wrong
            if failure.refused:
                for request_id in failure.request_ids:
                    send(Rejected(request_id, str(failure)))
            else:
                send(RequestsFailed(failure.request_ids, str(failure)))
            outputs = []
        except Exception:  # noqa: BLE001 - a scheduler bug or a broken device
            failed_in_a_row += 1
            if failed_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
                raise
            logger.exception("an engine step failed")
            outputs = []
        now = time.monotonic()
        # a step with nothing to report, while others follow, sends the gauges and latency events (which
        # accumulate) at most every STATS_EVERY_S: a non-streamed batch's steps cost no message and no count
        idle = not engine.has_unfinished_requests()
        if outputs or now - last_stats >= STATS_EVERY_S or idle:
            held = None
            if idle or now - last_held >= HELD_EVERY_S:
                held, last_held = HeldRequests(requests_read, engine.held_request_ids()), now
            send(StepOutputs(outputs, engine.stats(), held))
            last_stats = now
