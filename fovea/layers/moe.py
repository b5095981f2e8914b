"""A mixture-of-experts MLP (Qwen3-VL-MoE's, and Qwen3-MoE's and GPT-OSS's in InternVL3.5): a router picks each
token's top-k experts, each expert a gated MLP (SwiGLU, unless the config names another activation; GPT-OSS's
clamped, with biases), and the token's output is their outputs weighted by the router's probabilities.

The experts run as two grouped matrix products (torch's grouped_mm: one kernel each for all experts, the group
sizes read on the device), so a layer neither waits for the device nor launches kernels per expert: with 128
experts, the loop it replaces launched ~600 kernels a layer and read the chosen experts back to the host first.
Where torch has no grouped product for the device, dtype or shapes (before torch 2.9 none on the CPU and only
Hopper's on CUDA; on CUDA only bfloat16 is used, its native kernel; rows of a multiple of 16 bytes), and for
quantized experts (each expert's matmul as its scheme runs a linear layer's: on a GPU, weight-only ones dequantize
tile by tile in quantized_kernels.py; a grouped quantized kernel is for the GPU issue), the loop over the chosen
experts runs instead, in expert order as transformers runs it. Tensor parallelism splits every expert as it splits
a dense MLP (each rank holds its share of every expert's width: gate|up by their outputs, down by its inputs) and
the layer sums the ranks' outputs; the router is whole on every rank, so all choose the same experts.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from fovea.config.model import MoEConfig
from fovea.config.quant import QuantConfig
from fovea.distributed import current_tp
from fovea.layers.basic import ClampedSwiGLU, GatedActivation
from fovea.layers.linear import LinearBase, divide, features
from fovea.layers.quantized import weight_scheme

TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])
GROUPED_MM = getattr(torch, "_grouped_mm", None) if TORCH_VERSION >= (2, 9) else None


class Experts(nn.Module):
    """All experts' weights as two stacked tensors: gate|up (E, 2 x inter, hidden) and down (E, hidden, inter),
    `inter` this rank's share of an expert's width. Quantized (`quant`: Qwen's FP8 uploads, compressed-tensors,
    AWQ), each of the two holds every tensor its scheme stores (values and scales, layers/quantized.py), stacked:
    `gate_up_proj` the values, `gate_up_proj_<name>` the others; the loop over the chosen experts runs them.
    GPT-OSS's experts also have biases, `gate_up_proj_bias` (E, 2 x inter) and `down_proj_bias` (E, hidden)."""

    def __init__(self, hidden: int, cfg: MoEConfig, act: str = "silu", quant: QuantConfig | None = None):
        super().__init__()
        self.tp = current_tp()
        self.inter = divide(cfg.intermediate_size, self.tp.size, "an expert's MLP width")
        self.hub_layout, self.scheme, self.interleaved = cfg.hub_layout, weight_scheme(quant), cfg.interleaved
        self.act = ClampedSwiGLU(*cfg.swiglu) if cfg.swiglu else GatedActivation(act)
        self.quantized, self.num_experts, self.biased = quant is not None, cfg.num_experts, cfg.expert_bias
        self.grouped = GROUPED_MM is not None and hidden % 8 == 0 and self.inter % 8 == 0 and not self.quantized
        # as the checkpoint stores them whole (in our orientation): the shape that says a matrix's orientation
        self.whole = {"gate_up_proj": (cfg.num_experts, 2 * cfg.intermediate_size, hidden),
                      "down_proj": (cfg.num_experts, hidden, cfg.intermediate_size)}  # fmt: skip
        self.names: dict[str, dict[str, str]] = {}  # piece -> the scheme's tensor name -> our parameter's
        for piece, (inputs, outputs) in {
            "gate_up_proj": (hidden, 2 * self.inter),
            "down_proj": (self.inter, hidden),
        }.items():
            self.names[piece] = {}
            for key, one in self.scheme.parameters(inputs, outputs).items():
                name = piece if key == "weight" else f"{piece}_{key}"
                param = nn.Parameter(one.data.new_empty(cfg.num_experts, *one.shape), requires_grad=False)
                param.piece, param.weight_loader = piece, self._load
                for tag in ("output_dim", "input_dim", "units", "per_tensor"):  # how one expert's splits (linear.py)
                    setattr(param, tag, getattr(one, tag))
                self.register_parameter(name, param)
                self.names[piece][key] = name
            if self.biased:
                bias = nn.Parameter(torch.zeros(cfg.num_experts, outputs), requires_grad=False)
                bias.piece, bias.weight_loader = piece, self._load_bias
                self.register_parameter(f"{piece}_bias", bias)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """This rank's share of all experts stacked, in either orientation (a non-square matrix's shape says which
        it is; a square one is read as the checkpoint's transformers version wrote it: `hub_layout`), or of one
        expert's tensor (Qwen3-MoE's checkpoints, quantized ones too): `shard_id` (expert, piece), the piece 0 or
        1 of gate|up."""
        down, start = param.piece == "down_proj", self.tp.rank * self.inter
        if shard_id is None:
            if self.quantized:
                raise ValueError("quantized experts stored stacked are not supported (one tensor per expert is)")
            flip = loaded.shape[1:] != self.whole[param.piece][1:]
            flip = flip if loaded.shape[1] != loaded.shape[2] else self.hub_layout
            loaded = loaded.transpose(1, 2) if flip else loaded
            share = loaded[..., start : start + self.inter] if down else self._gate_up_share(loaded)
            LinearBase._copy(param, share, "experts")
            return
        expert, piece = shard_id
        if expert >= self.num_experts:
            raise ValueError(f"expert {expert}: the config has {self.num_experts}")
        target = param.data[expert]
        if param.per_tensor and loaded.numel() == 1:  # one scale for the expert's whole matrix: all its rows
            (target if down else target[piece * self.inter : (piece + 1) * self.inter]).fill_(loaded.item())
            return
        dim = param.input_dim if down else param.output_dim  # how the ranks split it: by inputs (down) or outputs
        unit = param.units[1 if down else 0]
        if dim is not None:
            loaded = features(loaded, dim, unit, start, self.inter)
            target = target if down else features(target, dim, unit, piece * self.inter, self.inter)
        LinearBase._copy(target, loaded, "an expert's tensor")

    def _gate_up_share(self, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's rows of gate and of up, of all experts' gate|up (E, 2 x width, ...): its weights or biases,
        their alternating rows (GPT-OSS's) put in two halves first."""
        if self.interleaved:
            loaded = torch.cat([loaded[:, 0::2], loaded[:, 1::2]], 1)
        width, start = loaded.shape[1] // 2, self.tp.rank * self.inter
        return torch.cat([loaded[:, i * width + start :][:, : self.inter] for i in range(2)], 1)

    def _load_bias(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """All experts' biases (E, outputs), stacked as GPT-OSS stores them: gate|up's split as its weights; down's
        whole on the first rank and zero on the others, since the layer sums the ranks' outputs."""
        if shard_id is not None:
            raise ValueError("expert biases stored one tensor per expert are not supported (stacked ones are)")
        if param.piece == "down_proj":
            share = loaded if self.tp.rank == 0 else torch.zeros_like(loaded)
        else:
            share = self._gate_up_share(loaded)
        LinearBase._copy(param, share, "expert biases")

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: (N, hidden); chosen, weights: (N, top_k) expert ids and their weights."""
        if not self.grouped or (x.device.type != "cpu" and x.dtype != torch.bfloat16):
            return self.per_expert(x, chosen, weights)
        num_tokens, top_k = chosen.shape
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # the (token, slot) pairs, grouped by expert
        experts = torch.arange(self.num_experts, device=flat.device)
        ends = torch.searchsorted(flat[order], experts, right=True).to(torch.int32)  # where each group ends
        gate_up = GROUPED_MM(x[order // top_k], self.gate_up_proj.transpose(1, 2), offs=ends)
        if self.biased:  # each row's expert's
            gate_up = gate_up + self.gate_up_proj_bias[flat[order]]
        grouped = GROUPED_MM(self.act(gate_up), self.down_proj.transpose(1, 2), offs=ends)
        if self.biased:
            grouped = grouped + self.down_proj_bias[flat[order]]
        by_slot = torch.empty_like(grouped).index_copy_(0, order, grouped).view(num_tokens, top_k, -1)
        return (by_slot * weights[..., None]).sum(dim=1).to(x.dtype)  # a sum per token, not atomic adds

    def per_expert(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():
            rows, slot = (chosen == expert).nonzero(as_tuple=True)
            gated = self.act(self._matmul("gate_up_proj", expert, x[rows]))
            y = self._matmul("down_proj", expert, gated) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out

    def _matmul(self, piece: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x times one expert's gate|up or down, as a linear layer of its scheme multiplies (layers/quantized.py:
        on a GPU, weight-only experts through the matmul that dequantizes tile by tile)."""
        return self.scheme.apply(
            self.expert(piece, expert), x, getattr(self, f"{piece}_bias")[expert] if self.biased else None
        )

    def expert(self, piece: str, expert: int) -> SimpleNamespace:
        """One expert's gate|up or down as a linear layer holds it (its values and scales, by the scheme's names)."""
        return SimpleNamespace(**{key: getattr(self, name)[expert] for key, name in self.names[piece].items()})


def expert_pieces(experts: Experts, name: str) -> set:
    """The (expert, piece) slices that make one of the stacked tensors whole (loaded from Qwen3-MoE's layout)."""
    pieces = 2 if name.startswith("gate_up_proj") else 1
    return {(expert, piece) for expert in range(experts.num_experts) for piece in range(pieces)}


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, cfg: MoEConfig, act: str = "silu", quant: QuantConfig | None = None):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.top_k, cfg.norm_topk_prob
        self.gate = LinearBase(hidden, cfg.num_experts, bias=cfg.router_bias)  # the router (never quantized)
        self.experts = Experts(hidden, cfg, act, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        weights, chosen = torch.softmax(logits, dim=-1, dtype=torch.float).topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts.tp.all_reduce(self.experts(x, chosen, weights.to(logits.dtype)))
