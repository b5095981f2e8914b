"""How a linear layer stores its weight and multiplies by it: in the model's dtype, or quantized as the checkpoint
says (fovea/config/quant.py). A scheme makes the layer's parameters, each tagged with how it splits over
tensor-parallel ranks (linear.py's loaders read the tags), and applies the layer to activations.

Tags on each parameter: `output_dim` / `input_dim` (None: not split that way) and `units` (output features,
input features) that one element covers: 1 for a plain weight, the block for fp8 block scales, 8 output features
for AWQ's packed int32s, group_size input features for its scales and zero points. `per_tensor` marks a scale
kept per output row that checkpoints store once per tensor (it is spread over that tensor's rows on loading, so
that fused q|k|v or gate|up keep each piece's own).

Every scheme's reference is "dequantize, then a matmul in the activations' dtype" (w8a8 schemes quantize each
token's activations first): exact for the weights, and what transformers runs for these checkpoints on a CPU.
On a GPU, weight-only layers run quantized_kernels.py's matmul (tiles dequantized in registers) and w8a8 ones
PyTorch's int8 / fp8 matmuls; both are checked on the CPU (Triton's interpreter, PyTorch's CPU kernels), their
speed is for the GPU issue to measure.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fovea.config.quant import QuantConfig

AWQ_PACK = 8  # int4 values per int32
# AutoAWQ's GEMM packing: nibble i of an int32 (bits 4i..4i+3) holds output feature AWQ_ORDER[i] of its 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def tagged(data: torch.Tensor, output_dim=None, input_dim=None, units=(1, 1), per_tensor=False) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    param.output_dim, param.input_dim, param.units, param.per_tensor = output_dim, input_dim, units, per_tensor
    return param


def blocks(size: int, unit: int) -> int:
    return -(-size // unit)


class Unquantized:
    def parameters(self, in_features: int, out_features: int) -> dict[str, nn.Parameter]:
        return {"weight": tagged(torch.empty(out_features, in_features), 0, 1)}

    def weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        return layer.weight

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight(layer, x.dtype), bias)


class ScaledInt8OrFp8(Unquantized):
    """int8 or float8_e4m3fn weights (output, input) with float32 scales per block, output row or tensor; with
    `activations` (w8a8), each token's activations are quantized too, as the format's own tooling
    (compressed-tensors) computes them: scale = the token's largest |x| over half the type's range (127.5 for
    int8, 448 for fp8), values clamped, then rounded (int8) or cast (fp8). w8a8 layers with a scale per row
    multiply the quantized values themselves (torch._int_mm, torch._scaled_mm: int32 or fp32 sums, then both
    scales), on the CPU as on a GPU; block scales take the reference."""

    def __init__(self, quant: QuantConfig):
        self.dtype = torch.float8_e4m3fn if quant.method == "fp8" else torch.int8
        self.block, self.per_tensor, self.scale_name = quant.block, quant.per_tensor, quant.scale_name
        self.activations = quant.activations

    def apply(self, layer, x, bias):
        if self.activations is None:
            return weight_only(self, layer, x, bias)
        values, scale = quantize_per_token(x.reshape(-1, x.shape[-1]), self.activations)
        if self.block is not None or not quantized_matmul_fits(values, layer.weight):
            return F.linear((values.to(torch.float32) * scale).to(x.dtype), self.weight(layer, x.dtype), bias)
        weight_scale = getattr(layer, self.scale_name).view(1, -1)
        if self.dtype == torch.int8:
            out = torch._int_mm(values, layer.weight.t()).to(torch.float32) * scale * weight_scale
        else:
            out_dtype = torch.bfloat16 if x.is_cuda else torch.float32  # CUDA's row-wise scaling writes bf16 only
            out = torch._scaled_mm(values, layer.weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=out_dtype)
        out = out.to(x.dtype).reshape(*x.shape[:-1], -1)
        return out + bias if bias is not None else out

    def parameters(self, in_features, out_features):
        weight = tagged(torch.empty(out_features, in_features, dtype=self.dtype), 0, 1)
        if self.block is not None:
            rows, cols = self.block
            shape = (blocks(out_features, rows), blocks(in_features, cols))
            scale = tagged(torch.empty(shape, dtype=torch.float32), 0, 1, units=self.block)
        else:
            scale = tagged(torch.empty(out_features, 1, dtype=torch.float32), 0, per_tensor=self.per_tensor)
        return {"weight": weight, self.scale_name: scale}

    def weight(self, layer, dtype):
        weight, scale = layer.weight, getattr(layer, self.scale_name)
        if self.block is not None:
            rows, cols = self.block
            scale = scale.repeat_interleave(rows, 0)[: weight.shape[0]].repeat_interleave(cols, 1)[:, : weight.shape[1]]
        return (weight.to(torch.float32) * scale).to(dtype)


class AWQ(Unquantized):
    """4-bit weights in AutoAWQ's GEMM layout: qweight (input, output / 8) int32, qzeros (input / group,
    output / 8) int32, scales (input / group, output) in the model's dtype."""

    def __init__(self, quant: QuantConfig):
        self.group = quant.group_size

    def parameters(self, in_features, out_features):
        if out_features % AWQ_PACK or in_features % self.group:
            raise ValueError(
                f"an AWQ layer of {in_features} x {out_features} features (this rank's) needs outputs in eights and "
                f"inputs in whole groups of {self.group}"
            )
        groups, packed = in_features // self.group, out_features // AWQ_PACK
        return {
            "qweight": tagged(torch.empty(in_features, packed, dtype=torch.int32), 1, 0, units=(AWQ_PACK, 1)),
            "qzeros": tagged(torch.empty(groups, packed, dtype=torch.int32), 1, 0, units=(AWQ_PACK, self.group)),
            "scales": tagged(torch.empty(groups, out_features), 1, 0, units=(1, self.group)),
        }

    def apply(self, layer, x, bias):
        return weight_only(self, layer, x, bias)

    def weight(self, layer, dtype):
        values = unpack_awq(layer.qweight).to(torch.float32)  # (input, output)
        zeros = unpack_awq(layer.qzeros).to(torch.float32).repeat_interleave(self.group, 0)
        scales = layer.scales.to(torch.float32).repeat_interleave(self.group, 0)
        return ((values - zeros) * scales).t().to(dtype)


def weight_only(scheme: Unquantized, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A layer whose activations stay as they are: on a GPU, our matmul that dequantizes tile by tile
    (quantized_kernels.py); elsewhere the reference."""
    if not x.is_cuda:
        return F.linear(x, scheme.weight(layer, x.dtype), bias)
    from fovea.layers.quantized_kernels import dequant_matmul  # imports triton

    out = dequant_matmul(x, layer, scheme)
    return out + bias if bias is not None else out


def quantize_per_token(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scale): each row of x as int8 or float8 e4m3 values and its float32 scale (rows, 1)."""
    if kind == "int8":
        low, high, dtype = -128.0, 127.0, torch.int8
    else:
        dtype = torch.float8_e4m3fn
        high = torch.finfo(dtype).max
        low = -high
    rows = x.float()
    scale = rows.abs().amax(dim=-1, keepdim=True) / ((high - low) / 2)
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    scaled = (rows / scale).clamp(low, high)
    return (scaled.round() if kind == "int8" else scaled).to(dtype), scale


def quantized_matmul_fits(values: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether PyTorch multiplies these int8 / fp8 matrices on their device: anything on the CPU; on CUDA, inner
    and output sizes in 16s, and for int8 more than 16 rows (smaller steps take the reference)."""
    if not values.is_cuda:
        return True
    rows, inner, outputs = values.shape[0], values.shape[1], weight.shape[0]
    return inner % 16 == 0 and outputs % 16 == 0 and (values.dtype != torch.int8 or rows > 16)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """(rows, columns) int32 -> (rows, 8 x columns) int values 0..15, output features in order."""
    shifts = torch.tensor([4 * AWQ_ORDER.index(j) for j in range(AWQ_PACK)], dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


def weight_scheme(quant: QuantConfig | None) -> Unquantized:
    if quant is None:
        return Unquantized()
    return AWQ(quant) if quant.method == "awq" else ScaledInt8OrFp8(quant)
