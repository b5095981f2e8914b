"""LoRA adapters applied beside the base weights: out += (x @ A^T) @ B^T for the rows of the adapter's requests.

An adapter's weights are held per layer (`LoRAWeights.pairs`, keyed by the layer module itself), never merged into
the base weights, so requests for several adapters and for none share one batch. A forward pass says which rows
use which adapter with `lora_rows(...)`; every linear layer adds its part for those rows (`add_lora`). That is a
per-thread setting rather than a forward argument because every linear layer of every model may need it, and
because the vision tower runs in its own thread beside the language model's step.

Fused layers (q|k|v, gate|up) get one pair: the adapter's A matrices stacked, B block-diagonal, so one pair of
matmuls serves all the pieces. Scaling (lora_alpha / r) is folded into B when loaded (fovea/models/lora.py).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
from torch import nn


class _Active(threading.local):
    groups: list | None = None  # this thread's adapters and their rows (lora_rows); None: no adapter is active


active = _Active()  # read by every linear layer's forward before it calls add_lora


@dataclass
class LoRAWeights:
    """One adapter, as this rank holds it: layer -> (A (rank, inputs here), B (outputs here, rank))."""

    name: str
    pairs: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@contextlib.contextmanager
def lora_rows(groups: list[tuple[torch.Tensor | None, LoRAWeights]]):
    """Within it, this thread's forward passes add each adapter to its rows (None: all rows)."""
    previous = active.groups
    active.groups = groups or None
    try:
        yield
    finally:
        active.groups = previous


def add_lora(layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` (the layer's base output for input `x`) plus the active adapters' parts."""
    for rows, adapter in active.groups or ():
        pair = adapter.pairs.get(layer)
        if pair is None:
            continue
        a, b = pair
        if rows is None:
            out = out + (x @ a.t()) @ b.t()
        else:
            out = out.index_add(0, rows, (x[rows] @ a.t()) @ b.t())
    return out
