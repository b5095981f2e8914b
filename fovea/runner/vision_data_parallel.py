"""The vision tower run data-parallel over the tensor-parallel ranks (--mm-encoder-tp-mode data).

Every rank holds the whole tower (it is small next to the language model: 0.7B of 72B), takes a share of a
step's images, encodes them with no communication inside the tower, and the embeddings are gathered once. For
many images this beats splitting every layer over the ranks (one all-reduce per layer and image batch). A share
that fails on one rank fails the run on every rank, told in the same gather: the ranks stay in step, and the
images are encoded again alone (image_encoder.py), so that only the requests showing one that fails fail.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fovea.config.engine import EngineConfig
from fovea.core.request import MMItem
from fovea.distributed import TPGroup


def share_out(patches: list[int], ranks: int) -> list[list[int]]:
    """Item indices per rank, largest images first to the least loaded rank; each share keeps item order."""
    load, shares = [0] * ranks, [[] for _ in range(ranks)]
    for index in sorted(range(len(patches)), key=lambda i: -patches[i]):
        rank = min(range(ranks), key=load.__getitem__)
        load[rank] += patches[index]
        shares[rank].append(index)
    return [sorted(share) for share in shares]


def encode_data_parallel(
    items: list[MMItem], encode: Callable[[list[MMItem]], list[torch.Tensor]], group: TPGroup, config: EngineConfig
) -> list[torch.Tensor]:
    unit = config.model.vision.spatial_merge_size**2
    rows = [t * h * w // unit for t, h, w in (item.grid_thw for item in items)]
    shares = share_out(rows, group.size)
    most_rows = max(sum(rows[i] for i in share) for share in shares)
    try:
        mine = encode([items[i] for i in shares[group.rank]])
    except Exception:  # every rank learns of it and fails this run too: the ranks stay in step
        gather_shares(None, most_rows, group, config)
        raise
    embeddings: list[torch.Tensor | None] = [None] * len(items)
    for share, rank_rows in zip(shares, gather_shares(mine, most_rows, group, config)):
        offset = 0
        for index in share:
            embeddings[index] = rank_rows[offset : offset + rows[index]]
            offset += rows[index]
    return embeddings


def gather_shares(
    mine: list[torch.Tensor] | None, most_rows: int, group: TPGroup, config: EngineConfig
) -> list[torch.Tensor]:
    """Every rank's embeddings (padded to `most_rows`), each rank's piece behind a row saying whether its share
    failed (`mine` None there); a rank whose own share was encoded raises when another's failed."""
    padded = torch.zeros(1 + most_rows, config.model.vision.output_width, dtype=config.dtype, device=config.device)
    if mine is None:
        padded[0] = 1
    elif mine:
        local = torch.cat(mine)
        padded[1 : 1 + local.shape[0]] = local
    gathered = [torch.empty_like(padded) for _ in range(group.size)]
    group.gather_into(gathered, padded)
    flags = torch.stack([rank_rows[0, 0] for rank_rows in gathered]).tolist()  # (one read of the device)
    failed = [rank for rank, flag in enumerate(flags) if flag]
    if failed and mine is not None:
        raise RuntimeError(f"the vision tower failed on tensor-parallel rank {failed[0]} (its log has the error)")
    return [rank_rows[1:] for rank_rows in gathered]
