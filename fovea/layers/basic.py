"""Small building blocks shared by the language model and the vision tower."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fovea.distributed import current_tp


def _kernels():
    from fovea.layers import fused  # imports triton, which only GPU machines need to have

    return fused


class RMSNorm(nn.Module):
    """`fused`: one Triton kernel (fused.py, CUDA) instead of the PyTorch ops below, which stay the reference."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, fused: bool = False):
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`: (norm(x + residual), x + residual), the sum a pre-norm block carries on."""
        if self.fused:
            out, total = _kernels().rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, total)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 whatever the model dtype; the weight multiplies after casting back (as Qwen2 does).
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GatedActivation(nn.Module):
    """act(gate) * up on a fused gate|up projection: SwiGLU with SiLU (`fused`: one Triton kernel, CUDA), GeGLU
    with a GELU."""

    def __init__(self, act: str = "silu", fused: bool = False):
        super().__init__()
        self.fused = fused and act == "silu"
        self.act = F.silu if act == "silu" else activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return _kernels().silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up


class ClampedSwiGLU(nn.Module):
    """GPT-OSS's experts' activation on a gate|up projection: the gate clamped from above and up both ways at
    `limit`, then (up + 1) * gate * sigmoid(alpha * gate)."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split across tensor-parallel ranks: each rank embeds the ids in its range
    (zeros elsewhere) and the ranks sum. The last rank's rows are padded when the vocabulary does not divide."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp = current_tp()
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // self.tp.size)
        self.start = self.tp.rank * self.rows
        self.valid = max(0, min(self.rows, vocab_size - self.start))  # rows of this rank that are real tokens
        self.weight = nn.Parameter(torch.zeros(self.rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(
                f"shape mismatch: checkpoint {tuple(loaded.shape)}, model expects {(self.vocab_size, param.shape[1])}"
            )
        param.data[: self.valid].copy_(loaded.narrow(0, self.start, self.valid))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.communicates:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.valid)
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(x)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary (each rank scores its rows, the pieces are gathered); shares its
    weight with the embedding when the checkpoint ties them."""

    def forward(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.tp.communicates:
            return self.tp.all_gather(F.linear(hidden_states, self.weight))[:, : self.vocab_size]
        return vocab_product(hidden_states, self.weight, out)


# One fp32 BLAS product of a few rows with a whole 150k-token head runs well below the core's speed on the CPU;
# the same product cut into slices of the vocabulary whose weights fill half the core's L2 cache (1 MB here)
# gives the same logits faster (benchmarks/lm_head_cpu.py, one core, medians of 7: 64 x 512 326 -> 226 ms,
# 64 x 64 43 -> 35 ms, 8 x 2048 599 -> 280 ms). One row (memory-bound) is 2-3 % slower cut.
VOCAB_SLICE_BYTES = 1 << 19
VOCAB_SLICE_MIN_ELEMENTS = 4096  # rows x hidden: 8 x 512 gains 1.4x, 8 x 64 nothing


def vocab_product(hidden_states: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """hidden_states @ weight.T (into `out` when given): the logits of an LM head whose rows are `weight`."""
    rows, (vocab, width) = hidden_states.shape[0], weight.shape
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or rows * width < VOCAB_SLICE_MIN_ELEMENTS:
        return F.linear(hidden_states, weight) if out is None else torch.mm(hidden_states, weight.t(), out=out)
    out = hidden_states.new_empty(rows, vocab) if out is None else out
    step = max(256, VOCAB_SLICE_BYTES // (width * weight.element_size()))
    for start in range(0, vocab, step):
        torch.mm(hidden_states, weight[start : start + step].t(), out=out[:, start : start + step])
    return out


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): the GELU approximation CLIP and Qwen2-VL's vision towers were trained with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "quick_gelu": QuickGELU,
    "gelu": nn.GELU,
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU,
}


def activation(name: str) -> nn.Module:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]()
