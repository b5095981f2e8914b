"""Linear layers for tensor parallelism.

Each layer takes its tensor-parallel group when it is built (`fovea.distributed.tensor_parallel`) and knows which
slice of a full checkpoint tensor its rank owns. Column-parallel layers split their outputs (no communication);
row-parallel ones split their inputs and all-reduce their outputs. Fused projections (q|k|v and gate|up) are
loaded piece by piece from the separate tensors of the checkpoint. With one rank all of this is a plain linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fovea.distributed import current_tp


def divide(n: int, d: int, what: str = "") -> int:
    if n % d:
        raise ValueError(f"{what or n} ({n}) is not divisible by the tensor-parallel size {d}")
    return n // d


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.tp = current_tp()
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
            raise ValueError(
                f"shape mismatch for {name or 'parameter'}: checkpoint {tuple(loaded.shape)}, "
                f"model expects {tuple(param.shape)}"
            )
        param.data.copy_(loaded)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self._copy(param, loaded)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, divide(out_features, current_tp().size, "output features"), bias)

    def weight_loader(self, param, loaded, shard_id=None):
        size = param.shape[0]
        self._copy(param, loaded.narrow(0, self.tp.rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs are summed over the ranks, then the bias added."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(divide(in_features, current_tp().size, "input features"), out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.communicates:
            return F.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out + self.bias if self.bias is not None else out

    def weight_loader(self, param, loaded, shard_id=None):
        if param.ndim == 2:
            size = param.shape[1]
            loaded = loaded.narrow(1, self.tp.rank * size, size)
        self._copy(param, loaded)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate|up); shard_id is the index of the piece."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param, loaded, shard_id=None):
        local = [s // self.tp.size for s in self.output_sizes]
        offset = sum(local[:shard_id])
        piece = loaded.narrow(0, self.tp.rank * local[shard_id], local[shard_id])
        self._copy(param.narrow(0, offset, local[shard_id]), piece)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; shard_id is "q", "k" or "v". Query heads are split across ranks; KV heads
    too, or, when there are fewer KV heads than ranks, each rank holds the one its query heads read (vLLM does
    the same)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = True):
        tp = current_tp()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp.size, "attention heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads, self.kv_rank = divide(num_kv_heads, tp.size, "KV heads"), tp.rank
        else:
            replicas = divide(tp.size, num_kv_heads, "the tensor-parallel size over the KV heads")
            self.num_kv_heads, self.kv_rank = 1, tp.rank // replicas
        local = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, local * tp.size, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id is None:  # the checkpoint stores q|k|v already fused (the vision tower does)
            full_q = q_size * self.tp.size
            full_kv = (loaded.shape[0] - full_q) // 2
            if full_kv < 1 or loaded.shape[0] != full_q + 2 * full_kv:
                raise ValueError(f"fused qkv has {loaded.shape[0]} rows, model expects q {full_q} + 2 x kv")
            for sid, piece in zip("qkv", loaded.split([full_q, full_kv, full_kv])):
                self.weight_loader(param, piece, sid)
            return
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        rank = self.tp.rank if shard_id == "q" else self.kv_rank
        self._copy(param.narrow(0, offset, size), loaded.narrow(0, rank * size, size))
