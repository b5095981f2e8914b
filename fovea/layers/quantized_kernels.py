"""A matmul over weights stored quantized, dequantized tile by tile in registers (Triton): what weight-only layers
(fp8 with block, row or tensor scales; AWQ int4) run on a GPU instead of dequantizing the whole weight every step.
Decode steps are bound by reading the weights, and these read one byte (fp8) or half a byte (int4) per value.

y = x @ w.T, with w[n, k] = q[n, k] x scale[n // SCALE_ROWS, k // SCALE_COLS] (fp8; a scale per row has
SCALE_COLS = K), or w[n, k] = (q - zero) x scale at group k // GROUP (AWQ, q and zero unpacked from AutoAWQ's
int32s). Accumulates in fp32, multiplies in the activations' dtype (fp32 under the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dequant_matmul(
    x_ptr,
    w_ptr,
    scale_ptr,
    zero_ptr,
    out_ptr,
    M,
    N,
    K,
    x_stride,
    w_stride_n,
    w_stride_k,
    scale_stride_n,
    scale_stride_k,
    zero_stride,
    out_stride,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    GROUP: tl.constexpr,
    AWQ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_K):
        inner = start + tl.arange(0, BLOCK_K)
        inner_ok = inner < K
        x = tl.load(
            x_ptr + rows[:, None] * x_stride + inner[None, :], mask=row_ok[:, None] & inner_ok[None, :], other=0.0
        )
        ok = inner_ok[:, None] & col_ok[None, :]  # the (K, N) tile of w.T
        if AWQ:  # qweight (K, N / 8): output n in nibble AWQ_ORDER.index(n % 8) of word n // 8
            nibble = (cols % 8) // 2 + (cols % 2) * 4
            words = tl.load(w_ptr + inner[:, None] * w_stride_k + (cols // 8)[None, :], mask=ok, other=0)
            values = ((words >> (nibble * 4)[None, :]) & 0xF).to(tl.float32)
            group = inner // GROUP
            zero_words = tl.load(zero_ptr + group[:, None] * zero_stride + (cols // 8)[None, :], mask=ok, other=0)
            zeros = ((zero_words >> (nibble * 4)[None, :]) & 0xF).to(tl.float32)
            scales = tl.load(scale_ptr + group[:, None] * scale_stride_k + cols[None, :], mask=ok, other=0.0)
            w = (values - zeros) * scales.to(tl.float32)
        else:
            q = tl.load(w_ptr + cols[None, :] * w_stride_n + inner[:, None] * w_stride_k, mask=ok, other=0.0)
            scale_at = (cols // SCALE_ROWS)[None, :] * scale_stride_n + (inner // SCALE_COLS)[:, None] * scale_stride_k
            w = q.to(tl.float32) * tl.load(scale_ptr + scale_at, mask=ok, other=0.0)
        acc += tl.dot(x, w.to(x.dtype))
    out_at = out_ptr + rows[:, None] * out_stride + cols[None, :]
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def dequant_matmul(x: torch.Tensor, layer, scheme) -> torch.Tensor:
    """x (..., K) @ the layer's dequantized weight.T, without building that weight; `scheme` is the layer's
    ScaledInt8OrFp8 (fp8, no activation quantization) or AWQ."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows, inner = flat.shape
    awq = hasattr(layer, "qweight")
    if awq:
        weight, scale, zeros = layer.qweight, layer.scales, layer.qzeros
        outputs = scale.shape[1]
        w_strides, scale_strides = (0, weight.stride(0)), (0, scale.stride(0))
        scale_rows, scale_cols, group = 1, 1, scheme.group
    else:
        weight, scale = layer.weight, getattr(layer, scheme.scale_name)
        zeros, outputs, group = scale, weight.shape[0], 1
        w_strides, scale_strides = (weight.stride(0), weight.stride(1)), (scale.stride(0), scale.stride(1))
        scale_rows, scale_cols = scheme.block if scheme.block is not None else (1, inner)
    out = torch.empty(rows, outputs, dtype=x.dtype, device=x.device)
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    grid = (triton.cdiv(rows, block_m), triton.cdiv(outputs, 64))
    _dequant_matmul[grid](
        flat,
        weight,
        scale,
        zeros,
        out,
        rows,
        outputs,
        inner,
        flat.stride(0),
        *w_strides,
        *scale_strides,
        zeros.stride(0),
        out.stride(0),
        SCALE_ROWS=scale_rows,
        SCALE_COLS=scale_cols,
        GROUP=group,
        AWQ=awq,
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_K=64,
    )
    return out.reshape(*x.shape[:-1], outputs)
