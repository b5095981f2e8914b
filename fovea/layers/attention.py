"""Attention over a flattened variable-length batch (pure PyTorch reference).

All sequences' tokens are concatenated into one (num_tokens, heads, head_dim) tensor; `cu_seqlens` marks where
each sequence starts. The vision tower uses the same function for its windows (non-causal) and the language model
for its prompts (causal). The engine's KV-cache backends plug in behind `AttentionMetadata` in a later step;
this reference stays as the ground truth they are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    cu_seqlens: torch.Tensor  # (num_seqs + 1,) int32 offsets into the flat token dimension
    max_seqlen: int
    tiles: torch.Tensor | None = None  # work table of our Triton kernel (fovea/kernels/varlen_attention.py)

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device | str = "cpu") -> "AttentionMetadata":
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        return cls(cu.to(device), max(lengths))


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, causal: bool, scale: float, fp32: bool = False) -> torch.Tensor:
    """q: (N, Hq, D), k/v: (N, Hkv, D) with Hq a multiple of Hkv (GQA). Returns (N, Hq, D).
    fp32: scores, softmax and weighted sum in fp32 whatever the inputs' dtype (--fp32-softmax*)."""
    if fp32 and q.dtype != torch.float32:
        return varlen_attention(q.float(), k.float(), v.float(), cu_seqlens, max_seqlen, causal, scale).to(q.dtype)
    num_seqs = cu_seqlens.numel() - 1
    gqa = q.shape[1] != k.shape[1]
    if num_seqs == 1:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=causal, scale=scale, enable_gqa=gqa)
        return out.transpose(0, 1)
    # Scatter the ragged sequences into a zero-padded (num_seqs, max_len) batch, run one SDPA with a mask that
    # hides padding keys (and the future when causal), gather the real rows back.
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq_idx = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), lengths)
    pos_idx = torch.arange(q.shape[0], device=q.device) - cu_seqlens[:-1].long()[seq_idx]

    def pad(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(num_seqs, max_seqlen, *x.shape[1:])
        out[seq_idx, pos_idx] = x
        return out.transpose(1, 2)  # (B, H, L, D)

    key_pos = torch.arange(max_seqlen, device=q.device)
    mask = key_pos[None, :] < lengths[:, None]  # (B, L) valid keys
    mask = mask[:, None, None, :]
    if causal:
        mask = mask & (key_pos[None, :] <= key_pos[:, None])[None, None]
    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)[seq_idx, pos_idx]
