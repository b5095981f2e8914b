"""Attention. Every model calls one entry point, `Attention` (layer.py). The language model's paged KV cache goes
through the engine's backend, which the runner picks by name from `BACKENDS`:

- `torch`: the pure-PyTorch reference (backend.py): every feature, any device; the ground truth in tests;
- `triton`: our kernels (triton_paged.py, triton_paged_kernels.py), the default on CUDA.

Each backend declares what it can do. A feature a model's layers need but the chosen backend lacks fails at
start-up, naming both, rather than computing something else:
- `sliding_window`: a layer sees only its last W keys (`forward(..., window=W)`);
- `bidirectional_spans`: tokens inside a span (a prompt's image) also see the later tokens of that span, as
  Gemma 3's image tokens do (`PagedAttentionMetadata.bidirectional_spans`);
- `cuda_graphs`: its decode step can be captured in a CUDA graph;
- `fp8_kv_cache`: it keeps keys and values in float8 e4m3, each layer's k and v scaled (--kv-cache-dtype fp8);
- `attention_sinks`: a learned logit per query head joins each softmax's denominator (GPT-OSS's `sinks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fovea.attention.backend import DECODE_GROUP_TOKENS, AttentionBackend, TorchAttention, decode_group_tokens


@dataclass(frozen=True)
class BackendSpec:
    # (query heads per KV head, fp32 softmax, device, KV heads x head size or None)
    build: Callable[[int, bool, torch.device, int | None], AttentionBackend]
    sliding_window: bool
    bidirectional_spans: bool
    cuda_graphs: bool
    fp8_kv_cache: bool
    attention_sinks: bool


def _triton(heads_per_kv_head: int, fp32_softmax: bool, device: torch.device, kv_width: int | None) -> AttentionBackend:
    from fovea.attention.triton_paged import TritonAttention  # imports triton

    return TritonAttention(group=heads_per_kv_head)  # its scores and softmax are fp32 always


BACKENDS = {  # the reference sizes its tensors from each batch, so it cannot be captured
    "torch": BackendSpec(
        lambda group, fp32, device, kv_width: TorchAttention(
            fp32, device, decode_group_tokens(kv_width) if kv_width else DECODE_GROUP_TOKENS
        ),
        sliding_window=True,
        bidirectional_spans=True,
        cuda_graphs=False,
        fp8_kv_cache=True,
        attention_sinks=True,
    ),
    "triton": BackendSpec(
        _triton,
        sliding_window=True,
        bidirectional_spans=True,
        cuda_graphs=True,
        fp8_kv_cache=True,
        attention_sinks=True,
    ),
}


def features_needed(model: torch.nn.Module) -> tuple[str, ...]:
    """The backend features a model's paged attention layers use (models set them when they build a layer)."""
    from fovea.attention.layer import Attention

    layers = [m for m in model.modules() if isinstance(m, Attention) and m.layer_index is not None]
    needs = ("sliding_window",) if any(layer.sliding_window is not None for layer in layers) else ()
    needs += ("attention_sinks",) if any(layer.sinks is not None for layer in layers) else ()
    two_way = getattr(getattr(model, "config", None), "bidirectional_images", False)  # (a model's ModelConfig)
    return needs + (("bidirectional_spans",) if two_way else ())


def make_backend(
    name: str,
    heads_per_kv_head: int,
    fp32_softmax: bool,
    device: torch.device,
    needs: tuple[str, ...] = (),
    kv_width: int | None = None,
) -> AttentionBackend:
    """The backend `name`; `needs`: the features (BackendSpec's flags) the model's layers use; `kv_width`: the
    KV heads x head size of a layer's cache on this rank (the reference sizes its decode groups by it)."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {', '.join(BACKENDS)}")
    spec = BACKENDS[name]
    missing = [feature for feature in needs if not getattr(spec, feature)]
    if missing:
        raise ValueError(
            f"the model needs {', '.join(missing)} attention, which the {name} backend does not "
            f"have; backends that do: {[n for n, s in BACKENDS.items() if all(getattr(s, f) for f in needs)]} "
            "(--attention-backend)"
        )
    return spec.build(heads_per_kv_head, fp32_softmax, device, kv_width)
