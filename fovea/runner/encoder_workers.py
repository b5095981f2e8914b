"""The vision tower in worker processes of its own (`--mm-encoder-workers N`, issue 58): the engine's ImageEncoder
threads hand each job to a free worker instead of running the tower themselves, and the embeddings come back into
the same encoder cache. Same host: a job's pixels go to the worker in a shared-memory segment, its embeddings come
back in another; each worker holds the tower alone (loader.load_tower), not the language model. A worker that dies
takes only its job with it (those requests fail, naming it) and a replacement starts (fovea/worker_pool.py).
"""

from __future__ import annotations

import os
import secrets

import numpy as np
import torch

from fovea.config.engine import EngineConfig
from fovea.core.request import MMItem
from fovea.multimodal.image_workers import SharedPixels
from fovea.multimodal.patchify import batch_patches
from fovea.worker_pool import WorkerFailed, WorkerPool, answer_jobs, ignore_group_signals

JOB_TIMEOUT_S = 600.0  # one job's images through a tower on a CPU; a hung worker is killed past it


def _segment() -> str:
    return f"fovea{os.getpid()}_enc_{secrets.token_hex(8)}"


def _encoder_worker(conn, model_dir, dtype: torch.dtype, device: str) -> None:
    from fovea.models.loader import load_tower

    ignore_group_signals()
    torch.set_num_threads(1)
    tower, config = load_tower(model_dir, dtype=dtype, device=device)
    conn.send("ready")

    @torch.inference_mode()
    def encode(job) -> SharedPixels:
        pixels, grids, out = job
        patches = batch_patches([shared.take() for shared in pixels], config.image, device, dtype)
        merged = tower(patches, grids).float().cpu().numpy()
        return SharedPixels.create(merged.view(np.uint8), out)  # float32 rows, sent as their bytes

    answer_jobs(
        conn, encode, lambda error, job: RuntimeError(f"the vision tower failed: {type(error).__name__}: {error}")
    )


class RemoteTower:
    """Callable as the ImageEncoder's `encode`: items -> one (tokens, hidden) tensor each, from a worker."""

    def __init__(self, config: EngineConfig):
        self.device, self.dtype, self.unit = config.device, config.dtype, config.model.vision.spatial_merge_size**2
        self.pool = WorkerPool(
            _encoder_worker,
            (config.model_dir, config.dtype, str(config.device)),
            config.mm_encoder_workers,
            "vision encoder",
        )

    def __call__(self, items: list[MMItem]) -> list[torch.Tensor]:
        given = {i: item for i, item in enumerate(items) if item.embeds}  # the tower's output already
        towered = [item for item in items if not item.embeds]
        rows = iter(self._encode(towered) if towered else [])
        return [
            torch.from_numpy(given[i].pixels).to(self.device, self.dtype) if i in given else next(rows)
            for i in range(len(items))
        ]

    def _encode(self, items: list[MMItem]) -> list[torch.Tensor]:
        pixels = [SharedPixels.create(item.pixels, _segment()) for item in items]
        out = SharedPixels(_segment(), ())  # named here: freed here if the worker dies after making it
        try:
            answer = self.pool.call((pixels, [item.grid_thw for item in items], out.name), JOB_TIMEOUT_S)
            if isinstance(answer, Exception):
                raise answer
            merged = torch.from_numpy(answer.take().view(np.float32).copy())  # (tokens, width)
        except WorkerFailed:
            raise RuntimeError("the vision encoder worker died or overran its time limit on these images") from None
        finally:
            for shared in (*pixels, out):
                shared.release()  # taken already, unless the worker died first
        sizes = [t * h * w // self.unit for t, h, w in (item.grid_thw for item in items)]
        return [part.to(self.device, self.dtype) for part in merged.split(sizes)]

    def close(self) -> None:
        self.pool.close()
