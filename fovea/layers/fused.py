"""The decoder's small element-wise stages as single Triton kernels (CUDA): RMSNorm with the residual add before
it, SiLU-and-mul, and rotary embedding of q and k in place.

Unfused, a decoder layer launches ~40 kernels besides its matmuls and attention (each RMSNorm is eight: upcast,
square, mean, add, rsqrt, multiply, downcast, weight; each rotary seven, twice), every one reading and writing its
tensor. At decode batch sizes those launches, not bytes, set the time: ~2.4 ms of a 10.6 ms 7B step on an H100.
Here a layer has four, each reading its inputs once.

Each kernel rounds where the PyTorch ops it replaces round (the residual sum and the normalized value to the
model's dtype before the weight; silu's output before the product), so a fused model gives the unfused one's
values up to the order of a sum (fp32, over the hidden size). The PyTorch versions in basic.py and rotary.py stay
the reference: CPU runs use them, and tests compare these kernels with them under Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    x_stride,
    residual_stride,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < N
    x = tl.load(x_ptr + row * x_stride + cols, mask=keep, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=keep, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * N + cols, x, mask=keep)
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    normed = (x * rstd).to(sum_ptr.dtype.element_ty).to(tl.float32)  # sum_ptr is x without a residual
    weight = tl.load(weight_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=keep)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s) * weight, s) for s = x + residual (or x) over the last dimension (unit stride)."""
    shape, hidden = x.shape, x.shape[-1]
    x = x.reshape(-1, hidden)
    residual = None if residual is None else residual.reshape(-1, hidden)
    n = x.shape[0]
    total = (
        x
        if residual is None
        else torch.empty((n, hidden), dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    )
    out = torch.empty((n, hidden), dtype=torch.promote_types(weight.dtype, total.dtype), device=x.device)
    if n:
        block = triton.next_power_of_2(hidden)
        _rms_norm[(n,)](
            x,
            x if residual is None else residual,
            weight,
            out,
            total,
            x.stride(0),
            0 if residual is None else residual.stride(0),
            eps,
            N=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=min(max(block // 512, 1), 8),
        )
    return out.view(shape), total.view(shape)


@triton.jit
def _silu_and_mul(x_ptr, out_ptr, x_stride, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < N
    gate = tl.load(x_ptr + row * x_stride + cols, mask=keep, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + N + cols, mask=keep, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (act * up).to(out_ptr.dtype.element_ty), mask=keep)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] of shape (N, 2 * width)."""
    n, width = x.shape[0], x.shape[1] // 2
    out = torch.empty((n, width), dtype=x.dtype, device=x.device)
    if n:
        block = min(triton.next_power_of_2(width), 1024)
        _silu_and_mul[(n, triton.cdiv(width, block))](x, out, x.stride(0), N=width, BLOCK=block)
    return out


@triton.jit
def _rotary(
    x_ptr,
    cos_ptr,
    sin_ptr,
    x_stride,
    cos_stride,
    heads,
    HALF: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HALF_P2: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, HEADS_P2)[:, None]
    dim = tl.arange(0, HALF_P2)[None, :]
    keep = (head < heads) & (dim < HALF)
    first = x_ptr + token * x_stride + head * (2 * HALF) + dim
    x1 = tl.load(first, mask=keep, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=keep, other=0.0).to(tl.float32)
    angles = token * cos_stride + dim
    cos1, cos2 = tl.load(cos_ptr + angles, mask=dim < HALF), tl.load(cos_ptr + angles + HALF, mask=dim < HALF)
    sin1, sin2 = tl.load(sin_ptr + angles, mask=dim < HALF), tl.load(sin_ptr + angles + HALF, mask=dim < HALF)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
    tl.store(first, (x1 * cos1 - x2 * sin1).to(x_ptr.dtype.element_ty), mask=keep)
    tl.store(first + HALF, (x2 * cos2 + x1 * sin2).to(x_ptr.dtype.element_ty), mask=keep)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotates the first `heads` heads of each row of x (N, row >= heads * head_dim; heads back to back, as q then
    k lie in a fused qkv output) in place; cos/sin: (N, head_dim) fp32."""
    n = x.shape[0]
    if n:
        half = head_dim // 2
        _rotary[(n,)](
            x,
            cos,
            sin,
            x.stride(0),
            cos.stride(0),
            heads,
            HALF=half,
            HEADS_P2=triton.next_power_of_2(heads),
            HALF_P2=triton.next_power_of_2(half),
        )
