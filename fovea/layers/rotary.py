"""Rotary position embeddings where each frequency reads its angle from one of several position axes.

Qwen2.5-VL uses two flavours of the same idea:
- M-RoPE in the language model: 3 axes (t, h, w); the head_dim/2 frequencies are split by `mrope_section`
  into consecutive chunks, chunk i rotating with axis i's position. Qwen3-VL interleaves them instead:
  frequency i reads h when i % 3 == 1 and i < 3 * section[1], w when i % 3 == 2 and i < 3 * section[2], else t.
- 2-D rotary in the vision tower: 2 axes (h, w); head_dim/4 frequencies for h, the same head_dim/4 for w.
Both rotate with the "rotate half" convention: dims [0, D/2) pair with [D/2, D).
"""

from __future__ import annotations

import torch
from torch import nn


class AxisRotaryEmbedding(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, axis_of_freq: list[int]):
        super().__init__()
        assert len(axis_of_freq) == inv_freq.numel()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.register_buffer("axis_of_freq", torch.tensor(axis_of_freq, dtype=torch.long), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (num_axes, N) integers -> cos, sin of shape (N, head_dim), fp32."""
        angles = positions.t()[:, self.axis_of_freq].float() * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()


def mrope(
    head_dim: int, theta: float, mrope_section: tuple[int, int, int], interleaved: bool = False
) -> AxisRotaryEmbedding:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if interleaved:
        axes = [
            next((axis for axis in (1, 2) if i % 3 == axis and i < 3 * mrope_section[axis]), 0)
            for i in range(head_dim // 2)
        ]
    else:
        axes = [axis for axis, n in enumerate(mrope_section) for _ in range(n)]
    return AxisRotaryEmbedding(inv_freq, axes)


def vision_rope(head_dim: int, theta: float = 10000.0) -> AxisRotaryEmbedding:
    quarter = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
    n = inv_freq.numel()
    return AxisRotaryEmbedding(torch.cat((inv_freq, inv_freq)), [0] * n + [1] * n)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (N, heads, head_dim); cos/sin: (N, head_dim). Computed in fp32, returned in x's dtype."""
    dtype = x.dtype
    x = x.float()
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(dtype)


def rotate_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused projection's output [q | k | v] (N, (heads + 2 kv heads) * head_dim) -> q, k rotated and v, as
    (N, heads, head_dim) tensors. `fused`: q and k rotated in place by one Triton kernel (CUDA)."""
    n = qkv.shape[0]
    if fused:
        from fovea.layers.fused import rotary_  # imports triton, which only GPU machines need to have

        rotary_(qkv, cos, sin, num_heads + num_kv_heads, head_dim)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = q.view(n, num_heads, head_dim), k.view(n, num_kv_heads, head_dim), v.view(n, num_kv_heads, head_dim)
    if fused:
        return q, k, v
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v
