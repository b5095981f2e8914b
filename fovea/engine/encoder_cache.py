"""Vision-encoder outputs kept between steps, keyed by image content hash.

A long prompt is prefilled in chunks, but an image is encoded whole, once: an entry is reserved when a sequence
first reaches the image and filled when the background encoder is done (`ready`); chunks (and other requests
showing the same picture) read the rows they need from here. Capacity is counted in embedding rows (= placeholder
tokens). Entries a sequence still needs are referenced and never evicted; unreferenced ones stay, least recently
used evicted first, until space is needed.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, capacity_tokens: int):
        self.capacity = capacity_tokens
        self.sizes: dict[str, int] = {}  # every entry, computed or reserved for this step
        self.embeddings: dict[str, torch.Tensor] = {}
        self.refs: dict[str, set[int]] = {}  # content hash -> ids of sequences that still need it
        self.unreferenced: OrderedDict[str, None] = OrderedDict()  # eviction order, oldest first
        self.hits = 0  # items found already encoded
        self.encoded = 0  # items the encoder ran on

    @property
    def used(self) -> int:
        return sum(self.sizes.values())

    def contains(self, key: str) -> bool:
        """Computed, or reserved for the encoder to fill."""
        return key in self.sizes

    def ready(self, key: str) -> bool:
        return key in self.embeddings

    def can_reserve(self, num_tokens: int) -> bool:
        evictable = sum(self.sizes[k] for k in self.unreferenced)
        return self.used + num_tokens - evictable <= self.capacity

    def reserve(self, key: str, num_tokens: int) -> None:
        """Room for an item the encoder will run on this step (the caller checked `can_reserve`)."""
        while self.used + num_tokens > self.capacity:
            victim, _ = self.unreferenced.popitem(last=False)
            del self.sizes[victim]
            self.embeddings.pop(victim, None)
        self.sizes[key] = num_tokens
        self.encoded += 1

    def put(self, key: str, embeddings: torch.Tensor) -> None:
        if key not in self.sizes:
            return  # its reservation was dropped meanwhile (a failure): nobody is waiting for these
        if embeddings.untyped_storage().nbytes() > embeddings.nbytes:
            # one item's rows of a batch's output: kept as they are, they would keep the whole batch alive, and
            # the cache would hold up to a batch's worth more than its capacity says (issue 56)
            embeddings = embeddings.clone()
        self.embeddings[key] = embeddings
        if key not in self.refs:  # reserved for a sequence that did not get scheduled after all: evictable
            self.unreferenced[key] = None

    def drop_unfilled(self, keep: set[str] = frozenset()) -> None:
        """Forgets reservations that will not be filled (a failed step or encoder run; `keep`: those the
        encoder is still working on), so that no later request waits for them."""
        for key in [key for key in self.sizes if key not in self.embeddings and key not in keep]:
            del self.sizes[key]
            self.refs.pop(key, None)
            self.unreferenced.pop(key, None)

    def get(self, key: str) -> torch.Tensor:
        return self.embeddings[key]

    def acquire(self, key: str, seq_id: int) -> None:
        holders = self.refs.setdefault(key, set())
        holders.add(seq_id)
        self.unreferenced.pop(key, None)

    def release(self, key: str, seq_id: int) -> None:
        holders = self.refs.get(key)
        if holders is None or seq_id not in holders:
            return
        holders.discard(seq_id)
        if not holders:
            del self.refs[key]
            if key in self.sizes:
                self.unreferenced[key] = None

    def reset(self) -> None:
        """Forgets the encoder outputs no sequence needs (vLLM's reset_mm_cache): the next request showing those
        images runs the encoder again."""
        for key in self.unreferenced:
            del self.sizes[key]
            self.embeddings.pop(key, None)
        self.unreferenced.clear()

    def num_references(self) -> int:
        return sum(len(h) for h in self.refs.values())
