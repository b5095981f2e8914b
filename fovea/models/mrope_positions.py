"""M-RoPE positions of a Qwen2.5-VL prompt: three position ids (t, h, w) per token.

Text runs count up by one on all three axes. A vision item's placeholder tokens take their (t, h, w) index in
the merged grid plus the position where the item starts; the next text run starts one past the largest
position used so far. For videos the t index is stretched by `second_per_grid_t * tokens_per_second`, so time
in the position space follows seconds, not frames. After the prompt, token i gets position i + delta on every
axis, delta = (max prompt position + 1) - prompt length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VisionSpan:
    """One image or video in the prompt, in order: its placeholder token and its patch grid (t, h, w)."""

    token_id: int
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float | None = None  # videos only


def mrope_positions(
    token_ids: Sequence[int],
    spans: Sequence[VisionSpan],
    spatial_merge_size: int,
    tokens_per_second: float | None = 2.0,
) -> tuple[np.ndarray, int]:
    """Returns (positions of shape (3, len(token_ids)) int64, decode delta)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    chunks: list[np.ndarray] = []
    next_pos = 0
    cursor = 0

    def add_text(length: int) -> None:
        nonlocal next_pos
        chunks.append(np.broadcast_to(np.arange(next_pos, next_pos + length), (3, length)))
        next_pos += length

    for span in spans:
        hits = np.flatnonzero(ids[cursor:] == span.token_id)
        if hits.size == 0:
            raise ValueError(f"prompt has fewer placeholder tokens (id {span.token_id}) than vision items")
        start = cursor + int(hits[0])
        add_text(start - cursor)
        t, h, w = span.grid_thw
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        count = t * gh * gw
        if start + count > ids.size or not np.all(ids[start : start + count] == span.token_id):
            raise ValueError(
                f"a vision item with grid {span.grid_thw} needs {count} consecutive placeholder "
                f"tokens (id {span.token_id}) at index {start}"
            )
        scaled = span.second_per_grid_t is not None and tokens_per_second is not None  # Qwen2-VL: unscaled
        interval = span.second_per_grid_t * tokens_per_second if scaled else 1.0
        # float32 then truncation, as the reference implementation does it
        t_index = (np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64)
        grid = np.stack(np.meshgrid(t_index, np.arange(gh), np.arange(gw), indexing="ij")).reshape(3, -1)
        chunks.append(grid + next_pos)
        next_pos = int(grid.max()) + next_pos + 1
        cursor = start + count
    add_text(ids.size - cursor)
    positions = np.concatenate(chunks, axis=1) if chunks else np.zeros((3, 0), dtype=np.int64)
    delta = next_pos - ids.size
    return positions.astype(np.int64), delta


def linear_positions(length: int) -> np.ndarray:
    """1-D RoPE's positions (every token one step, images' tokens too) on all three axes the engine carries."""
    return np.broadcast_to(np.arange(length, dtype=np.int64), (3, length)).copy()


def decode_positions(first_index: int, count: int, delta: int) -> np.ndarray:
    """Positions (3, count) of generated tokens at sequence indices first_index .. first_index + count - 1."""
    return np.broadcast_to(np.arange(first_index, first_index + count, dtype=np.int64) + delta, (3, count))
