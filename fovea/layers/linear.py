"""Linear layers shaped for tensor parallelism.

Each class knows which slice of a full checkpoint tensor its rank owns. Only world size 1 exists today, so every
rank owns everything, but the weight loaders already go through the shard arithmetic: adding TP later means
setting `tp_rank`/`tp_size` and an all-reduce after row-parallel layers, not rewriting the models.
Fused projections (q|k|v and gate|up) are loaded piece by piece from the separate tensors of the checkpoint.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TP_RANK, TP_SIZE = 0, 1


def divide(n: int, d: int) -> int:
    if n % d:
        raise ValueError(f"{n} is not divisible by tensor-parallel size {d}")
    return n // d


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @staticmethod
    def _copy(param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"shape mismatch for {name or 'parameter'}: checkpoint {tuple(loaded.shape)}, "
                             f"model expects {tuple(param.shape)}")
        param.data.copy_(loaded)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self._copy(param, loaded)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole layer (small layers such as the vision merger)."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, divide(out_features, TP_SIZE), bias)

    def weight_loader(self, param, loaded, shard_id=None):
        size = param.shape[0]
        self._copy(param, loaded.narrow(0, TP_RANK * size, size) if TP_SIZE > 1 else loaded)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; needs an all-reduce of the output when TP_SIZE > 1."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(divide(in_features, TP_SIZE), out_features, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.ndim == 2 and TP_SIZE > 1:
            size = param.shape[1]
            loaded = loaded.narrow(1, TP_RANK * size, size)
        self._copy(param, loaded)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate|up); shard_id is the index of the piece."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param, loaded, shard_id=None):
        local = [s // TP_SIZE for s in self.output_sizes]
        offset = sum(local[:shard_id])
        piece = loaded.narrow(0, TP_RANK * local[shard_id], local[shard_id]) if TP_SIZE > 1 else loaded
        self._copy(param.narrow(0, offset, local[shard_id]), piece)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; shard_id is "q", "k" or "v". KV heads are split across ranks like q heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = True):
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, TP_SIZE)
        self.num_kv_heads = divide(num_kv_heads, TP_SIZE)
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id is None:  # the checkpoint stores q|k|v already fused (the vision tower does)
            full_q, full_kv = q_size * TP_SIZE, kv_size * TP_SIZE
            if loaded.shape[0] != full_q + 2 * full_kv:
                raise ValueError(f"fused qkv has {loaded.shape[0]} rows, model expects {full_q + 2 * full_kv}")
            for sid, piece in zip("qkv", loaded.split([full_q, full_kv, full_kv])):
                self.weight_loader(param, piece, sid)
            return
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        piece = loaded.narrow(0, TP_RANK * size, size) if TP_SIZE > 1 else loaded
        self._copy(param.narrow(0, offset, size), piece)
