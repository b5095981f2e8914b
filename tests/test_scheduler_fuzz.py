"""The scheduler never gets stuck: random prompts with images (shared between prompts, of several sizes), arriving
at random steps, some aborted, under drawn budgets, KV caches down to the longest prompt and a block, encoder
caches of the engine's default size (the largest image and one step's encoder budget), prefix caching, whole
images or chunked, priorities, steps in order or scheduled ahead (the next step scheduled while one is in
flight, as --async-scheduling does). Each step must run a token or hand the encoder an image while any prompt is
left and none is in flight (else the engine fails a request as "cannot be scheduled even with the engine idle"),
and every prompt must end within a bound on the steps (no livelock). The model is the engine's bookkeeping
(LLMEngine._record): a step's sampled token is appended, its images are encoded by the next step.

The cross-talk fuzz (tests/test_crosstalk_fuzz.py) found two such states with LLaVA's 576-token images, each after
hundreds of draws of a whole engine; this one draws a thousand schedules in a few seconds, and finds each of them
(run against the trees before their fixes, e719be1 and c6c77bc) within the first 3,000 of most seeds. The seed is fixed for a run
and printed with every failure (FOVEA_FUZZ_SEED repeats one); FOVEA_FUZZ_DRAWS sets the number of schedules."""

from __future__ import annotations

import os
import random

import torch
from test_scheduler import BLOCK, image, scheduler, sequence

from fovea.engine.sequence import SequenceStatus

SEED = int(os.environ.get("FOVEA_FUZZ_SEED") or random.SystemRandom().randrange(1 << 30))
DRAWS = int(os.environ.get("FOVEA_FUZZ_DRAWS", "1000"))


def draw_prompts(rng: random.Random, image_sizes: list[int]) -> list:
    """(prompt ids, images, max_tokens, arrival step, abort step or None, priority) per prompt."""
    sizes = {key: rng.choice(image_sizes) for key in "abcd"}
    prompts = []
    for _ in range(rng.randint(1, 8)):
        ids, images = [], []
        for _ in range(rng.randint(1, 4)):
            if rng.random() < 0.5:
                key = rng.choice("abcd")
                images.append(image(len(ids), sizes[key], key))
                ids += [9] * sizes[key]
            else:
                ids += [rng.randrange(10, 40) for _ in range(rng.randint(1, 20))]
        abort = rng.randrange(60) if rng.random() < 0.15 else None
        prompts.append((ids, images, rng.randint(1, 6), rng.randrange(30), abort, rng.choice([0, 0, 1, -1])))
    return prompts


def check_schedule(draw: int) -> None:
    rng = random.Random(SEED * 100_003 + draw)
    budget = rng.choice([4, 8, 16, 32, 64])
    whole_images = rng.random() < 0.3
    # an image seen both ways (Gemma 3's) runs in one chunk: the model's one size, which the budget must hold
    # (EngineConfig refuses a smaller one)
    prompts = draw_prompts(rng, [min(budget, rng.choice([4, 8, 12]))] if whole_images else [4, 8, 12, 24])
    longest = max(len(ids) + max_tokens for ids, _, max_tokens, _, _, _ in prompts)
    encoder_budget = rng.choice([budget, budget, 8, 64])
    largest = max((item.span.length for _, images, _, _, _, _ in prompts for item in images), default=0)
    options = dict(
        budget=budget,
        max_seqs=rng.choice([1, 2, 3, 8]),
        blocks=-(-longest // BLOCK) + rng.choice([0, 1, 2, 8]),
        prefix_caching=rng.random() < 0.5,
        encoder_tokens=largest + encoder_budget,
        encoder_budget=encoder_budget,
        whole_images=whole_images,
    )
    ahead = rng.random() < 0.5
    where = f"FOVEA_FUZZ_SEED={SEED} draw {draw}: {options}, ahead {ahead}, prompts {[(len(p[0]), *p[2:]) for p in prompts]}"
    sched = scheduler(**options)
    seqs = [
        (sequence(i, ids, max_tokens=max_tokens, images=images, priority=priority), max_tokens, arrival, abort)
        for i, (ids, images, max_tokens, arrival, abort, priority) in enumerate(prompts)
    ]
    ended: set[int] = set()

    def record(batch, sampling) -> None:
        """LLMEngine._record's bookkeeping: the samples land, a sample that reaches max_tokens finishes."""
        for seq in sampling:
            seq.num_pending -= 1
        sched.step_done(batch)
        for seq in sampling:
            if seq.status != SequenceStatus.FINISHED:  # (aborted while its step ran)
                seq.token_ids.append(7)
                if seq.num_output_tokens >= seqs[seq.seq_id][1]:
                    sched.finish(seq)
                    ended.add(seq.seq_id)

    total = sum(len(ids) + max_tokens for ids, _, max_tokens, _, _, _ in prompts)
    in_flight = None  # (batch, its sampling sequences) scheduled ahead, not yet recorded
    for turn in range(4 * total + 100):
        for seq, _, arrival, abort in seqs:
            if arrival == turn:
                sched.add(seq)
            if abort == turn and arrival <= turn and seq.seq_id not in ended:
                sched.finish(seq)
                ended.add(seq.seq_id)
        left = sched.running or sched.waiting
        batch = sched.schedule()
        progress = batch.seqs or batch.step.encode or in_flight or not left
        assert progress, f"{where}: step {turn} ran nothing and encoded nothing"
        pending = [seq.num_pending for seq in batch.seqs]
        sched.launched(batch)
        sampling = [seq for seq, before in zip(batch.seqs, pending) if seq.num_pending > before]
        if in_flight is not None:
            record(*in_flight)
        in_flight = (batch, sampling) if batch.seqs else None
        if not ahead and in_flight is not None:
            record(*in_flight)
            in_flight = None
        for item in batch.step.encode:
            sched.encoder_cache.put(item.content_hash, torch.zeros(item.span.length, 4))
        if len(ended) == len(seqs):
            return
    raise AssertionError(f"{where}: {len(seqs) - len(ended)} prompt(s) never ended")


def test_every_step_runs_or_encodes_until_every_prompt_ends():
    for draw in range(DRAWS):
        check_schedule(draw)
