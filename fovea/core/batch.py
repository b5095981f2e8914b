"""One engine step as the scheduler decides it and the model runner runs it."""

from __future__ import annotations

from dataclasses import dataclass, field

from fovea.core.request import MMItem, Sequence


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # of each sequence, this step
    encode: list[MMItem] = field(default_factory=list)  # images to hand to the encoder (ImageEncoder)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) KV blocks, forks' partial blocks

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)
