"""`fovea eval --ray --num-replicas N`: the dataset sharded over N in-process engines, one per Ray actor.

Each replica takes `tensor_parallel_size` GPUs when the cluster has GPUs, else `cpus_per_replica` CPUs (CPU
replicas are for testing). The driver hands out chunks of conversations and keeps two chunks queued per replica,
so no replica idles while its answers travel back; the answers are put back in dataset order. Replicas read image
files themselves, so on a multi-node cluster the dataset must sit on storage every node sees.
"""

from __future__ import annotations

import math

from fovea.eval.backends import Completion, InProcessBackend, _progress
from fovea.eval.registry import ModelEntry

MAX_CHUNK = 256  # conversations per chunk: enough for full batches, small enough to balance the replicas


class _Replica:
    def __init__(self, entry: ModelEntry, engine_overrides: dict, threads: int):
        import torch

        if threads:
            torch.set_num_threads(threads)  # one replica per core share, not every replica on every core
        self.backend = InProcessBackend(entry, **engine_overrides)

    def complete(self, conversations: list[list[dict]], params: dict) -> list[Completion]:
        return self.backend.complete(conversations, params)

    def ready(self) -> bool:
        return True


class RayBackend:
    def __init__(
        self,
        entry: ModelEntry,
        num_replicas: int,
        address: str | None = None,
        cpus_per_replica: int = 1,
        **engine_overrides,
    ):
        try:
            import ray
        except ImportError:
            raise ValueError("--ray needs Ray: pip install 'fovea[ray]'") from None
        if num_replicas < 1:
            raise ValueError(f"--num-replicas must be at least 1, got {num_replicas}")
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        gpus = ray.cluster_resources().get("GPU", 0)
        if gpus:
            needed = num_replicas * entry.tensor_parallel_size
            if needed > gpus:
                raise ValueError(
                    f"{num_replicas} replicas of {entry.name} need {needed} GPUs; the cluster has {gpus:g}"
                )
            resources, threads = {"num_gpus": entry.tensor_parallel_size}, 0
        else:
            resources, threads = {"num_cpus": cpus_per_replica}, cpus_per_replica
        actor = ray.remote(**resources)(_Replica)
        self.replicas = [actor.remote(entry, engine_overrides, threads) for _ in range(num_replicas)]
        self._get([replica.ready.remote() for replica in self.replicas])  # load now: timings are for answering
        kind = f"{entry.tensor_parallel_size} GPU" if gpus else f"{cpus_per_replica} CPU"
        self.description = f"ray: {num_replicas} replicas x {kind}"

    def complete(self, conversations: list[list[dict]], params: dict, desc: str | None = None) -> list[Completion]:
        import ray

        size = max(1, min(MAX_CHUNK, math.ceil(len(conversations) / (4 * len(self.replicas)))))
        chunks = [conversations[i : i + size] for i in range(0, len(conversations), size)]
        answers: list[list[Completion] | None] = [None] * len(chunks)
        free = self.replicas * 2  # two queued chunks per replica
        in_flight: dict = {}
        bar = _progress(desc, len(conversations))
        try:
            next_chunk = 0
            while next_chunk < len(chunks) or in_flight:
                while free and next_chunk < len(chunks):
                    replica = free.pop()
                    in_flight[replica.complete.remote(chunks[next_chunk], params)] = (next_chunk, replica)
                    next_chunk += 1
                [done], _ = ray.wait(list(in_flight), num_returns=1)
                index, replica = in_flight.pop(done)
                answers[index] = self._get(done)
                bar.update(len(answers[index]))
                free.append(replica)
        finally:
            bar.close()
        return [completion for chunk in answers for completion in chunk]

    @staticmethod
    def _get(refs):
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayError as exc:  # a replica failed to start, or died
            cause = str(exc).strip().splitlines()[-1]  # the remote error's own line, not its traceback
            raise ValueError(f"a Ray replica failed: {cause}") from None

    def close(self) -> None:
        import ray

        for replica in self.replicas:
            ray.kill(replica)
        if self.started_ray:
            ray.shutdown()
