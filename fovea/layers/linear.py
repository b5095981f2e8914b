"""Linear layers for tensor parallelism, in the model's dtype or quantized.

Each layer takes its tensor-parallel group when it is built (`fovea.distributed.tensor_parallel`) and knows which
slice of a full checkpoint tensor its rank owns. Column-parallel layers split their outputs (no communication);
row-parallel ones split their inputs and all-reduce their outputs. Fused projections (q|k|v and gate|up) are
loaded piece by piece from the separate tensors of the checkpoint. With one rank all of this is a plain linear.

How the weight is stored and applied is the layer's scheme (quantized.py), built with it from the model's
QuantConfig (None: the model's dtype). Every parameter is tagged with the dimensions its output and input features
run along and how many features one element covers, so the loaders below slice weights, scales and packed
integers alike.
"""

from __future__ import annotations

import torch
from torch import nn

from fovea.config.quant import QuantConfig
from fovea.distributed import current_tp
from fovea.layers.lora import active as active_lora
from fovea.layers.lora import add_lora
from fovea.layers.quantized import tagged, weight_scheme


def divide(n: int, d: int, what: str = "") -> int:
    if n % d:
        raise ValueError(f"{what or n} ({n}) is not divisible by the tensor-parallel size {d}")
    return n // d


def features(tensor: torch.Tensor, dim: int, unit: int, start: int, size: int) -> torch.Tensor:
    """The elements of `tensor` along `dim` that hold features [start, start + size), `unit` features each."""
    if start % unit:
        raise ValueError(f"features from {start} do not start a quantization block of {unit}")
    return tensor.narrow(dim, start // unit, -(-size // unit))


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, quant: QuantConfig | None = None):
        super().__init__()
        self.tp = current_tp()
        self.input_size, self.output_size = in_features, out_features  # this rank's
        self.scheme = weight_scheme(quant)
        for name, param in self.scheme.parameters(in_features, out_features).items():
            param.weight_loader = self.weight_loader
            self.register_parameter(name, param)
        if bias:
            self.bias = tagged(torch.empty(out_features), output_dim=0)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.scheme.apply(self, x, self.bias)
        return out if active_lora.groups is None else add_lora(self, x, out)

    def output_piece(self, shard_id=None) -> tuple[int, int, int]:
        """Where piece `shard_id` of the layer's outputs is: (offset in this rank's outputs, size here, start of
        this rank's share in the checkpoint piece's outputs). One piece, whole, but in column-parallel layers."""
        return 0, self.output_size, 0

    def input_share(self) -> tuple[int, int] | None:
        """(start, size) of this rank's input features in the full ones; None: all of them."""
        return None

    @staticmethod
    def _copy(param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        if param.shape != loaded.shape:
            raise ValueError(
                f"shape mismatch for {name or 'parameter'}: checkpoint {tuple(loaded.shape)}, "
                f"model expects {tuple(param.shape)}"
            )
        param.data.copy_(loaded)

    def _inputs(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's input features of a checkpoint tensor (all of them, but in row-parallel layers)."""
        return loaded

    def _load_outputs(self, param, loaded: torch.Tensor, start: int, size: int, source_start: int) -> None:
        """The layer's output features [start, start + size) from the checkpoint tensor's, from source_start."""
        target = features(param.data, param.output_dim, param.units[0], start, size)
        if param.per_tensor and loaded.numel() == 1:  # one scale for the whole checkpoint tensor: all its rows
            target.fill_(loaded.item())
            return
        source = features(loaded, param.output_dim, param.units[0], source_start, size)
        self._copy(target, self._inputs(param, source))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self._copy(param, self._inputs(param, loaded))


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant: QuantConfig | None = None):
        self.out_features = divide(out_features, current_tp().size, "output features")
        super().__init__(in_features, self.out_features, bias, quant)

    def output_piece(self, shard_id=None):
        return 0, self.out_features, self.tp.rank * self.out_features

    def weight_loader(self, param, loaded, shard_id=None):
        self._load_outputs(param, loaded, *self.output_piece(shard_id))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs are summed over the ranks, then the bias added."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant: QuantConfig | None = None):
        self.in_features = divide(in_features, current_tp().size, "input features")
        super().__init__(self.in_features, out_features, bias, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.communicates:
            return super().forward(x)
        # an adapter's part is a partial sum over this rank's inputs too: added before the reduction
        out = self.tp.all_reduce(add_lora(self, x, self.scheme.apply(self, x, None)))
        return out + self.bias if self.bias is not None else out

    def input_share(self) -> tuple[int, int]:
        return self.tp.rank * self.in_features, self.in_features

    def _inputs(self, param, loaded):
        if param.input_dim is None:
            return loaded
        return features(loaded, param.input_dim, param.units[1], *self.input_share())

    def weight_loader(self, param, loaded, shard_id=None):
        if param.per_tensor and loaded.numel() == 1:
            param.data.fill_(loaded.item())
            return
        self._copy(param, self._inputs(param, loaded))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate|up); shard_id is the index of the piece."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, quant: QuantConfig | None = None):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, quant)

    def output_piece(self, shard_id=None):
        if shard_id is None:
            return super().output_piece()
        local = [s // self.tp.size for s in self.output_sizes]
        return sum(local[:shard_id]), local[shard_id], self.tp.rank * local[shard_id]


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; shard_id is "q", "k" or "v". Query heads are split across ranks; KV heads
    too, or, when there are fewer KV heads than ranks, each rank holds the one its query heads read (vLLM does
    the same)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = True,
        quant: QuantConfig | None = None,
    ):
        tp = current_tp()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp.size, "attention heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads, self.kv_rank = divide(num_kv_heads, tp.size, "KV heads"), tp.rank
        else:
            replicas = divide(tp.size, num_kv_heads, "the tensor-parallel size over the KV heads")
            self.num_kv_heads, self.kv_rank = 1, tp.rank // replicas
        local = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, local * tp.size, bias, quant)

    def split_fused(self, loaded: torch.Tensor) -> dict[str, torch.Tensor]:
        """q, k and v of a tensor whose rows hold all three (the vision tower's checkpoints store qkv fused)."""
        full_q = self.num_heads * self.head_dim * self.tp.size
        full_kv = (loaded.shape[0] - full_q) // 2
        if full_kv < 1 or loaded.shape[0] != full_q + 2 * full_kv:
            raise ValueError(f"fused qkv has {loaded.shape[0]} rows, model expects q {full_q} + 2 x kv")
        return dict(zip("qkv", loaded.split([full_q, full_kv, full_kv])))

    def output_piece(self, shard_id=None):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        return offset, size, (self.tp.rank if shard_id == "q" else self.kv_rank) * size

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:
            for sid, piece in self.split_fused(loaded).items():
                self.weight_loader(param, piece, sid)
            return
        self._load_outputs(param, loaded, *self.output_piece(shard_id))
