"""The attention-backend interface the engine calls, and its pure-PyTorch reference implementation.

Each language-model layer owns a paged KV cache of shape (2, num_blocks, block_size, kv_heads, head_dim): keys
and values of every token live in fixed-size blocks, listed per sequence in a block table. One step's batch is
flat: the new tokens of every scheduled sequence concatenated (prefill chunks and single decode tokens alike).
A backend writes the new tokens' K/V into their slots, then lets each query attend to its sequence's whole
context: the cached prefix, earlier chunks and the causal part of its own chunk.

`TorchAttention` gathers each sequence's context into a padded batch and runs SDPA with a mask: slow, but
simple enough to be the ground truth the GPU kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PagedAttentionMetadata:
    backend: "AttentionBackend"
    slot_mapping: torch.Tensor  # (num_tokens,) int64: flat slot (block * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32: where each sequence's new tokens start
    seq_lens: torch.Tensor  # (num_seqs,) int32: context length after this step, new tokens included
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32, padded with 0
    max_query_len: int
    max_seq_len: int
    block_size: int
    plan: dict = field(default_factory=dict)  # what a backend precomputes once per step for all layers


class AttentionBackend:
    """What the model's attention layers call. Implementations: TorchAttention here, Triton ones on GPUs."""

    def prepare(self, meta: PagedAttentionMetadata) -> None:
        """Per-step work shared by all layers (index tensors, kernel plans); called once before the forward."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
        """q: (N, Hq, D), k/v: (N, Hkv, D) for the N new tokens. Stores k/v, returns (N, Hq, D)."""
        raise NotImplementedError


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


class TorchAttention(AttentionBackend):
    def __init__(self, fp32_softmax: bool = False):
        self.fp32_softmax = fp32_softmax  # scores and softmax in fp32 for bf16/fp16 models

    def prepare(self, meta: PagedAttentionMetadata) -> None:
        device = meta.slot_mapping.device
        num_seqs = meta.seq_lens.numel()
        q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
        seq_lens = meta.seq_lens.long()
        key_pos = torch.arange(meta.max_seq_len, device=device)
        # flat cache slot of every context position of every sequence (padding points at slot 0, masked)
        blocks = meta.block_tables.long().gather(1, (key_pos // meta.block_size).expand(num_seqs, -1)
                                                 .clamp(max=meta.block_tables.shape[1] - 1))
        slots = blocks * meta.block_size + key_pos % meta.block_size
        valid = key_pos[None, :] < seq_lens[:, None]
        meta.plan["key_slots"] = torch.where(valid, slots, 0)
        # query i of a sequence sits at context position seq_len - q_len + i and sees keys up to there
        query_pos = torch.arange(meta.max_query_len, device=device)
        last_visible = (seq_lens - q_lens)[:, None] + query_pos[None, :]  # (B, max_q)
        mask = valid[:, None, :] & (key_pos[None, None, :] <= last_visible[:, :, None])
        meta.plan["mask"] = mask[:, None]  # (B, 1, max_q, max_k)
        if meta.max_query_len > 1:
            seq_idx = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)
            meta.plan["seq_idx"] = seq_idx
            meta.plan["pos_idx"] = torch.arange(seq_idx.numel(), device=device) - meta.query_start_loc[:-1].long()[seq_idx]

    def forward(self, q, k, v, kv_cache, meta, scale):
        write_kv(k, v, kv_cache, meta.slot_mapping)
        _, num_blocks, block_size, heads, dim = kv_cache.shape
        flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
        slots = meta.plan["key_slots"]
        dtype = torch.float32 if self.fp32_softmax else q.dtype
        keys, values = flat[0][slots].to(dtype), flat[1][slots].to(dtype)  # (B, max_k, Hkv, D)
        num_seqs = slots.shape[0]
        if meta.max_query_len == 1:
            queries = q[:, None].to(dtype)  # pure decode: one query per sequence, already in order
        else:
            queries = q.new_zeros(num_seqs, meta.max_query_len, *q.shape[1:], dtype=dtype)
            queries[meta.plan["seq_idx"], meta.plan["pos_idx"]] = q.to(dtype)
        out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=meta.plan["mask"], scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        out = out.transpose(1, 2).to(q.dtype)
        if meta.max_query_len == 1:
            return out[:, 0]
        return out[meta.plan["seq_idx"], meta.plan["pos_idx"]]
