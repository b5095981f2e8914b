"""Rotary position embeddings where each frequency reads its angle from one of several position axes.

Qwen2.5-VL uses two flavours of the same idea:
- M-RoPE in the language model: 3 axes (t, h, w); the head_dim/2 frequencies are split by `mrope_section`
  into consecutive chunks, chunk i rotating with axis i's position. Qwen3-VL interleaves them instead:
  frequency i reads h when i % 3 == 1 and i < 3 * section[1], w when i % 3 == 2 and i < 3 * section[2], else t.
- 2-D rotary in the vision tower: 2 axes (h, w); head_dim/4 frequencies for h, the same head_dim/4 for w.
Both rotate with the "rotate half" convention: dims [0, D/2) pair with [D/2, D). The language model's frequencies
may be scaled for longer contexts (RopeScaling: linear, YaRN, Llama 3's).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fovea.config.model import RopeScaling


class AxisRotaryEmbedding(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, axis_of_freq: list[int], attention_factor: float = 1.0):
        super().__init__()
        assert len(axis_of_freq) == inv_freq.numel()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.register_buffer("axis_of_freq", torch.tensor(axis_of_freq, dtype=torch.long), persistent=False)
        self.attention_factor = attention_factor  # YaRN's: on cos and sin, so on every attention score (squared)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (num_axes, N) integers -> cos, sin of shape (N, head_dim), fp32."""
        angles = positions.t()[:, self.axis_of_freq].float() * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        if self.attention_factor == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def scaled_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and the factor on cos and sin, by transformers' formulas for each kind."""
    powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    inv_freq, factor, original = 1.0 / powers, scaling.factor, scaling.original_max_position_embeddings
    if scaling.kind == "linear":
        return inv_freq / factor, 1.0
    if scaling.kind == "llama3":  # wavelengths over original / low_freq_factor divided by factor, those under
        # original / high_freq_factor kept, those between interpolated
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        between = ~(wavelength < original / high) * ~(wavelength > original / low)
        return torch.where(between, smoothed, scaled), 1.0
    if scaling.kind != "yarn":
        return inv_freq, 1.0

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.mscale, scaling.mscale_all_dim
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        attention_factor = mscale(m) / mscale(m_all) if m and m_all else mscale()

    def index(rotations: float) -> float:  # of the frequency that turns `rotations` times in the original length
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    # frequencies that turn more than beta_fast times kept, fewer than beta_slow times divided by factor, ramped
    low, high = index(scaling.beta_fast), index(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return 1.0 / (factor * powers) * ramp + inv_freq * (1 - ramp), float(attention_factor)


def mrope(
    head_dim: int,
    theta: float,
    mrope_section: tuple[int, int, int],
    interleaved: bool = False,
    scaling: RopeScaling = RopeScaling(),
) -> AxisRotaryEmbedding:
    inv_freq, attention_factor = scaled_frequencies(head_dim, theta, scaling)
    if interleaved:
        axes = [
            next((axis for axis in (1, 2) if i % 3 == axis and i < 3 * mrope_section[axis]), 0)
            for i in range(head_dim // 2)
        ]
    else:
        axes = [axis for axis, n in enumerate(mrope_section) for _ in range(n)]
    return AxisRotaryEmbedding(inv_freq, axes, attention_factor)


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
