"""Encoder cache bookkeeping: referenced entries stay, unreferenced ones are evicted oldest first."""

from __future__ import annotations

import torch

from fovea.engine.encoder_cache import EncoderCache


def test_referenced_entries_stay_and_released_ones_are_evicted_lru():
    cache = EncoderCache(capacity_tokens=10)
    for key, seq in (("a", 1), ("b", 2)):
        cache.reserve(key, 4)
        cache.acquire(key, seq)
        cache.put(key, torch.zeros(4, 2))
    assert not cache.can_reserve(4)  # 8 of 10 held by running sequences
    cache.release("a", 1)
    assert cache.can_reserve(4)
    cache.reserve("c", 4)  # evicts a, the only unreferenced entry
    assert not cache.contains("a") and cache.contains("b") and cache.num_references() == 1


def test_an_entry_encoded_for_a_sequence_that_was_not_scheduled_is_evictable():
    # the scheduler reserves an image, then finds no KV blocks for its sequence: the image is still encoded in
    # that step, with no sequence holding it; it must not pin cache space forever
    cache = EncoderCache(capacity_tokens=6)
    cache.reserve("orphan", 5)
    cache.put("orphan", torch.zeros(5, 2))
    assert cache.can_reserve(6)
    cache.reserve("next", 6)
    assert not cache.contains("orphan")
