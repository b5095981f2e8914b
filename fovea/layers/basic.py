"""Small building blocks shared by the language model and the vision tower."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fovea.layers.linear import TP_RANK, TP_SIZE, divide


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 whatever the model dtype; the weight multiplies after casting back (as Qwen2 does).
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SiluAndMul(nn.Module):
    """SwiGLU gate on a fused gate|up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split across tensor-parallel ranks."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.rows = divide(vocab_size, TP_SIZE)
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if TP_SIZE > 1:
            loaded = loaded.narrow(0, TP_RANK * self.rows, self.rows)
        if param.shape != loaded.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)}, model expects {tuple(param.shape)}")
        param.data.copy_(loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; shares its weight with the embedding when the checkpoint ties them."""

    def forward(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return F.linear(hidden_states, self.weight)
        return torch.mm(hidden_states, self.weight.t(), out=out)
