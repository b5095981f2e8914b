"""The decoder-only language model every family here ends in: Qwen2, Qwen3 and Llama are the same network
(pre-norm RMSNorm, grouped-query attention with rotary positions, SwiGLU MLP) apart from biases on q/k/v (Qwen2)
and an RMSNorm over each head of q and k before rotary (Qwen3); Qwen3-MoE layers have experts for an MLP
(layers/moe.py). GPT-OSS's too, with biases, and a learned sink logit per attention head.

It runs on a flattened varlen batch: all sequences' tokens in one dimension, `positions` of shape (3, num_tokens)
and the step's attention metadata. Three position axes serve both rules: M-RoPE reads t/h/w from them by
`mrope_section`; 1-D RoPE is the section (head_dim/2, 0, 0), every frequency reading the first axis.
"""

from __future__ import annotations

import torch
from torch import nn

from fovea.attention.backend import PagedAttentionMetadata
from fovea.attention.layer import Attention, AttentionMetadata
from fovea.config.model import TextConfig
from fovea.config.quant import layer_quant
from fovea.layers.basic import GatedActivation, RMSNorm, VocabParallelEmbedding, activation
from fovea.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from fovea.layers.moe import SparseMoE
from fovea.layers.rotary import mrope, rotate_qkv
from fovea.models.base import ModelOptions


class GatedMLP(nn.Module):
    """SwiGLU MLP, or another activation's gate (Gemma's GeGLU; Qwen2.5-VL's vision blocks use it with biases, the
    language models mostly without). `quant`: what the gate|up and the down projections are built with (a decoder
    layer's, as the checkpoint quantized them)."""

    def __init__(
        self, hidden: int, intermediate: int, bias: bool, fused: bool = False, quant=(None, None), act: str = "silu"
    ):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias=bias, quant=quant[0])
        self.act = GatedActivation(act, fused)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, quant=quant[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class FeedForward(nn.Module):
    """fc1 -> activation -> fc2, with biases: the MLP of CLIP's and Qwen2-VL's vision layers."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, intermediate, bias=True)
        self.act = activation(act)
        self.fc2 = RowParallelLinear(intermediate, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def mlp_quant(cfg: TextConfig, layer_index: int) -> tuple:
    """What a decoder layer's gate|up and down projections are built with (GatedMLP's `quant`)."""
    return (
        layer_quant(cfg.quant, layer_index, ("mlp.gate_proj", "mlp.up_proj")),
        layer_quant(cfg.quant, layer_index, ("mlp.down_proj",)),
    )


def attention_projections(
    cfg: TextConfig, layer_index: int, output_bias: bool
) -> tuple[QKVParallelLinear, RowParallelLinear]:
    """A decoder layer's q|k|v and o projections, split over the ranks, quantized where the checkpoint says."""
    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    heads, dim = cfg.num_heads, cfg.head_dim
    qkv_proj = QKVParallelLinear(cfg.hidden_size, dim, heads, cfg.num_kv_heads, bias=cfg.attention_bias,
                                 quant=layer_quant(cfg.quant, layer_index, qkv))  # fmt: skip
    o_proj = RowParallelLinear(heads * dim, cfg.hidden_size, bias=output_bias,
                               quant=layer_quant(cfg.quant, layer_index, ("self_attn.o_proj",)))  # fmt: skip
    return qkv_proj, o_proj


class DecoderAttention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_index: int, options: ModelOptions):
        super().__init__()
        self.head_dim, self.fused = cfg.head_dim, options.fused_kernels
        self.qkv_proj, self.o_proj = attention_projections(cfg, layer_index, cfg.output_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        window = cfg.sliding_window if layer_index in cfg.sliding_layers else None
        sink_heads = self.num_heads if cfg.attention_sinks else 0
        self.attn = Attention(
            cfg.head_dim, True, layer_index, options.fp32_softmax, sliding_window=window, sink_heads=sink_heads
        )
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata | PagedAttentionMetadata
    ):
        qkv = self.qkv_proj(x)
        if self.qk_norm:  # per head, before rotary; written back so that the rotary kernel finds them in place
            q_end, k_end = self.num_heads * self.head_dim, (self.num_heads + self.num_kv_heads) * self.head_dim
            for part, norm in ((qkv[:, :q_end], self.q_norm), (qkv[:, q_end:k_end], self.k_norm)):
                part.copy_(norm(part.reshape(-1, self.head_dim)).view_as(part))
        q, k, v = rotate_qkv(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, self.fused)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.reshape(x.shape[0], -1))


class DecoderLayer(nn.Module):
    """Pre-norm block. It hands on the residual stream and its own output separately, so that the next norm adds
    them (one kernel with `fused_kernels`): x, residual -> x + residual for the next layer's norm to take."""

    def __init__(self, cfg: TextConfig, layer_index: int, options: ModelOptions):
        super().__init__()
        fused = options.fused_kernels
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)
        self.self_attn = DecoderAttention(cfg, layer_index, options)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)
        if cfg.moe is not None and layer_index in cfg.moe.sparse_layers:
            quant = layer_quant(cfg.quant, layer_index, ("mlp.experts",))
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, cfg.hidden_act, quant)
        else:
            quant = mlp_quant(cfg, layer_index)
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, fused, quant, cfg.hidden_act)

    def forward(self, x, residual, cos, sin, meta):
        """residual None: x is the embeddings (the first layer)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos, sin, meta), residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: TextConfig, options: ModelOptions):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = mrope(cfg.head_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, options) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, options.fused_kernels)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        meta,
        deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`deepstack` (Qwen3-VL): (a mask of the image-token rows, (K, rows, hidden) features) added to those rows
        of the first K layers' outputs."""
        cos, sin = self.rotary.cos_sin(positions)
        x, residual = inputs_embeds, None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, meta)
            if deepstack is not None and i < deepstack[1].shape[0]:
                x[deepstack[0]] += deepstack[1][i].to(x.dtype)  # x is this layer's fresh MLP output
        return self.norm(x, residual)[0]
