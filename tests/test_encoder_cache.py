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


def test_reset_forgets_only_what_no_sequence_needs():
    """vLLM's reset_mm_cache: entries no running sequence holds are forgotten; the held one stays usable."""
    cache = EncoderCache(capacity_tokens=12)
    for key, seq in (("held", 1), ("done", 2), ("orphan", None)):
        cache.reserve(key, 4)
        if seq is not None:
            cache.acquire(key, seq)
        cache.put(key, torch.zeros(4, 2))
    cache.release("done", 2)
    cache.reset()
    assert (cache.contains("held"), cache.contains("done"), cache.contains("orphan")) == (True, False, False)
    assert cache.ready("held") and cache.used == 4 and cache.can_reserve(8)


def test_an_entry_encoded_for_a_sequence_that_was_not_scheduled_is_evictable():
    # the scheduler reserves an image, then finds no KV blocks for its sequence: the image is still encoded in
    # that step, with no sequence holding it; it must not pin cache space forever
    cache = EncoderCache(capacity_tokens=6)
    cache.reserve("orphan", 5)
    cache.put("orphan", torch.zeros(5, 2))
    assert cache.can_reserve(6)
    cache.reserve("next", 6)
    assert not cache.contains("orphan")


def test_images_encoded_together_are_cached_each_in_its_own_memory(tiny_dirs):
    """The tower runs a step's images as one batch and splits its output by image. A cached entry that kept a
    slice would keep the whole batch's output alive: the cache would hold many times what its capacity counts."""
    from conftest import random_image

    from fovea import LLM, SamplingParams

    with LLM(str(tiny_dirs["tiny-3b"]), dtype="float32") as llm:
        conversations = [
            [{"role": "user", "content": [{"type": "image_pil", "image_pil": random_image(56 + 28 * i, 84, seed=i)}]}]
            for i in range(6)
        ]
        model, batches = llm.engine.runner.model, []
        split = model.split_by_item
        model.split_by_item = lambda merged, grids: batches.append(len(grids)) or split(merged, grids)
        llm.chat(conversations, SamplingParams(max_tokens=1), use_tqdm=False)
        assert max(batches) > 1, batches  # the case in question happened
        entries = list(llm.engine.encoder_cache.embeddings.values())
    assert len(entries) == 6
    # each holds its own rows alone: evicting it frees them, whatever else was encoded beside it
    assert [entry.untyped_storage().nbytes() for entry in entries] == [entry.nbytes for entry in entries]
