"""Tensor-parallel ranks as Ray actors, on one node or several (--distributed-executor-backend ray).

Connects to the running cluster (`ray start --head` here, `ray start --address=HEAD:6379` on the other nodes;
or a `ray.init()` done by the caller) and reserves one bundle per rank in a placement group: bundle 0, on this
node, is rank 0's (the engine process itself; in a server, the replica's actor, in the group RayEngineCore made);
ranks 1..N-1 run as actors in the other bundles, packed onto as few nodes as fit. The ranks then meet over
torch.distributed exactly as local worker processes do (NCCL between GPUs, across nodes too); Ray only places and
watches them. An actor that dies is fatal, as a worker process is; one whose step or vision tower run failed there
alone, leaving it out of step with rank 0, raises RanksOutOfStep, and a new engine starts.
"""

from __future__ import annotations

import queue
import threading

import torch

from fovea.config.engine import EngineConfig
from fovea.distributed import RanksOutOfStep, free_port
from fovea.runner.tp_workers import TPWorkers, WorkerArgs, run_worker


class _Rank:
    def gpu(self) -> int:
        import ray

        return int(ray.get_gpu_ids()[0])

    def run(self, args: WorkerArgs) -> None:
        """Raises the error that ended the rank's step loop or its tower loop (a thread's: an actor that exits
        there reads as dead to rank 0, whatever the cause), so that rank 0's watcher sees which."""
        ended: queue.SimpleQueue = queue.SimpleQueue()

        def serve() -> None:
            try:
                run_worker(args, ended.put)
                ended.put(None)
            except Exception as error:  # noqa: BLE001 - it could not start
                ended.put(error)

        threading.Thread(target=serve, daemon=True).start()
        error = ended.get()
        if error is not None:
            raise error


class RayWorkers(TPWorkers):
    def _launch(self, config: EngineConfig) -> tuple[str, int]:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(address="auto", configure_logging=False)
        address, size = ray.util.get_node_ip_address(), config.tensor_parallel_size
        gpu = config.device.type == "cuda"
        unit = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        # a server's replica (RayEngineCore) already holds bundle 0 of a group sized for its ranks
        self.group = ray.util.get_current_placement_group()
        self.owns_group = self.group is None
        if self.owns_group:
            self.group = placement_group([{**unit, f"node:{address}": 0.001}] + [unit] * (size - 1), strategy="PACK")
            ray.get(self.group.ready(), timeout=600)

        def place(rank: int):
            strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank)
            return ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(_Rank).options(scheduling_strategy=strategy)

        self.actors = []
        if gpu and self.owns_group:  # rank 0 takes the GPU Ray gave bundle 0: no worker here gets the same one
            holder = place(0).remote()
            torch.cuda.set_device(ray.get(holder.gpu.remote()))
            self.actors.append(holder)
        port = free_port()
        self.runs = {}
        for rank in range(1, size):
            actor = place(rank).remote()
            self.actors.append(actor)
            # Ray shows each actor only its own GPU: it is device 0 there
            self.runs[actor.run.remote(WorkerArgs(config, rank, 0, address, port, torch.get_num_threads()))] = (
                rank,
                actor,
            )
        threading.Thread(target=self._watch, daemon=True).start()
        return address, port

    def _watch(self) -> None:
        import ray

        done, _ = ray.wait(list(self.runs), num_returns=1, timeout=None)
        out_of_step = False
        try:
            ray.get(done[0])
            how = "it returned"
        except Exception as error:  # noqa: BLE001 - the actor died or raised: its message says which
            cause = getattr(error, "cause", error)  # a RayTaskError's: what the actor raised
            how = f"{type(cause).__name__}: {str(cause).splitlines()[0][:300]}"
            out_of_step = isinstance(error, RanksOutOfStep)  # (Ray's error is also an instance of its cause's class)
        rank, actor = self.runs[done[0]]
        if out_of_step:  # its other loop still holds its connections: rank 0 may be waiting on it in a collective
            ray.kill(actor)
        self._report(rank, how, out_of_step)

    def _stop(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        if self.owns_group:
            ray.util.remove_placement_group(self.group)
