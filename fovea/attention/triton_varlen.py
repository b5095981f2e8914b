"""Non-causal attention over a flat batch of variable-length segments in Triton: the vision tower's attention.

The vision tower attends within windows (window layers) and within whole images (full layers); both are segments
of one flat (num_patches, heads, head_dim) tensor. The work is described by a tile table, one row per program:
(segment start, segment length, first query of the tile). Its length depends only on the number of patches, not
on how they split into images and windows (`max_tiles`), and unused rows have length 0 and return at once, so a
bucket of patches always launches the same grid: what a CUDA graph needs.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from fovea.attention.triton_paged_kernels import INTERPRETED

BLOCK_M = 64  # queries per program: one 8x8-patch window of Qwen2.5-VL


@triton.jit
def _varlen_attention(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tiles_ptr,
    scale,
    q_stride,
    k_stride,
    v_stride,
    out_stride,
    q_head_stride,
    k_head_stride,
    v_head_stride,
    out_head_stride,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile, head = tl.program_id(0), tl.program_id(1)
    start = tl.load(tiles_ptr + tile * 3).to(tl.int64)
    length = tl.load(tiles_ptr + tile * 3 + 1)
    first = tl.load(tiles_ptr + tile * 3 + 2)
    if length > 0:
        rows = first + tl.arange(0, BLOCK_M)
        row_ok = rows < length
        dims = tl.arange(0, HEAD_DIM_P2)
        dim_ok = dims < HEAD_DIM
        q = tl.load(
            q_ptr + (start + rows)[:, None] * q_stride + head * q_head_stride + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        best = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
        for key_start in range(0, length, BLOCK_N):
            keys = key_start + tl.arange(0, BLOCK_N)
            key_ok = keys < length
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            token = (start + keys)[:, None]
            k = tl.load(k_ptr + token * k_stride + head * k_head_stride + dims[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + token * v_stride + head * v_head_stride + dims[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k, v = k.to(tl.float32), v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
            scores = tl.where(key_ok[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, 1))
            weights = tl.exp(scores - new_best[:, None])
            rescale = tl.exp(best - new_best)
            total = total * rescale + tl.sum(weights, 1)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            best = new_best
        out = acc / total[:, None]
        tl.store(
            out_ptr + (start + rows)[:, None] * out_stride + head * out_head_stride + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


def max_tiles(num_patches: int, min_segment: int = 4) -> int:
    """An upper bound on tiles for any split of num_patches into segments of at least min_segment patches."""
    return num_patches // BLOCK_M + num_patches // min_segment + 1


def tile_table(lengths: list[int], size: int | None = None) -> torch.Tensor:
    """(size, 3) int32 rows (segment start, segment length, first query), padded with zero-length rows."""
    rows = []
    start = 0
    for length in lengths:
        rows += [(start, length, first) for first in range(0, length, BLOCK_M)]
        start += length
    size = len(rows) if size is None else size
    if len(rows) > size:
        raise ValueError(f"{len(rows)} attention tiles do not fit a table of {size}")
    table = np.zeros((size, 3), dtype=np.int32)
    table[: len(rows)] = rows
    return torch.from_numpy(table)


def varlen_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: torch.Tensor, scale: float, fp32: bool = False
) -> torch.Tensor:
    """q/k/v: (N, H, D) (strided views are fine); tiles from tile_table. Returns (N, H, D) in q's dtype."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if fp32 and q.dtype != torch.float32:  # the dots in fp32 too; the result is written back in q's dtype
        q, k, v = q.float(), k.float(), v.float()
    head_dim = q.shape[2]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1
    _varlen_attention[(tiles.shape[0], q.shape[1])](
        q,
        k,
        v,
        out,
        tiles,
        scale,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        out.stride(0),
        q.stride(1),
        k.stride(1),
        v.stride(1),
        out.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=triton.next_power_of_2(head_dim),
        BLOCK_M=BLOCK_M,
        BLOCK_N=32,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=INTERPRETED,
    )
    return out
