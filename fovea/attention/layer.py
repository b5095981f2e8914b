"""The one attention entry point of every model (`Attention`), and attention over a flattened variable-length
batch (pure PyTorch reference).

`Attention` takes q, k, v and the step's metadata and picks the path from it: the language model's paged KV cache
through the engine's backend (PagedAttentionMetadata), or a whole flat batch without a cache (AttentionMetadata:
the vision towers' images and windows, and whole prompts in reference checks), on our Triton kernel when the
metadata carries its tile table.

All sequences' tokens are concatenated into one (num_tokens, heads, head_dim) tensor; `cu_seqlens` marks where
each sequence starts. The vision tower uses the same function for its windows (non-causal) and the language model
for its prompts (causal). Sequences of equal length are stacked and run through one SDPA call without a mask
(causal ones with is_causal), so PyTorch can pick its memory-efficient kernels on every device: a dense mask
over a 12-megapixel image's 60,000 patches would take tens of GB.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fovea.attention.backend import PagedAttentionMetadata, allowed_keys, attend
from fovea.distributed import current_tp


@dataclass
class AttentionMetadata:
    cu_seqlens: torch.Tensor  # (num_seqs + 1,) int32 offsets into the flat token dimension
    max_seqlen: int
    tiles: torch.Tensor | None = None  # work table of our Triton kernel (fovea/attention/triton_varlen.py)
    lengths: tuple[int, ...] | None = None  # the same lengths on the host, when known (saves a device read)
    # sequence index -> (first, end) positions whose tokens also see each other's later tokens (Gemma 3's images)
    bidirectional_spans: dict[int, list[tuple[int, int]]] | None = None

    @classmethod
    def from_lengths(
        cls, lengths: list[int], device: torch.device | str = "cpu", bidirectional_spans: dict | None = None
    ) -> AttentionMetadata:
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        return cls(cu.to(device), max(lengths), lengths=tuple(lengths), bidirectional_spans=bidirectional_spans)

    def to(self, device: torch.device) -> AttentionMetadata:
        return AttentionMetadata(
            self.cu_seqlens.to(device),
            self.max_seqlen,
            None if self.tiles is None else self.tiles.to(device),
            self.lengths,
            self.bidirectional_spans,
        )


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    scale: float,
    fp32: bool = False,
    lengths: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """q: (N, Hq, D), k/v: (N, Hkv, D) with Hq a multiple of Hkv (GQA). Returns (N, Hq, D).
    fp32: scores, softmax and weighted sum in fp32 whatever the inputs' dtype (--fp32-softmax*)."""
    if fp32 and q.dtype != torch.float32:
        return varlen_attention(
            q.float(), k.float(), v.float(), cu_seqlens, max_seqlen, causal, scale, lengths=lengths
        ).to(q.dtype)
    if lengths is None:
        lengths = tuple((cu_seqlens[1:] - cu_seqlens[:-1]).tolist())
    gqa = q.shape[1] != k.shape[1]
    starts_by_length: dict[int, list[int]] = {}
    start = 0
    for length in lengths:
        if length:
            starts_by_length.setdefault(length, []).append(start)
        start += length
    out = torch.empty_like(q)
    for length, starts in starts_by_length.items():
        if starts[-1] - starts[0] == (len(starts) - 1) * length:  # back to back (a tower's windows and frames
            rows = slice(starts[0], starts[0] + len(starts) * length)  # mostly are): views, no gather
        else:
            rows = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)).flatten()
        group = [x[rows].view(len(starts), length, *x.shape[1:]).transpose(1, 2) for x in (q, k, v)]
        result = F.scaled_dot_product_attention(*group, is_causal=causal, scale=scale, enable_gqa=gqa)
        out[rows] = result.transpose(1, 2).reshape(-1, *q.shape[1:])
    return out


def masked_attention(
    q, k, v, meta: AttentionMetadata, window: int | None, scale: float, fp32: bool, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Whole causal prompts one at a time under `allowed_keys`' mask: a sliding window, bidirectional spans,
    attention sinks (the uncached path of a language model that has them; reference checks run it)."""
    dtype = torch.float32 if fp32 else q.dtype
    out = torch.empty_like(q)
    bounds = meta.cu_seqlens.tolist()
    for index, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        spans = (meta.bidirectional_spans or {}).get(index, [])
        mask = allowed_keys(end - start, end - start, window, spans, q.device)
        result = attend(*(x[start:end].to(dtype).transpose(0, 1)[None] for x in (q, k, v)), scale, mask, sinks=sinks)
        out[start:end] = result[0].transpose(0, 1).to(q.dtype)
    return out


class Attention(nn.Module):
    """Scaled dot-product attention of one layer. `layer_index` names its KV cache in the engine's list (language
    models); `fp32`: scores and softmax in fp32 on the uncached path (--fp32-softmax, --fp32-softmax-vision; the
    paged backends are configured at their own construction); `sliding_window`: W for a sliding-window layer
    (backends must have the feature, see __init__); `scale`: the scores' factor, 1 / sqrt(head_dim) unless given;
    `sink_heads`: this rank's query heads, for a layer with a learned sink logit per head (GPT-OSS's `sinks`)."""

    def __init__(
        self,
        head_dim: int,
        causal: bool,
        layer_index: int | None = None,
        fp32: bool = False,
        sliding_window: int | None = None,
        scale: float | None = None,
        sink_heads: int = 0,
    ):
        super().__init__()
        self.scale, self.causal, self.layer_index, self.fp32 = scale or head_dim**-0.5, causal, layer_index, fp32
        self.sliding_window = sliding_window
        self.sinks = None
        if sink_heads:
            self.tp = current_tp()
            self.sinks = nn.Parameter(torch.zeros(sink_heads), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
        if layer_index is not None:  # a float8 KV cache's scales: the checkpoint's where it has them, else 1.0
            self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
            self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """This rank's heads' sinks: the ranks split the query heads in order, as the q projection does."""
        heads = param.shape[0]
        if loaded.shape != (heads * self.tp.size,):
            raise ValueError(f"attention sinks of shape {tuple(loaded.shape)}: the layer has {heads} heads a rank")
        param.data.copy_(loaded[self.tp.rank * heads :][:heads])

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata | PagedAttentionMetadata
    ) -> torch.Tensor:
        """q: (N, Hq, D), k/v: (N, Hkv, D) -> (N, Hq, D)."""
        if isinstance(meta, PagedAttentionMetadata):
            cache = meta.kv_caches[self.layer_index]
            return meta.backend.forward(
                q, k, v, cache, meta, self.scale, self.sliding_window, (self.k_scale, self.v_scale), self.sinks
            )
        if self.causal and (self.sliding_window is not None or meta.bidirectional_spans or self.sinks is not None):
            return masked_attention(q, k, v, meta, self.sliding_window, self.scale, self.fp32, self.sinks)
        if meta.tiles is not None:
            from fovea.attention.triton_varlen import varlen_attention_triton

            return varlen_attention_triton(q, k, v, meta.tiles, self.scale, fp32=self.fp32)
        return varlen_attention(
            q,
            k,
            v,
            meta.cu_seqlens,
            meta.max_seqlen,
            causal=self.causal,
            scale=self.scale,
            fp32=self.fp32,
            lengths=meta.lengths,
        )
