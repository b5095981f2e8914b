"""The attention-backend interface the engine calls, and its pure-PyTorch reference implementation.

Each language-model layer owns a paged KV cache of shape (2, num_blocks, block_size, kv_heads, head_dim): keys
and values of every token live in fixed-size blocks, listed per sequence in a block table. One step's batch is
flat: the new tokens of every scheduled sequence concatenated (prefill chunks and single decode tokens alike).
A backend writes the new tokens' K/V into their slots, then lets each query attend to its sequence's whole
context: the cached prefix, earlier chunks and the causal part of its own chunk.

A layer may be a sliding-window one (`window`), and a step may name bidirectional spans per sequence (tokens of a
prompt's image that see each other both ways); the registry (fovea/attention/__init__.py) says which backends can.

`TorchAttention` gathers each sequence's context from the cache and runs SDPA: the decode rows together, with a
mask over padded keys only; each prefill chunk on its own, causal (lower-right when a cached prefix precedes the
chunk: PyTorch's bias on a GPU, which its memory-efficient kernels take without a mask; on the CPU, whose SDPA
builds the scores anyway, that one sequence's chunk x context mask), so no (queries x keys) mask is built for a
batch. Slow, but simple enough to be the ground truth the GPU
kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PagedAttentionMetadata:
    backend: AttentionBackend
    slot_mapping: torch.Tensor  # (num_tokens,) int64: flat slot (block * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32: where each sequence's new tokens start
    seq_lens: torch.Tensor  # (num_seqs,) int32: context length after this step, new tokens included
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32, padded with 0
    max_query_len: int
    max_seq_len: int
    block_size: int
    kv_caches: list[torch.Tensor] = field(default_factory=list)  # one per layer: (2, blocks, block_size, heads, dim)
    plan: dict = field(default_factory=dict)  # what a backend precomputes once per step for all layers
    # sequence index -> (first, end) positions of prompt spans whose tokens also see each other's later tokens
    # (Gemma 3's images); a span must lie whole in one step's chunk, with its keys in context
    bidirectional_spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)


class AttentionBackend:
    """What the model's attention layers call. Implementations: TorchAttention here, Triton ones on GPUs."""

    def prepare(self, meta: PagedAttentionMetadata) -> None:
        """Per-step work shared by all layers (index tensors, kernel plans); called once before the forward."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: PagedAttentionMetadata,
        scale: float,
        window: int | None = None,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q: (N, Hq, D), k/v: (N, Hkv, D) for the N new tokens. Stores k/v, returns (N, Hq, D). `window`: a
        sliding-window layer's W (a query sees itself and the W - 1 keys before it); None: all keys.
        `kv_scales`: the layer's k and v scales, for a float8 cache (stored = value / scale)."""
        raise NotImplementedError


FP8_MAX = 448.0  # float8_e4m3fn's largest value: a key or value beyond scale x 448 is clipped there


def write_kv(k, v, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_scales=None) -> None:
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
    if kv_cache.dtype != torch.float8_e4m3fn:
        flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
        flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
        return
    raw = flat.view(torch.uint8)  # PyTorch copies float8 by index only as bytes
    for i, (new, kv_scale) in enumerate(zip((k, v), kv_scales)):
        raw[i].index_copy_(0, slot_mapping, to_fp8(new, kv_scale).view(torch.uint8))


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What a float8 KV cache stores of keys or values: x / scale in e4m3, clipped to its range."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


# Decode rows are gathered and attended in groups whose keys and values (padding included) fill at most this many
# bytes: a copy of the whole batch's context per layer (134 MB at batch 128 x 1k on the 512-wide model) leaves the
# CPU's caches and is fresh memory from the kernel at every call, which made the time per context token grow with
# the batch (issue 37); benchmarks/cpu_attention.py measured 2048 keys the best of 2k-8k at 2 KV heads of 64 fp32.
# Narrower keys make more of them fit: the demo model's (2 heads of 16) take 8192 a group (64 prompts x 128 in /
# 64 out took 3.34-3.43 s so, against 3.59-3.80 s in groups of 2048: fewer, larger copies and products).
DECODE_GROUP_BYTES = 2 << 20


def decode_group_tokens(kv_width: int) -> int:
    """Keys a decode group holds when each has `kv_width` (KV heads x head size) values, its key and value fp32."""
    return max(1, DECODE_GROUP_BYTES // (2 * kv_width * 4))


DECODE_GROUP_TOKENS = decode_group_tokens(128)  # 2048: a backend built without its model's width


class TorchAttention(AttentionBackend):
    def __init__(
        self,
        fp32_softmax: bool = False,
        device: torch.device | str = "cpu",
        decode_group_tokens: int | None = DECODE_GROUP_TOKENS,
    ):
        self.fp32_softmax = fp32_softmax  # scores and softmax in fp32 for bf16/fp16 models
        self.decode_group_tokens = decode_group_tokens  # None: the whole batch in one group
        self.lower_right = None
        if torch.device(device).type == "cuda":  # memory-efficient kernels take this bias without a mask
            from torch.nn.attention.bias import causal_lower_right  # imported here: it takes seconds

            self.lower_right = causal_lower_right

    def causal_over_prefix(self, queries: int, context: int, device) -> object:
        """Query i (of the last `queries` of `context` positions) sees keys up to context - queries + i."""
        if self.lower_right is not None:
            return self.lower_right(queries, context)
        return torch.ones(queries, context, dtype=torch.bool, device=device).tril(context - queries)

    def prepare(self, meta: PagedAttentionMetadata) -> None:
        device = meta.slot_mapping.device
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        tables = meta.block_tables.long()
        bs = meta.block_size

        def key_slots(index: int, length: int) -> torch.Tensor:  # flat cache slot of each context position
            positions = torch.arange(length, device=device)
            return tables[index, positions // bs] * bs + positions % bs

        decodes = sorted((i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1), key=seq_lens.__getitem__)
        meta.plan["decode"] = []
        for group in self.decode_groups(decodes, seq_lens):
            index = torch.tensor(group, device=device)
            lengths = meta.seq_lens[index].long()
            positions = torch.arange(seq_lens[group[-1]], device=device)  # sorted: the last is the longest
            blocks = tables[index].gather(1, (positions // bs).clamp(max=tables.shape[1] - 1).expand(len(group), -1))
            valid = positions[None, :] < lengths[:, None]
            slots = torch.where(valid, blocks * bs + positions % bs, 0)  # padding reads slot 0, masked
            meta.plan["decode"].append(
                (
                    meta.query_start_loc[index].long(),
                    slots,
                    valid,  # (sequences, keys): padded keys hidden
                    (positions[None, :], lengths[:, None]),  # for sliding windows
                )
            )
        meta.plan["prefill"] = [
            (i, starts[i], starts[i + 1] - starts[i], key_slots(i, seq_lens[i]))
            for i in range(len(seq_lens))
            if starts[i + 1] - starts[i] > 1
        ]

    def decode_groups(self, decodes: list[int], seq_lens: list[int]) -> list[list[int]]:
        """Decode sequences, shortest first, cut into groups whose padded context fits the budget (a longer one
        is a group of its own)."""
        groups: list[list[int]] = []
        for i in decodes:
            if groups and (
                self.decode_group_tokens is None or (len(groups[-1]) + 1) * seq_lens[i] <= self.decode_group_tokens
            ):
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    def decode(self, queries, slots, valid, gather, scale: float) -> torch.Tensor:
        """One query per sequence (queries (Hkv, B, G, D), grouped by the KV head they read): two batched matmuls
        per KV head over keys gathered head-major, so the query heads of a KV head read it in place (SDPA's GQA
        path copies it per query head). Context longer than the group budget (one long sequence) goes a chunk of
        keys at a time, the chunks' softmaxes joined by their maxima (online softmax), so no copy outgrows it."""
        chunk = self.decode_group_tokens or slots.shape[1]
        total = weight = top = None
        for start in range(0, slots.shape[1], chunk):
            keys, values = gather(slots[:, start : start + chunk], by_head=True)  # (Hkv, B, keys, D)
            hidden = ~valid[None, :, None, start : start + chunk]
            scores = (queries @ keys.transpose(-1, -2)).mul_(scale).masked_fill_(hidden, -torch.inf)
            if chunk >= slots.shape[1]:
                return scores.softmax(-1) @ values
            peak = scores.amax(-1, keepdim=True).clamp_(min=torch.finfo(scores.dtype).min)  # all-hidden rows
            probs = (scores - peak).exp_()
            part, part_weight = probs @ values, probs.sum(-1, keepdim=True)
            if total is None:
                total, weight, top = part, part_weight, peak
                continue
            new_top = torch.maximum(top, peak)
            old_scale, part_scale = (top - new_top).exp_(), (peak - new_top).exp_()
            total = total * old_scale + part * part_scale
            weight = weight * old_scale + part_weight * part_scale
            top = new_top
        return total / weight

    def prefill_mask(
        self, length: int, context: int, window: int | None, spans: list[tuple[int, int]], device
    ) -> torch.Tensor | None:
        """(length, context) bool mask of a chunk's queries (the last `length` of `context` positions): causal,
        within the window, and both ways inside bidirectional spans. None: plain causal (SDPA's own path)."""
        if window is None and not spans:
            return None if context == length else self.causal_over_prefix(length, context, device)
        queries = torch.arange(context - length, context, device=device)[:, None]
        keys = torch.arange(context, device=device)[None, :]
        allowed = keys <= queries
        if window is not None:
            allowed &= keys > queries - window
        for first, end in spans:
            allowed |= (queries >= first) & (queries < end) & (keys >= first) & (keys < end)
        return allowed

    def forward(self, q, k, v, kv_cache, meta, scale, window=None, kv_scales=None):
        write_kv(k, v, kv_cache, meta.slot_mapping, kv_scales)
        _, num_blocks, block_size, heads, dim = kv_cache.shape
        flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
        dtype = torch.float32 if self.fp32_softmax else q.dtype
        gqa = q.shape[1] != k.shape[1]
        out = torch.empty_like(q)
        fp8 = kv_cache.dtype == torch.float8_e4m3fn

        def gather(slots, by_head: bool = False):  # keys and values at the slots, (B, Lk, H, D) or (H, B, Lk, D)
            # whole slots (heads x dim in a row) by index_select, then reordered head-major in one copy: 2.5-3x
            # faster on the CPU than indexing the head-major view or indexing with the 2-D slots directly
            rows = (cache.index_select(0, slots.reshape(-1)).view(*slots.shape, heads, dim) for cache in flat)
            keys, values = ((r.permute(2, 0, 1, 3).contiguous() if by_head else r).to(dtype) for r in rows)
            if fp8:
                keys, values = keys * kv_scales[0].to(dtype), values * kv_scales[1].to(dtype)
            return keys, values

        def attend(queries, keys, values, mask=None, causal=False):  # queries (B, Lq, Hq, D), keys (B, Lk, H, D)
            result = F.scaled_dot_product_attention(
                queries.to(dtype).transpose(1, 2),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=gqa,
            )
            return result.transpose(1, 2).to(q.dtype)

        for rows, slots, valid, (positions, lengths) in meta.plan["decode"]:
            if window is not None:
                valid = valid & (positions >= lengths - window)
            queries = q[rows].to(dtype).view(len(rows), heads, -1, dim).transpose(0, 1)  # (Hkv, B, G, D)
            result = self.decode(queries, slots, valid, gather, scale)
            out[rows] = result.transpose(0, 1).reshape(len(rows), -1, dim).to(q.dtype)
        for index, start, length, slots in meta.plan["prefill"]:
            context = slots.numel()
            mask = self.prefill_mask(length, context, window, meta.bidirectional_spans.get(index, []), q.device)
            if context == length and kv_cache.dtype == k.dtype:  # a prompt in one piece: its keys and values are
                keys, values = (x[start : start + length][None].to(dtype) for x in (k, v))  # the step's, not read back
            else:
                keys, values = gather(slots[None])
            out[start : start + length] = attend(q[start : start + length][None], keys, values, mask, mask is None)[0]
        return out
