"""Tensor-parallel ranks 1..N-1 of an engine, each in its own process (rank 0 is the engine itself).

Rank 0 starts the workers, hosts the rendezvous and then, every step, sends the StepInput over the control group;
each worker runs the same forward pass on its slices of the weights and the KV cache, and the layers' collectives
join them. A second thread in each worker runs the vision tower when rank 0's image encoder sends it images. A
step or tower run that fails on every rank at the same collective (a request's failure) leaves them in step: the
worker goes on once rank 0 has compared their counts (`ParallelGroups.one_step`); one that failed on this rank
alone leaves it out of step, and it exits with OUT_OF_STEP_EXIT (rank 0 raises RanksOutOfStep: a new engine
process can start with new ranks).

A worker is a plain `python -m fovea.runner.tp_workers` child (the engine process is a daemon and may not have
multiprocessing children): its arguments come pickled on stdin, and stdin closing means rank 0 is gone. A worker
that crashes or is killed is fatal to the engine: rank 0 hears of it (`failure`) and the engine stops with that
message; a worker that cannot go on exits, so that nothing waits forever on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fovea.config.engine import EngineConfig
from fovea.core.memory import freeze_startup_heap
from fovea.distributed import FailedStep, ParallelGroups, RanksOutOfStep, TPGroup, free_port, join_groups

logger = logging.getLogger("fovea")
HANG_EXIT_S = 60.0  # after a worker died, rank 0 still blocked in a collective this long exits the process
SETTLE_WAIT_S = 30.0  # after a step failed here, rank 0's word that it failed too comes at once or never
OUT_OF_STEP_EXIT = 3  # a worker's exit code when it left out of step with rank 0 (a new engine can start)


class WorkerDied(RuntimeError):
    """A tensor-parallel worker crashed or was killed: the engine cannot go on."""


@dataclass
class WorkerArgs:
    config: EngineConfig
    rank: int
    local_rank: int  # the GPU index on its node
    address: str
    port: int
    num_threads: int


def worker_config(config: EngineConfig, local_rank: int) -> EngineConfig:
    if config.device.type != "cuda":
        return config
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return dataclasses.replace(config, device=device)


def run_worker(args: WorkerArgs, stop: Callable[[BaseException], None]) -> None:
    """A rank above 0, until rank 0 says stop (or its stdin / a peer's connection closes). Its two loops (steps
    here, vision tower runs in a thread) hand the error that ends either to `stop`, which must end the rank."""
    from fovea.runner.model_runner import ModelRunner

    torch.set_num_threads(args.num_threads)
    config = worker_config(args.config, args.local_rank)
    parallel = join_groups(
        args.rank, config.tensor_parallel_size, args.address, args.port, config.device, config.mm_encoder_tp_mode
    )
    runner = ModelRunner(config, parallel)
    freeze_startup_heap()  # (core/memory.py): a rank's pause stops every rank's step
    threading.Thread(target=_encode_loop, args=(runner, parallel, stop), name="fovea-tp-encoder", daemon=True).start()
    _follow_or_stop(stop, parallel, parallel.lm_control, parallel.lm, runner.run_worker_step, "step")


def _encode_loop(runner, parallel: ParallelGroups, stop: Callable[[BaseException], None]) -> None:
    stream = torch.cuda.Stream(runner.device) if runner.device.type == "cuda" else None
    with torch.inference_mode(), torch.cuda.stream(stream) if stream else contextlib.nullcontext():
        _follow_or_stop(
            stop, parallel, parallel.vision_control, parallel.vision_data, runner.encode_shared, "vision tower run"
        )


def _follow_or_stop(stop: Callable[[BaseException], None], parallel: ParallelGroups, *job) -> None:
    try:
        follow(parallel, *job)
    except Exception as error:  # noqa: BLE001 - out of step with rank 0, or a peer gone: this rank ends
        logger.exception("tensor-parallel worker %d: its %s loop stopped", parallel.rank, job[-1])
        stop(error)


def exit_code(error: BaseException) -> int:
    """A worker's exit code for the error that stops it: out of step (rank 0 starts a new engine) or failed."""
    return OUT_OF_STEP_EXIT if isinstance(error, RanksOutOfStep) else 1


def follow(parallel: ParallelGroups, control, group: TPGroup, run: Callable[[object], object], what: str) -> None:
    """A worker's loop over the jobs rank 0 sends on `control` (steps, vision tower runs), until it sends None. A
    job that fails here is logged, and rank 0's next word must be that it failed too (FailedStep): the ranks
    then compare the collectives each made on `group` in it (rank 0 stops this rank if they differ); anything
    else, or nothing within SETTLE_WAIT_S, and this rank is out of step (RanksOutOfStep)."""
    calls, failed = 0, False  # the last job's collectives; whether it failed here
    while True:
        try:
            message = parallel.send(None, control, SETTLE_WAIT_S if failed else None)
        except RuntimeError as error:  # a gloo timeout: rank 0 is stuck in a collective this rank left
            if failed:
                raise RanksOutOfStep(f"a {what} failed on this rank alone") from error
            raise
        if message is None:
            return
        if isinstance(message, FailedStep):
            parallel.settle(calls, control)
            failed = False
            continue
        if failed:
            raise RanksOutOfStep(f"rank 0 went on after a {what} that failed on this rank")
        start = group.calls[0]
        try:
            run(message)
        except Exception:  # noqa: BLE001 - met by every rank (a request's), the ranks are still in step
            logger.exception("tensor-parallel worker %d: a %s failed", parallel.rank, what)
            failed = True
        calls = group.calls[0] - start


_current: TPWorkers | None = None  # the ranks of this process's distributed engine


class TPWorkers:
    """Rank 0's side: starts the other ranks, joins the groups with them, watches them, stops them. Subclasses
    say where the ranks run (`_launch`, `_stop`)."""

    def __init__(self, config: EngineConfig, on_failure: Callable[[Exception], None] | None = None):
        """`on_failure(error)` runs in a watcher thread when a worker stops unexpectedly, with what `stopped`
        gives (the server's engine process reports it and exits, even while idle)."""
        global _current
        if _current is not None and not _current._closing:
            # torch.distributed has one default group per process: an engine left open gives way to this one
            logger.warning(
                "stopping the tensor-parallel ranks of an earlier engine in this process (close it, "
                "or use `with LLM(...)`): only one can hold the process group"
            )
            _current.close()
        _current = self
        self._on_failure = on_failure
        self.failure: str | None = None
        self.out_of_step = False  # the worker that stopped left out of step with rank 0, not crashed
        self._closing = False
        address, port = self._launch(config)
        try:
            self.parallel = join_groups(
                0, config.tensor_parallel_size, address, port, config.device, config.mm_encoder_tp_mode, self.check
            )
        except BaseException:
            self.close()
            raise

    def _launch(self, config: EngineConfig) -> tuple[str, int]:
        """Starts ranks 1..N-1; returns where rank 0 hosts the rendezvous."""
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError

    def check(self) -> None:
        if self.failure is not None:
            raise self.stopped()

    def stopped(self) -> Exception:
        """What a worker's stop means: RanksOutOfStep where it left out of step (a step or tower run failed there
        alone; a new engine with new ranks can start), else WorkerDied."""
        return (RanksOutOfStep if self.out_of_step else WorkerDied)(self.failure)

    def _report(self, rank: int, how: str, out_of_step: bool = False) -> None:
        """A watcher thread saw rank `rank` stop."""
        if self._closing:
            return
        self.out_of_step = out_of_step
        self.failure = f"tensor-parallel worker rank {rank} stopped ({how}); " + (
            "it was out of step with rank 0 after a failure there alone"
            if out_of_step
            else "the engine cannot go on without it"
        )
        logger.error(self.failure)
        if self._on_failure is not None:
            self._on_failure(self.stopped())
        time.sleep(HANG_EXIT_S)  # rank 0 should have stopped by now; a collective that never returns must not hang
        if not self._closing:
            logger.critical("rank 0 is still waiting on the dead worker; exiting")
            os._exit(1)

    def died(self, wait_s: float = 1.0) -> bool:
        """Whether a worker has stopped (a failed collective is usually the first sign: give the exit a moment)."""
        deadline = time.monotonic() + wait_s
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.failure is not None

    def close(self) -> None:
        """Tells the workers to stop (when they can hear it) and makes sure they are gone."""
        if self._closing:
            return
        self._closing = True
        if self.failure is None and hasattr(self, "parallel"):
            with contextlib.suppress(Exception):
                self.parallel.send(None, self.parallel.lm_control)
        self._stop()
        if torch.distributed.is_initialized():  # a later engine in this process starts its own group
            torch.distributed.destroy_process_group()


class ProcessWorkers(TPWorkers):
    """Ranks as child processes on this machine, one GPU each (--distributed-executor-backend mp)."""

    def _launch(self, config: EngineConfig) -> tuple[str, int]:
        address, port = "127.0.0.1", free_port()
        self.processes: list[subprocess.Popen] = []
        for rank in range(1, config.tensor_parallel_size):
            local_rank = (config.device.index or 0) + rank  # a data-parallel replica starts at its first GPU
            args = WorkerArgs(config, rank, local_rank, address, port, torch.get_num_threads())
            process = subprocess.Popen([sys.executable, "-m", "fovea.runner.tp_workers"], stdin=subprocess.PIPE)
            process.stdin.write(pickle.dumps(args))
            process.stdin.flush()
            self.processes.append(process)
            threading.Thread(target=self._watch, args=(rank, process), daemon=True).start()
        return address, port

    def _watch(self, rank: int, process: subprocess.Popen) -> None:
        code = process.wait()
        how = f"pid {process.pid}, " + (f"signal {-code}" if code < 0 else f"exit code {code}")
        self._report(rank, how, out_of_step=code == OUT_OF_STEP_EXIT)

    def _stop(self) -> None:
        for process in self.processes:
            with contextlib.suppress(OSError):
                process.stdin.close()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def start_workers(config: EngineConfig, on_failure: Callable[[Exception], None] | None = None):
    """The other ranks, on this machine (mp) or on a Ray cluster (ray)."""
    if config.distributed_executor_backend == "ray":
        from fovea.runner.ray_workers import RayWorkers

        return RayWorkers(config, on_failure)
    return ProcessWorkers(config, on_failure)


def _main() -> None:
    from fovea.worker_pool import ignore_group_signals

    ignore_group_signals()  # stops when rank 0 says so or goes away
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = pickle.load(sys.stdin.buffer)
    # stdin stays open while rank 0 lives: at end-of-file there is nobody left to serve
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), os._exit(0)), daemon=True).start()
    run_worker(args, lambda error: os._exit(exit_code(error)))  # (rank 0 reads why from the exit code)
    os._exit(0)


if __name__ == "__main__":  # run as the imported module, not as a second copy of it under __main__
    from fovea.runner import tp_workers

    tp_workers._main()
