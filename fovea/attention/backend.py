"""The attention-backend interface the engine calls, and its pure-PyTorch reference implementation.

Each language-model layer owns a paged KV cache of shape (2, num_blocks, block_size, kv_heads, head_dim): keys
and values of every token live in fixed-size blocks, listed per sequence in a block table. One step's batch is
flat: the new tokens of every scheduled sequence concatenated (prefill chunks and single decode tokens alike).
A backend writes the new tokens' K/V into their slots, then lets each query attend to its sequence's whole
context: the cached prefix, earlier chunks and the causal part of its own chunk.

A layer may be a sliding-window one (`window`) or have a learned sink logit per head (`sinks`, GPT-OSS's), and a
step may name bidirectional spans per sequence (tokens of a prompt's image that see each other both ways); the
registry (fovea/attention/__init__.py) says which backends can.

`TorchAttention` is the reference: decode rows in groups, each group's cache blocks copied into kept buffers and
attended with two matmuls per KV head; each prefill chunk on its own through SDPA, causal (lower-right when a cached
prefix precedes the chunk: PyTorch's bias on a GPU, which its memory-efficient kernels take without a mask; on the
CPU, whose SDPA builds the scores anyway, that one sequence's chunk x context mask), so no (queries x keys) mask is
built for a batch. Slow, but simple enough to be the ground truth the GPU kernels are tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
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
    # query_start_loc on the host, where the step was built there: plans whose grid size depends on it read it
    # here, since reading the device's copy waits for all the work queued before (the last step's forward)
    query_starts_host: np.ndarray | None = None


@dataclass
class DecodeGroup:
    """Decode sequences whose keys and values TorchAttention reads together (prepare's plan, for every layer)."""

    rows: torch.Tensor  # (B,) their query rows in the step's batch
    blocks: torch.Tensor  # (B, n) each one's KV blocks, a shorter one's row padded with block 0
    block_size: int
    chunk: int  # keys read at a time, whole blocks
    hidden: torch.Tensor  # (B, n x block_size) bool: keys past each one's end
    padding: list[torch.Tensor]  # per chunk: its flat (B x chunk) rows of such keys
    positions: torch.Tensor  # (1, n x block_size) key positions, and (B, 1) context lengths: for sliding windows
    lengths: torch.Tensor


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
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: (N, Hq, D), k/v: (N, Hkv, D) for the N new tokens. Stores k/v, returns (N, Hq, D). `window`: a
        sliding-window layer's W (a query sees itself and the W - 1 keys before it); None: all keys.
        `kv_scales`: the layer's k and v scales, for a float8 cache (stored = value / scale). `sinks`: (Hq,) each
        query head's learned sink logit (GPT-OSS), a term of every softmax's denominator that adds no value."""
        raise NotImplementedError


def allowed_keys(length: int, context: int, window: int | None, spans: list[tuple[int, int]], device) -> torch.Tensor:
    """(length, context) bool mask of a chunk's queries (the last `length` of `context` positions): the keys before
    each query and those of its bidirectional span, then only the ones inside its window (Gemma 3's rule:
    window AND (causal OR same image), so a sliding layer's image token does not see the start of a long image)."""
    queries = torch.arange(context - length, context, device=device)[:, None]
    keys = torch.arange(context, device=device)[None, :]
    allowed = keys <= queries
    for first, end in spans:
        allowed |= (queries >= first) & (queries < end) & (keys >= first) & (keys < end)
    if window is not None:
        allowed &= keys > queries - window
    return allowed


def attend(q, k, v, scale: float, mask=None, causal: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA's layout: q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D), Hq a multiple of Hkv. With `sinks` (Hq,) written out:
    scores, a sink column joined to each row's softmax then dropped (a head may so attend to almost nothing), and
    `mask` (Lq, Lk) bool, what each query sees, which then must be given."""
    gqa = q.shape[1] != k.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill_(~mask, -torch.inf)
    sink = sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], -1).softmax(-1)[..., :-1] @ v


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
# CPU's caches, which made the time per context token grow with the batch (issue 37); benchmarks/cpu_attention.py
# measured 2048 keys the best of 2k-8k at 2 KV heads of 64 fp32 (4096 as good since the copies go into kept
# buffers). Narrower keys make more of them fit: the demo model's (2 heads of 16) take 8192 a group (64 prompts x
# 128 in / 64 out took 3.34-3.43 s so, against 3.59-3.80 s in groups of 2048: fewer, larger copies and products).
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
        self._buffers: dict[str, torch.Tensor] = {}  # workspace(): reused across layers and steps
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
            num_blocks = -(-seq_lens[group[-1]] // bs)  # sorted: the last is the longest
            positions = torch.arange(num_blocks * bs, device=device)
            hidden = positions[None, :] >= lengths[:, None]
            chunk = self.decode_chunk(bs) or len(positions)
            meta.plan["decode"].append(
                DecodeGroup(
                    meta.query_start_loc[index].long(),
                    tables[index, :num_blocks],  # a shorter sequence's row padded with block 0
                    bs,
                    chunk,
                    hidden,
                    [hidden[:, i : i + chunk].reshape(-1).nonzero()[:, 0] for i in range(0, len(positions), chunk)],
                    positions[None, :],
                    lengths[:, None],
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

    def decode_chunk(self, block_size: int) -> int | None:
        """Keys a decode reads at a time, in whole blocks (None: all at once)."""
        if self.decode_group_tokens is None:
            return None
        return max(1, self.decode_group_tokens // block_size) * block_size

    def workspace(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """A buffer kept across layers and steps: megabytes of fresh memory are page-faulted in at every call,
        which made a long context's time per key grow with its length on the CPU."""
        size = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype or buffer.device != torch.device(device):
            buffer = self._buffers[name] = torch.empty(size, dtype=dtype, device=device)
        return buffer[:size].view(shape)

    def decode(self, queries, group: DecodeGroup, hidden, gather_blocks, scale: float, sinks=None) -> torch.Tensor:
        """One query per sequence (queries (Hkv, B, G, D), grouped by the KV head they read): per KV head, two
        batched matmuls that read its keys and values in place from the gathered blocks (B, keys, Hkv, D), a
        strided matrix each, so neither is copied head-major and no query head copies its KV head's (as SDPA's
        GQA path does). Context longer than the group budget (one long sequence) goes a chunk of keys at a time,
        the chunks' softmaxes joined by their maxima (online softmax), so no copy outgrows it. `sinks` (Hkv, 1, G,
        1): the sink logits start that softmax as a first chunk of one key whose value is 0."""
        heads, batch, rows, dim = queries.shape
        chunk, per_chunk = group.chunk, group.chunk // group.block_size  # keys, blocks
        total = torch.zeros(heads, batch, rows, dim, dtype=queries.dtype, device=queries.device)
        weight = top = None
        if sinks is not None:
            top = sinks.to(queries.dtype)
            weight = torch.ones_like(top)
        for number, padding in enumerate(group.padding):
            start = number * chunk
            keys, values = gather_blocks(group.blocks[:, number * per_chunk : (number + 1) * per_chunk])
            # past a sequence's end lie other sequences' keys and values (or none yet): their weights are 0, but
            # 0 x inf is nan, so such values are zeroed
            values.view(-1, heads, dim).index_fill_(0, padding, 0)
            scores = self.workspace("scores", (heads, batch, rows, keys.shape[1]), queries.dtype, queries.device)
            for head in range(heads):
                torch.bmm(queries[head], keys[:, :, head].transpose(1, 2), out=scores[head])
            scores.mul_(scale).masked_fill_(hidden[None, :, None, start : start + chunk], -torch.inf)
            if len(group.padding) == 1 and top is None:  # the whole context in one chunk
                probs = scores.softmax(-1)
            else:  # exponentials against the chunk's maximum; what earlier chunks summed rescaled to the larger
                peak = scores.amax(-1, keepdim=True).clamp_(min=torch.finfo(scores.dtype).min)  # all-hidden rows
                probs = scores.sub_(peak).exp_()
                part_weight = probs.sum(-1, keepdim=True)
                if top is None:
                    weight, top = part_weight, peak
                else:
                    new_top = torch.maximum(top, peak)
                    old_scale, part_scale = (top - new_top).exp_(), (peak - new_top).exp_()
                    total.mul_(old_scale)
                    probs.mul_(part_scale)
                    weight = weight * old_scale + part_weight * part_scale
                    top = new_top
            for head in range(heads):
                total[head].baddbmm_(probs[head], values[:, :, head])
        return total if weight is None else total.div_(weight)

    def prefill_mask(
        self, length: int, context: int, window: int | None, spans: list[tuple[int, int]], device
    ) -> torch.Tensor | None:
        """A chunk's mask (`allowed_keys`). None: plain causal (SDPA's own path)."""
        if window is None and not spans:
            return None if context == length else self.causal_over_prefix(length, context, device)
        return allowed_keys(length, context, window, spans, device)

    def forward(self, q, k, v, kv_cache, meta, scale, window=None, kv_scales=None, sinks=None):
        write_kv(k, v, kv_cache, meta.slot_mapping, kv_scales)
        _, num_blocks, block_size, heads, dim = kv_cache.shape
        flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
        dtype = torch.float32 if self.fp32_softmax else q.dtype
        out = torch.empty_like(q)
        fp8 = kv_cache.dtype == torch.float8_e4m3fn

        def readable(keys, values):  # as the attention's dtype; fp8 scaled back
            if keys.dtype != dtype:
                keys, values = keys.to(dtype), values.to(dtype)
            if fp8:
                keys, values = keys * kv_scales[0].to(dtype), values * kv_scales[1].to(dtype)
            return keys, values

        def gather_slots(slots):  # keys and values at the slots (B, Lk), (B, Lk, H, D)
            # whole slots (heads x dim in a row) by index_select: 2.5-3x faster on the CPU than indexing with
            # the 2-D slots
            return readable(
                *(cache.index_select(0, slots.reshape(-1)).view(*slots.shape, heads, dim) for cache in flat)
            )

        def gather_blocks(blocks):  # the keys and values of blocks (B, n), (B, n x block_size, H, D), kept buffers
            # whole blocks, so the plan holds a block table's columns, not every key's slot
            shape = (blocks.shape[0], blocks.shape[1] * block_size, heads, dim)
            return readable(
                *(
                    torch.index_select(
                        cache,
                        0,
                        blocks.reshape(-1),
                        out=self.workspace(name, (blocks.numel(), *cache.shape[1:]), cache.dtype, cache.device),
                    ).view(shape)
                    for name, cache in zip(("keys", "values"), kv_cache)
                )
            )

        def attend_chunk(queries, keys, values, mask=None):  # queries (B, Lq, Hq, D), keys (B, Lk, H, D)
            result = attend(
                *(x.transpose(1, 2) for x in (queries.to(dtype), keys, values)), scale, mask, mask is None, sinks
            )
            return result.transpose(1, 2).to(q.dtype)

        group_sinks = None if sinks is None else sinks.view(heads, 1, -1, 1)  # (Hkv, 1, G, 1) as decode's queries

        for group in meta.plan["decode"]:
            hidden = group.hidden if window is None else group.hidden | (group.positions < group.lengths - window)
            queries = q[group.rows].to(dtype).view(len(group.rows), heads, -1, dim).transpose(0, 1)  # (Hkv, B, G, D)
            result = self.decode(queries, group, hidden, gather_blocks, scale, group_sinks)
            out[group.rows] = result.transpose(0, 1).reshape(len(group.rows), -1, dim).to(q.dtype)
        for index, start, length, slots in meta.plan["prefill"]:
            context = slots.numel()
            spans = meta.bidirectional_spans.get(index, [])
            if sinks is None:
                mask = self.prefill_mask(length, context, window, spans, q.device)
            else:  # written out, with every mask explicit
                mask = allowed_keys(length, context, window, spans, q.device)
            if context == length and kv_cache.dtype == k.dtype:  # a prompt in one piece: its keys and values are
                keys, values = (x[start : start + length][None].to(dtype) for x in (k, v))  # the step's, not read back
            else:
                keys, values = gather_slots(slots[None])
            out[start : start + length] = attend_chunk(q[start : start + length][None], keys, values, mask)[0]
        return out
