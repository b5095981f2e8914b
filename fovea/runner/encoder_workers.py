"""The vision tower in workers of its own (`--mm-encoder-workers N`, issue 58): the engine's ImageEncoder threads
hand each job to a free worker instead of running the tower themselves, and the embeddings come back into the same
encoder cache. Each worker holds the tower alone (loader.load_tower), not the language model.

- One host (the default): worker processes; a job's pixels go to the worker in shared-memory segments, its
  embeddings come back in another. A worker that dies takes only its job with it and a replacement starts
  (fovea/worker_pool.py); the job's images are encoded again, each alone (image_encoder.py), and only the requests
  showing one that fails by itself fail, naming it.
- `--distributed-executor-backend ray`: Ray actors spread over the cluster's nodes; pixels and embeddings travel
  through Ray's object store. Ray restarts an actor that dies and runs the job it held there again; a job that
  kills it twice fails, and its images are encoded again as above. A server starts them (`RayEncoders.start`)
  and all its data-parallel replicas send their jobs to the same N (`RayEncoders.attach`, by name): N encoders
  for M replicas, and a replica's death leaves them serving the others.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets

import numpy as np
import torch

from fovea.config.engine import EngineConfig
from fovea.config.model import ModelConfig
from fovea.core.request import MMItem
from fovea.multimodal.image_workers import SharedPixels
from fovea.multimodal.patchify import batch_patches
from fovea.worker_pool import WorkerFailed, WorkerPool, answer_jobs, ignore_group_signals

logger = logging.getLogger("fovea")

JOB_TIMEOUT_S = 600.0  # one job's images through a tower on a CPU; a hung worker is killed past it
DIED = "the vision encoder worker died or overran its time limit on these images"


class Tower:
    """What a worker runs: uint8 pixels of several items and their grids -> their merged embeddings, float32."""

    def __init__(self, model_dir, dtype: torch.dtype, device: str, config: ModelConfig):
        from fovea.models.loader import load_tower

        torch.set_num_threads(1)
        self.tower, self.config = load_tower(model_dir, dtype=dtype, device=device, config=config)
        self.device, self.dtype = device, dtype

    @torch.inference_mode()
    def encode(self, pixels: list[np.ndarray], grids: list[tuple]) -> np.ndarray:
        patches = batch_patches(pixels, self.config.image, self.device, self.dtype)
        return self.tower(patches, grids).float().cpu().numpy()


def _segment() -> str:
    return f"fovea{os.getpid()}_enc_{secrets.token_hex(8)}"


def _encoder_worker(conn, model_dir, dtype: torch.dtype, device: str, config: ModelConfig) -> None:
    ignore_group_signals()
    tower = Tower(model_dir, dtype, device, config)
    conn.send("ready")

    def encode(job) -> SharedPixels:
        pixels, grids, out = job
        merged = tower.encode([shared.take() for shared in pixels], grids)
        return SharedPixels.create(merged.view(np.uint8), out)  # float32 rows, sent as their bytes

    answer_jobs(
        conn, encode, lambda error, job: RuntimeError(f"the vision tower failed: {type(error).__name__}: {error}")
    )


class ProcessEncoders:
    """Worker processes on this host, jobs through shared memory."""

    def __init__(self, config: EngineConfig):
        args = (config.model_dir, config.dtype, str(config.device), config.model)
        self.pool = WorkerPool(_encoder_worker, args, config.mm_encoder_workers, "vision encoder")

    def __call__(self, pixels: list[np.ndarray], grids: list[tuple]) -> np.ndarray:
        shared = [SharedPixels.create(item, _segment()) for item in pixels]
        out = SharedPixels(_segment(), ())  # named here: freed here if the worker dies after making it
        try:
            answer = self.pool.call((shared, grids, out.name), JOB_TIMEOUT_S)
            if isinstance(answer, Exception):
                raise answer
            return answer.take().view(np.float32).copy()
        except WorkerFailed:
            raise RuntimeError(DIED) from None
        finally:
            for segment in (*shared, out):
                segment.release()  # taken already, unless the worker died first

    def close(self) -> None:
        self.pool.close()


class EncoderActor(Tower):
    def node(self) -> str:
        import ray

        return ray.util.get_node_ip_address()


class RayEncoders:
    """Ray actors, spread over the cluster's nodes (one CPU each, or one GPU on a GPU engine); jobs go to them in
    the order they come, each to the first actor free (free of this engine's jobs: replicas that share the actors
    do not see each other's, and an actor runs the jobs it is sent one after another)."""

    def __init__(self, actors: list, owned: bool, names: tuple[str, ...] = ()):
        import ray

        self.actors, self.owned, self.names = actors, owned, names  # names: where replicas attach
        self.nodes = ray.get([a.node.remote() for a in actors], timeout=600)
        self._idle: queue.Queue = queue.Queue()
        for a in actors:
            self._idle.put(a)

    @classmethod
    def start(cls, config: EngineConfig, named: bool = False) -> RayEncoders:
        """config.mm_encoder_workers new actors; `named`: under names that the server's replicas attach to."""
        import ray

        if not ray.is_initialized():
            ray.init(address="auto", configure_logging=False)
        gpu = config.device.type == "cuda"
        # a dead actor is started again, and the job it held (or was sent while it lay dead) is run once more
        # there: encoding is idempotent; a job that kills the tower twice fails its requests
        options = dict(num_cpus=1, num_gpus=1 if gpu else 0, max_restarts=-1, max_task_retries=1)
        actor = ray.remote(**options)(EncoderActor)
        args = (config.model_dir, config.dtype, "cuda" if gpu else "cpu", config.model)  # a GPU of the actor's own
        names = [f"fovea-encoder-{secrets.token_hex(6)}" if named else None for _ in range(config.mm_encoder_workers)]
        actors = [actor.options(scheduling_strategy="SPREAD", name=name).remote(*args) for name in names]
        encoders = cls(actors, owned=True, names=tuple(names) if named else ())
        logger.info("vision encoder workers (Ray actors) on %s", ", ".join(encoders.nodes))
        return encoders

    @classmethod
    def attach(cls, names: tuple[str, ...]) -> RayEncoders:
        """The actors a server started for all its replicas (EngineConfig.mm_encoder_actors): this engine
        neither starts nor stops them."""
        import ray

        return cls([ray.get_actor(name) for name in names], owned=False)

    def __call__(self, pixels: list[np.ndarray], grids: list[tuple]) -> np.ndarray:
        import ray

        actor = self._idle.get()
        try:
            return ray.get(actor.encode.remote(pixels, grids), timeout=JOB_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor, no_restart=False)  # Ray starts it again
            raise RuntimeError(DIED) from None
        except ray.exceptions.RayActorError:  # died holding the job twice
            raise RuntimeError(DIED) from None
        except ray.exceptions.RayTaskError as error:
            raise RuntimeError(f"the vision tower failed: {error.cause!r}") from None
        finally:
            self._idle.put(actor)

    def close(self) -> None:
        import ray

        for a in self.actors if self.owned else ():
            ray.kill(a, no_restart=True)


class RemoteTower:
    """Callable as the ImageEncoder's `encode`: items -> one (tokens, hidden) tensor each, from a worker."""

    def __init__(self, config: EngineConfig):
        self.device, self.dtype, self.unit = config.device, config.dtype, config.model.vision.spatial_merge_size**2
        if config.mm_encoder_actors:  # a server's, shared by its replicas
            self.encoders = RayEncoders.attach(config.mm_encoder_actors)
        elif config.distributed_executor_backend == "ray":
            self.encoders = RayEncoders.start(config)
        else:
            self.encoders = ProcessEncoders(config)

    def __call__(self, items: list[MMItem]) -> list[torch.Tensor]:
        given = {i: item for i, item in enumerate(items) if item.embeds}  # the tower's output already
        towered = [item for item in items if not item.embeds]
        rows = iter(self._encode(towered) if towered else [])
        return [
            torch.from_numpy(given[i].pixels).to(self.device, self.dtype) if i in given else next(rows)
            for i in range(len(items))
        ]

    def _encode(self, items: list[MMItem]) -> list[torch.Tensor]:
        grids = [item.grid_thw for item in items]
        merged = torch.from_numpy(self.encoders([item.pixels for item in items], grids))  # (tokens, width)
        sizes = [t * h * w // self.unit for t, h, w in grids]
        return [part.to(self.device, self.dtype) for part in merged.split(sizes)]

    def close(self) -> None:
        self.encoders.close()
