"""Paged attention in Triton: the engine's attention backend on NVIDIA GPUs. The kernels and what each does are in
triton_paged_kernels.py; here, their grids and launch settings, chosen per step from the batch's shape.
"""

from __future__ import annotations

import numpy as np
import torch
import triton

from fovea.attention.backend import AttentionBackend, to_fp8
from fovea.attention.triton_paged_kernels import INTERPRETED, _attention, _combine, _decode, _store_kv
from fovea.core.host_copy import to_device


def _block_q(meta, group_p2: int, rows: int = 64) -> int:
    """Query tokens per program of `_attention`: `rows` rows of (query, head) for steps with prompt tokens."""
    return max(1, rows // group_p2)


def decode_splits(num_seqs: int, kv_heads: int, max_seq_len: int, block_n: int, programs: int) -> int:
    """Splits of the context per (sequence, KV head): enough programs to fill the GPU (`programs`), no more
    splits than tiles of the longest context, at most 64."""
    wanted = -(-programs // (num_seqs * kv_heads))
    return max(1, min(wanted, -(-max_seq_len // block_n), 64))


def _tiles(meta, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, first query) of every tile of `block_q` new tokens, built on the host: their count is the
    kernel's grid, and counting them on the device would wait for the work queued before this step."""
    starts = meta.query_starts_host if meta.query_starts_host is not None else meta.query_start_loc.cpu().numpy()
    tiles_per_seq = -(-np.diff(starts.astype(np.int64)) // block_q)
    tile_seq = np.repeat(np.arange(len(tiles_per_seq)), tiles_per_seq)
    first = (np.arange(len(tile_seq)) - (np.cumsum(tiles_per_seq) - tiles_per_seq)[tile_seq]) * block_q
    device = meta.query_start_loc.device
    return to_device(tile_seq.astype(np.int32), None, device), to_device(first.astype(np.int32), None, device)


def span_limits(meta) -> torch.Tensor:
    """(new tokens,) int32: the last key each new token may see: its own position, or, inside a bidirectional
    span, the span's last (on the step's device, without waiting for it: the token count is the slots')."""
    starts = meta.query_start_loc.long()
    query_lens = starts[1:] - starts[:-1]
    seq = torch.arange(query_lens.numel(), device=starts.device)
    seq = torch.repeat_interleave(seq, query_lens, output_size=meta.slot_mapping.numel())
    position = meta.seq_lens.long()[seq] - query_lens[seq] + torch.arange(seq.numel(), device=seq.device) - starts[seq]
    limits = position.clone()
    for index, spans in meta.bidirectional_spans.items():
        for first, end in spans:
            inside = (seq == index) & (position >= first) & (position < end)
            limits = torch.where(inside, end - 1, limits)
    return limits.to(torch.int32)


class TritonAttention(AttentionBackend):
    """`block_n`: keys per tile; `prefill_rows`: (query, head) rows per `_attention` program; `decode_programs`:
    how many programs a decode step should launch at least (default: 4 per multiprocessor on a GPU, 8 under the
    interpreter); `*_warps`, `*_stages`: Triton launch settings (None: Triton's defaults)."""

    def __init__(
        self,
        group: int = 1,
        block_n: int = 64,
        prefill_rows: int = 64,
        decode_block_n: int = 64,
        decode_programs: int | None = None,
        prefill_warps: int | None = None,
        decode_warps: int | None = None,
        decode_stages: int | None = None,
    ):
        self.block_n, self.prefill_rows, self.decode_block_n = block_n, prefill_rows, decode_block_n
        self.decode_programs = decode_programs
        self.prefill_launch = {"num_warps": prefill_warps} if prefill_warps else {}
        self.decode_launch = {k: v for k, v in (("num_warps", decode_warps), ("num_stages", decode_stages)) if v}
        self.group_p2 = triton.next_power_of_2(group)  # the model's query heads per KV head

    def prepare(self, meta):
        if meta.max_query_len > 1:
            block_q = _block_q(meta, self.group_p2, self.prefill_rows)
            meta.plan[("tiles", block_q)] = _tiles(meta, block_q)
        if meta.bidirectional_spans:
            meta.plan["limits"] = span_limits(meta)

    def forward(self, q, k, v, kv_cache, meta, scale, window=None, kv_scales=None, sinks=None):
        if q.stride(2) != 1:
            q = q.contiguous()
        num_tokens, q_heads, head_dim = q.shape
        kv_heads = k.shape[1]
        fp8 = kv_cache.dtype == torch.float8_e4m3fn
        if fp8:  # stored as the reference stores them; the kernels copy the bytes
            k, v = to_fp8(k, kv_scales[0]), to_fp8(v, kv_scales[1])
        scales = kv_scales if fp8 else (kv_cache, kv_cache)  # unread unless FP8_KV
        k, v = k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)
        row = kv_heads * head_dim
        _store_kv[(num_tokens,)](
            k,
            v,
            kv_cache,
            meta.slot_mapping,
            k.stride(0),
            v.stride(0),
            kv_cache.stride(0),
            kv_cache.stride(2),
            ROW=row,
            ROW_P2=triton.next_power_of_2(row),
        )
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        cache_strides = (kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3))
        precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 stays exact; tf32 = no-op for bf16
        if meta.max_query_len == 1:
            self._decode(q, kv_cache, out, meta, scale, scales, kv_heads, cache_strides, precision, window or 0, sinks)
            return out
        group = q_heads // kv_heads
        group_p2 = triton.next_power_of_2(group)
        block_q = _block_q(meta, group_p2, self.prefill_rows)
        key = ("tiles", block_q)
        if key not in meta.plan:  # layers with another GQA group than prepare() planned for
            meta.plan[key] = _tiles(meta, block_q)
        tile_seq, tile_first = meta.plan[key]
        limits = meta.plan.get("limits")
        _attention[(tile_seq.numel(), kv_heads)](
            q,
            kv_cache,
            out,
            tile_seq,
            tile_first,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.seq_lens if limits is None else limits,  # unread without spans
            out if sinks is None else sinks,  # unread without sinks
            window or 0,
            scale,
            *scales,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            *cache_strides,
            meta.block_tables.stride(0),
            GROUP=group,
            GROUP_P2=group_p2,
            BLOCK_Q=block_q,
            BLOCK_N=self.block_n,
            HEAD_DIM=head_dim,
            HEAD_DIM_P2=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=meta.block_size,
            PRECISION=precision,
            UPCAST=INTERPRETED,
            FP8_KV=fp8,
            SPANS=limits is not None,
            SINKS=sinks is not None,
            **self.prefill_launch,
        )
        return out

    def _decode(self, q, kv_cache, out, meta, scale, scales, kv_heads, cache_strides, precision, window, sinks):
        num_seqs, q_heads, head_dim = q.shape
        group, head_dim_p2 = q_heads // kv_heads, triton.next_power_of_2(head_dim)
        if self.decode_programs is None:
            self.decode_programs = (
                4 * torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
            )
        splits = decode_splits(num_seqs, kv_heads, meta.max_seq_len, self.decode_block_n, self.decode_programs)
        part_acc = part_stat = out  # unused with one split
        if splits > 1:
            part_acc = torch.empty(num_seqs * q_heads * splits, head_dim_p2, dtype=torch.float32, device=q.device)
            part_stat = torch.empty(num_seqs * q_heads * splits, 2, dtype=torch.float32, device=q.device)
        _decode[(num_seqs, kv_heads, splits)](
            q,
            kv_cache,
            out,
            part_acc,
            part_stat,
            meta.seq_lens,
            meta.block_tables,
            out if sinks is None else sinks,  # unread without sinks
            window,
            scale,
            *scales,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            *cache_strides,
            meta.block_tables.stride(0),
            GROUP=group,
            ROWS=max(16, triton.next_power_of_2(group)),
            BLOCK_N=self.decode_block_n,
            HEAD_DIM=head_dim,
            HEAD_DIM_P2=head_dim_p2,
            BLOCK_SIZE=meta.block_size,
            SPLITS=splits,
            PRECISION=precision,
            UPCAST=INTERPRETED,
            FP8_KV=kv_cache.dtype == torch.float8_e4m3fn,
            SINKS=sinks is not None,
            **self.decode_launch,
        )
        if splits > 1:
            _combine[(num_seqs, q_heads)](
                part_acc,
                part_stat,
                out,
                out.stride(0),
                out.stride(1),
                q_heads,
                out if sinks is None else sinks,
                HEAD_DIM=head_dim,
                HEAD_DIM_P2=head_dim_p2,
                SPLITS=splits,
                SPLITS_P2=triton.next_power_of_2(splits),
                SINKS=sinks is not None,
            )
