"""The Triton kernels of paged attention (triton_paged.py launches them), over the flat batch described in
fovea/attention/backend.py:
- `_store_kv`: one program per new token copies its K and V into the token's cache slot (slot -1 = padding, as in
  a CUDA-graph batch larger than the real one, is skipped).
- `_attention` (steps with prompt tokens): one program per (tile of query tokens of one sequence, KV head). The
  rows of a tile are its query tokens times the query heads sharing that KV head (GQA), so each K/V tile is loaded
  once for all of them. The program walks the sequence's context in tiles of BLOCK_N keys through the block table,
  with an online softmax in fp32, and stops at the last key its last query may see (causal over cached prefix +
  new tokens). Prefill, chunked prefill over a cached prefix and decode rows beside them are the same code. A
  sliding-window layer (`window` > 0) starts at the first key its first query may see and hides keys more than
  window - 1 behind each query; with SPANS, each query's last visible key is read from `limit_ptr` (its own
  position, or its bidirectional span's last: Gemma 3's image tokens see their image's later tokens).
- `_decode` + `_combine` (steps of decode tokens only): decode reads the whole KV cache once per step and is bound
  by memory bandwidth, so the work must fill the GPU even at small batches: one program per (sequence, KV head,
  split of the context). Each split keeps its own running max, sum and weighted values; `_combine` rescales the
  splits to a common max and adds them up. The number of splits depends only on the batch size and the longest
  context the step may see, so a CUDA graph captured for a batch size replays the same grid at any context. A
  sliding-window layer splits only its last `window` keys.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1), which is how CI checks them; the
bf16 dot products themselves are only exercised on a GPU.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton's interpreter multiplies bf16 tiles as raw integers in tl.dot (triton 3.9): there, dots run in fp32.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _store_kv(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    k_stride,
    v_stride,
    cache_stride_kv,
    cache_stride_slot,
    ROW: tl.constexpr,
    ROW_P2: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        cols = tl.arange(0, ROW_P2)
        keep = cols < ROW
        k = tl.load(k_ptr + token * k_stride + cols, mask=keep)
        v = tl.load(v_ptr + token * v_stride + cols, mask=keep)
        tl.store(cache_ptr + slot * cache_stride_slot + cols, k, mask=keep)
        tl.store(cache_ptr + cache_stride_kv + slot * cache_stride_slot + cols, v, mask=keep)


@triton.jit
def _kv_tile(
    cache_head,
    block_table,
    keys,
    key_ok,
    dims,
    dim_ok,
    cache_stride_kv,
    cache_stride_block,
    cache_stride_offset,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The keys and values at context positions `keys` of one sequence (its block table row) and KV head."""
    block = tl.load(block_table + keys // BLOCK_SIZE, mask=key_ok, other=0)
    offsets = block.to(tl.int64) * cache_stride_block + (keys % BLOCK_SIZE) * cache_stride_offset
    kv_mask = key_ok[:, None] & dim_ok[None, :]
    k = tl.load(cache_head + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(cache_head + cache_stride_kv + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v


@triton.jit
def _online_softmax(scores, v, best, total, acc, PRECISION: tl.constexpr):
    """A tile of keys' scores (hidden ones -inf) folded into each row's running max (`best`), sum of exponentials
    (`total`) and weighted values (`acc`), the earlier tiles' rescaled to the new max; a row that has seen no key
    yet stays at 0."""
    new_best = tl.maximum(best, tl.max(scores, 1))
    safe_best = tl.where(new_best == float("-inf"), 0.0, new_best)
    weights = tl.exp(scores - safe_best[:, None])
    rescale = tl.exp(best - safe_best)
    total = total * rescale + tl.sum(weights, 1)
    acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
    return new_best, total, acc


@triton.jit
def _fold_sinks(acc, total, best, sinks_ptr, head, row_ok):
    """A row's sink logit (GPT-OSS) joined to its softmax: a term of the denominator with no value. Both are
    rescaled to the larger of the row's best score and its sink, so neither exponential overflows."""
    sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
    top = tl.maximum(best, sink)
    keep = tl.exp(best - top)  # 0 for a row that saw no key
    return acc * keep[:, None], total * keep + tl.exp(sink - top)


@triton.jit
def _attention(
    q_ptr,
    cache_ptr,
    out_ptr,
    tile_seq_ptr,
    tile_first_ptr,
    query_start_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    limit_ptr,
    sinks_ptr,
    window,
    scale,
    k_scale_ptr,
    v_scale_ptr,
    q_stride_token,
    q_stride_head,
    out_stride_token,
    out_stride_head,
    cache_stride_kv,
    cache_stride_block,
    cache_stride_offset,
    cache_stride_head,
    block_tables_stride,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    FP8_KV: tl.constexpr,
    SPANS: tl.constexpr,
    SINKS: tl.constexpr,
):
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_first_ptr + tile)  # the tile's first query, counted within the sequence's new tokens
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # keys cached before this step

    rows = tl.arange(0, BLOCK_Q * GROUP_P2)
    query = first + rows // GROUP_P2
    head = kv_head * GROUP + rows % GROUP_P2
    row_ok = (query < query_len) & (rows % GROUP_P2 < GROUP)
    position = context_len + query  # the row's place in the context: it sees keys 0..position
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM
    token = (query_start + query).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * q_stride_token + head[:, None] * q_stride_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    if FP8_KV:
        scale = scale * tl.load(k_scale_ptr)

    best = tl.full([BLOCK_Q * GROUP_P2], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_Q * GROUP_P2], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P2, HEAD_DIM_P2], tl.float32)
    last_key = context_len + tl.minimum(first + BLOCK_Q, query_len)  # one past the last key any row sees
    limit = position  # each row's last visible key
    if SPANS:
        limit = tl.load(limit_ptr + token, mask=row_ok, other=0)
        last_key = tl.max(tl.where(row_ok, limit, 0)) + 1
    first_key = 0
    if window > 0:  # from the first key the tile's first row sees, in whole tiles
        first_key = tl.maximum(context_len + first - window + 1, 0) // BLOCK_N * BLOCK_N
    cache_head = cache_ptr + kv_head * cache_stride_head
    for start in range(first_key, last_key, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < last_key
        k, v = _kv_tile(
            cache_head,
            block_tables_ptr + seq * block_tables_stride,
            keys,
            key_ok,
            dims,
            dim_ok,
            cache_stride_kv,
            cache_stride_block,
            cache_stride_offset,
            BLOCK_SIZE,
            UPCAST,
        )
        if FP8_KV:  # stored value / scale in e4m3: the scales come in below, on the scores and the output
            k, v = k.to(q.dtype), v.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        visible = row_ok[:, None] & key_ok[None, :] & (keys[None, :] <= limit[:, None])
        if window > 0:
            visible = visible & (keys[None, :] > position[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        best, total, acc = _online_softmax(scores, v, best, total, acc, PRECISION)
    if SINKS:
        acc, total = _fold_sinks(acc, total, best, sinks_ptr, head, row_ok)
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    if FP8_KV:
        out = out * tl.load(v_scale_ptr)
    tl.store(
        out_ptr + token[:, None] * out_stride_token + head[:, None] * out_stride_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@triton.jit
def _decode(
    q_ptr,
    cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_stat_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    sinks_ptr,
    window,
    scale,
    k_scale_ptr,
    v_scale_ptr,
    q_stride_token,
    q_stride_head,
    out_stride_token,
    out_stride_head,
    cache_stride_kv,
    cache_stride_block,
    cache_stride_offset,
    cache_stride_head,
    block_tables_stride,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    FP8_KV: tl.constexpr,
    SINKS: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lowest = 0  # the first key the query sees: all, or its window's
    if window > 0:
        lowest = tl.maximum(seq_len - window, 0)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - lowest, BLOCK_N), SPLITS)
    begin = lowest + split * tiles_per_split * BLOCK_N
    end = tl.minimum(begin + tiles_per_split * BLOCK_N, seq_len)

    rows = tl.arange(0, ROWS)  # the query heads of this KV head; ROWS >= 16 for tl.dot, the extra rows masked
    row_ok = rows < GROUP
    head = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq.to(tl.int64) * q_stride_token + head[:, None] * q_stride_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    if FP8_KV:
        scale = scale * tl.load(k_scale_ptr)
    best = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_P2], tl.float32)
    cache_head = cache_ptr + kv_head * cache_stride_head
    for start in range(begin, end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        k, v = _kv_tile(
            cache_head,
            block_tables_ptr + seq * block_tables_stride,
            keys,
            key_ok,
            dims,
            dim_ok,
            cache_stride_kv,
            cache_stride_block,
            cache_stride_offset,
            BLOCK_SIZE,
            UPCAST,
        )
        if FP8_KV:  # stored value / scale in e4m3: the scales come in below, on the scores and the output
            k, v = k.to(q.dtype), v.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        best, total, acc = _online_softmax(scores, v, best, total, acc, PRECISION)
    if FP8_KV:  # the values' scale on the sum of weighted values (partials too: the combine is linear in them)
        acc = acc * tl.load(v_scale_ptr)
    if SPLITS == 1:
        if SINKS:
            acc, total = _fold_sinks(acc, total, best, sinks_ptr, head, row_ok)
        out = acc / total[:, None]
        tl.store(
            out_ptr + seq.to(tl.int64) * out_stride_token + head[:, None] * out_stride_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:  # partials of (sequence, query head, split): an empty split leaves max -inf, sum 0
        part = (seq.to(tl.int64) * tl.num_programs(1) * GROUP + head) * SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_P2 + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_stat_ptr + part * 2, best, mask=row_ok)
        tl.store(part_stat_ptr + part * 2 + 1, total, mask=row_ok)


@triton.jit
def _combine(
    part_acc_ptr,
    part_stat_ptr,
    out_ptr,
    out_stride_token,
    out_stride_head,
    q_heads,
    sinks_ptr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    SINKS: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    splits = tl.arange(0, SPLITS_P2)
    split_ok = splits < SPLITS
    part = (seq.to(tl.int64) * q_heads + head) * SPLITS + splits
    best = tl.load(part_stat_ptr + part * 2, mask=split_ok, other=float("-inf"))
    total = tl.load(part_stat_ptr + part * 2 + 1, mask=split_ok, other=0.0)
    dims = tl.arange(0, HEAD_DIM_P2)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_P2 + dims[None, :], mask=split_ok[:, None], other=0.0)
    top = tl.max(best, 0)  # the first split always holds keys: finite
    sink_weight = 0.0
    if SINKS:  # the row's sink logit, a term of the denominator (as _fold_sinks)
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        top = tl.maximum(top, sink)
        sink_weight = tl.exp(sink - top)
    weights = tl.exp(best - top)  # 0 for empty splits
    out = tl.sum(acc * weights[:, None], 0) / (tl.sum(total * weights, 0) + sink_weight)
    tl.store(
        out_ptr + seq.to(tl.int64) * out_stride_token + head * out_stride_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )
