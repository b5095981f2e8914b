"""A server's engine core as a Ray actor (`fovea serve --distributed-executor-backend ray`), so that its
data-parallel replicas spread over the nodes of a Ray cluster.

Each replica reserves a placement group of tensor_parallel_size bundles (one GPU each; packed onto as few nodes as
fit). The engine core takes bundle 0 and its tensor-parallel ranks the others (RayWorkers finds the group it runs
in). The front end speaks to the actor exactly as to a local engine process, over a socket connection instead of
pipes: the actor listens on its node, the front end connects. `RayEngineCore` looks like the multiprocessing
Process that EngineProcess otherwise holds, so that everything else (start-up, deaths, stop) stays one code.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Client, Connection, Listener

from fovea.config.engine import EngineConfig
from fovea.engine.engine_core import run_engine_core


class _EngineCoreActor:
    def listen(self) -> tuple[tuple[str, int], bytes]:
        import ray

        key = os.urandom(32)  # only the front end that launched this actor may drive it
        self.listener = Listener((ray.util.get_node_ip_address(), 0), authkey=key)
        return self.listener.address, key

    def run(self, config: EngineConfig, num_threads: int) -> None:
        connection = self.listener.accept()
        self.listener.close()
        run_engine_core(config, connection, connection, num_threads)


class RayEngineCore:
    """Handle on one replica's actor with the Process calls EngineProcess makes (is_alive, join, kill, exitcode)."""

    def __init__(self, config: EngineConfig, num_threads: int):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(address="auto", configure_logging=False)
        gpu = config.device.type == "cuda"
        unit = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self.group = placement_group([unit] * config.tensor_parallel_size, strategy="PACK")
        ray.get(self.group.ready(), timeout=600)
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=0)
        actor_class = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(_EngineCoreActor)
        self.actor = actor_class.options(scheduling_strategy=strategy).remote()
        address, key = ray.get(self.actor.listen.remote(), timeout=600)
        self._run = self.actor.run.remote(config, num_threads)
        self.connection: Connection = Client(address, authkey=key)
        self.exitcode: int | None = None
        self._released = False

    def is_alive(self) -> bool:
        return not self.join(0)

    def join(self, timeout: float | None = None) -> bool:
        import ray

        if self.exitcode is None:
            done, _ = ray.wait([self._run], timeout=timeout)
            if not done:
                return False
            try:
                ray.get(done[0])
                self.exitcode = 0
            except ray.exceptions.RayError:  # the actor died (killed, out of memory, its node lost)
                self.exitcode = 1
            self.kill()  # its GPUs go back to the cluster
        return True

    def kill(self) -> None:
        import ray

        if not self._released:
            self._released = True
            ray.kill(self.actor)
            ray.util.remove_placement_group(self.group)
