"""The scheduler never gets stuck: random prompts with images (shared between prompts, of several sizes), arriving at
random steps, some aborted, some with LoRA adapters (under max_loras), some scoring every prompt position
(prompt_logprobs), under drawn budgets, KV caches down to the longest prompt and a block, encoder caches of the engine's
default size (the largest image and one step's encoder budget), prefix caching, whole images or chunked, priorities,
max_model_len reached or not, samples ending on a stop token, steps that fail at their launch (their requests then run
alone, or fail: Scheduler.isolate), encoder runs that fail (so do the requests showing their images), and steps in order
or scheduled ahead (the next step scheduled while one is in flight, as --async-scheduling does). Each step must run a
token or hand the encoder an image while any prompt is left and none is in flight (else the engine fails a request as
"cannot be scheduled even with the engine idle"), hold the token budget, max_num_seqs and max_loras, skip no prompt
position a request scores, keep the KV blocks' books (check_blocks: no block written by two sequences), and every prompt
must end within a bound on the steps (no livelock), leaving no suspect, KV block or image held. The model is the
engine's bookkeeping (LLMEngine._record, _step_failed, _collect_images): a step's sampled token is appended, its images
are encoded by the next step.

The cross-talk fuzz (tests/test_crosstalk_fuzz.py) found two such states with LLaVA's 576-token images, each after
hundreds of draws of a whole engine; this one draws a thousand schedules in a few seconds, and finds each of them
(run against the trees before their fixes, e719be1 and c6c77bc) within the first 3,000 of most seeds; it found a
third fault itself (seed 189: test_block_manager.py's adoption test), and a fourth once it checked max_num_seqs
(test_scheduler.py's forks test). The seed is fixed for a run and printed with every failure (FOVEA_FUZZ_SEED repeats
one); FOVEA_FUZZ_DRAWS sets the number of schedules."""

from __future__ import annotations

import collections
import itertools
import os
import random

import torch
from test_scheduler import BLOCK, image, scheduler, sequence

from fovea.core.request import LoRARequest
from fovea.engine.engine import MAX_FAILED_STEPS
from fovea.engine.sequence import Sequence, SequenceStatus

SEED = int(os.environ.get("FOVEA_FUZZ_SEED") or random.SystemRandom().randrange(1 << 30))
DRAWS = int(os.environ.get("FOVEA_FUZZ_DRAWS", "1000"))


def draw_prompts(rng: random.Random, image_sizes: list[int], adapters: bool) -> list[dict]:
    """Prompts, each with its images, max_tokens, n, arrival step, abort step (or None), priority, LoRA adapter
    (1-3, or None) and prompt_logprobs (or None); prompts start with one of two shared prefixes half the time
    (prefix caching's shared blocks)."""
    sizes = {key: rng.choice(image_sizes) for key in "abcd"}
    prefixes = [[rng.randrange(10, 40) for _ in range(rng.randint(4, 20))] for _ in range(2)]
    prompts = []
    for _ in range(rng.randint(1, 8)):
        ids, images = list(rng.choice(prefixes)) if rng.random() < 0.5 else [], []
        for _ in range(rng.randint(1, 4)):
            if rng.random() < 0.5:
                key = rng.choice("abcd")
                images.append(image(len(ids), sizes[key], key))
                ids += [9] * sizes[key]
            else:
                ids += [rng.randrange(10, 40) for _ in range(rng.randint(1, 20))]
        prompts.append(
            dict(
                ids=ids,
                images=images,
                max_tokens=rng.randint(1, 6),
                n=rng.choice([1, 1, 1, 2, 3]),
                arrival=rng.randrange(30),
                abort=rng.randrange(60) if rng.random() < 0.15 else None,
                priority=rng.choice([0, 0, 1, -1]),
                adapter=rng.choice([None, 1, 2, 3]) if adapters else None,
                prompt_logprobs=rng.choice([None, None, None, 0, 2]),  # every prompt position computed
            )
        )
    return prompts


def check_schedule(draw: int) -> None:
    rng = random.Random(SEED * 100_003 + draw)
    budget = rng.choice([4, 8, 16, 32, 64])
    whole_images = rng.random() < 0.3
    max_loras = rng.choice([0, 0, 1, 2])
    # an image seen both ways (Gemma 3's) runs in one chunk: the model's one size, which the budget must hold
    # (EngineConfig refuses a smaller one)
    sizes = [min(budget, rng.choice([4, 8, 12]))] if whole_images else [4, 8, 12, 24]
    prompts = draw_prompts(rng, sizes, adapters=max_loras > 0)
    # a prompt the engine takes is shorter than max_model_len; a sample that reaches it ends ("length")
    longest = max(len(p["ids"]) for p in prompts)
    max_model_len = rng.choice([1024, longest + rng.randint(1, 4)])
    # the longest sample fits, and every prompt with its samples' first blocks (LLMEngine.add_request's check)
    fits = max(
        max(
            -(-min(len(p["ids"]) + p["max_tokens"], max_model_len) // BLOCK),
            -(-(len(p["ids"]) + 1) // BLOCK) + p["n"] - 1,
        )
        for p in prompts
    )
    encoder_budget = rng.choice([budget, budget, 8, 64])
    largest = max((item.span.length for p in prompts for item in p["images"]), default=0)
    options = dict(
        budget=budget,
        max_seqs=rng.choice([3, 4, 8]),
        blocks=fits + rng.choice([0, 1, 2, 8]),
        prefix_caching=rng.random() < 0.5,
        encoder_tokens=largest + encoder_budget,
        encoder_budget=encoder_budget,
        whole_images=whole_images,
        max_loras=max_loras,
        max_model_len=max_model_len,
    )
    ahead = rng.random() < 0.5
    stops = rng.choice([0.0, 0.0, 0.2])  # a sample's chance to end on each token (a stop token)
    failures = rng.choice([0, 0, 0.05])  # a step's chance to fail at its launch (LLMEngine._step_failed)
    drawn = [(len(p["ids"]), *list(p.values())[2:]) for p in prompts]
    where = f"FOVEA_FUZZ_SEED={SEED} draw {draw}: {options}, ahead {ahead}, stops {stops}, failures {failures}, {drawn}"
    sched = scheduler(**options)
    requests = [
        sequence(
            i, p["ids"], max_tokens=p["max_tokens"], images=p["images"], priority=p["priority"], n=p["n"],
            prompt_logprobs=p["prompt_logprobs"], lora=p["adapter"] and LoRARequest(f"a{p['adapter']}", p["adapter"]),
        ).request
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    seq_ids = itertools.count(len(prompts))
    failed: set = set()  # requests failed by a step (LLMEngine._fail): they leave the engine

    def record(batch, sampling, reached) -> None:
        """LLMEngine._record's bookkeeping: the prompt positions the step scored, the samples (a prompt's first
        forks its other samples, which sample too), a sample that reaches max_tokens or max_model_len, or draws
        a stop, finishes; a suspect that a step sampled for alone is cleared."""
        for seq in sampling:
            seq.num_pending -= 1
        sched.step_done(batch)
        for seq, computed in zip(batch.seqs, reached):
            scored = seq.request.prompt_logprobs
            if scored is not None and seq.index == 0:  # record_prompt_logprobs
                scored += [None] * (min(computed + 1, seq.num_prompt_tokens) - len(scored))
        sampling = [seq for seq in sampling if seq.status != SequenceStatus.FINISHED]  # (aborted while it ran)
        for seq in list(sampling):
            for fork in range(1, seq.pending_forks + 1):
                child = Sequence(next(seq_ids), seq.request, seq.index + fork)
                sched.fork(seq, child)
                seq.request.sequences.append(child)
                sampling.append(child)
            seq.pending_forks = 0
        for seq in sampling:
            seq.token_ids.append(7)
            ended = seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= max_model_len
            if ended or rng.random() < stops:
                sched.finish(seq)
        sampled = {seq.request for seq in sampling}
        if len(sampled) == 1 and sched.suspects:
            sched.cleared(sampled.pop())

    def fail(batch) -> None:
        """LLMEngine._step_failed: the step's requests run alone from now on, or fail (one alone, or one in
        MAX_FAILED_STEPS failed steps)."""
        suspects = {r for r in sched.requests_in(batch) if not r.finished and r not in failed}
        for request in suspects:
            request.failed_steps += 1
        if len(suspects) > 1:
            dropped = {r for r in suspects if r.failed_steps >= MAX_FAILED_STEPS}
            sched.isolate(suspects - dropped)
            suspects = dropped
        fail_requests(suspects, keep={item.content_hash for item in batch.step.encode})

    def fail_requests(doomed, keep=frozenset()) -> None:
        """LLMEngine._fail and _retire: the requests leave the engine, and the encoder cache's reservations that
        no encoding in flight (`keep`) will fill go."""
        for request in doomed:
            failed.add(request)
            for seq in request.sequences:
                sched.finish(seq)
            sched.cleared(request)
        sched.encoder_cache.drop_unfilled(keep)

    total = sum((len(p["ids"]) + p["max_tokens"]) * p["n"] for p in prompts)
    limit = 4 * total + 100  # steps; each failed step adds room to recompute what it sent back
    in_flight = None  # (batch, its sampling sequences, tokens computed at its launch) scheduled ahead, not recorded
    launched_upto: dict[int, int] = {}  # per sequence: the most tokens its launched steps had computed
    turn = 0
    while turn < limit:
        for request, p in zip(requests, prompts):
            if p["arrival"] == turn:
                sched.add(request.sequences[0])
            if p["abort"] == turn and p["arrival"] <= turn and not request.finished and request not in failed:
                request.aborted = True  # LLMEngine.abort_request
                for seq in request.sequences:
                    sched.finish(seq)
        # a step whose samples fork is recorded before the next is scheduled (LLMEngine._schedules_ahead)
        if in_flight is not None and any(seq.pending_forks for seq in in_flight[1]):
            record(*in_flight)
            in_flight = None
        left = sched.running or sched.waiting
        batch = sched.schedule()
        progress = batch.seqs or batch.step.encode or in_flight or not left
        assert progress, f"{where}: step {turn} ran nothing and encoded nothing"
        check_limits(sched, batch, launched_upto, where)
        check_blocks(sched, requests, where)
        launched = None
        if batch.seqs and rng.random() < failures:
            fail(batch)
            limit += 2 * total
        elif batch.seqs:
            pending = [seq.num_pending for seq in batch.seqs]
            sched.launched(batch)
            sampling = [seq for seq, before in zip(batch.seqs, pending) if seq.num_pending > before]
            launched = (batch, sampling, [seq.num_computed_tokens for seq in batch.seqs])
            for seq in batch.seqs:
                launched_upto[seq.seq_id] = max(launched_upto.get(seq.seq_id, 0), seq.num_computed_tokens)
        if in_flight is not None:
            record(*in_flight)
        in_flight = launched
        if not ahead and in_flight is not None:
            record(*in_flight)
            in_flight = None
        keys = {item.content_hash for item in batch.step.encode}
        if keys and rng.random() < failures:  # the encoder failed: every request showing its images fails
            fail_requests({
                r for r, p in zip(requests, prompts)
                if p["arrival"] <= turn and not r.finished and r not in failed
                and keys.intersection(item.content_hash for item in r.mm_items)
            })  # fmt: skip
        for item in batch.step.encode:
            sched.encoder_cache.put(item.content_hash, torch.zeros(item.span.length, 4))
        if all(request.finished or request in failed for request in requests) and in_flight is None:
            assert not sched.suspects, f"{where}: suspects left when every request ended"
            held = sched.blocks.num_blocks - sched.blocks.num_free_blocks
            assert held == 0, f"{where}: {held} KV blocks held when every request ended"
            assert sched.encoder_cache.num_references() == 0, f"{where}: images held when every request ended"
            return
        turn += 1
    unfinished = [request.request_id for request in requests if not (request.finished or request in failed)]
    raise AssertionError(f"{where}: {unfinished} never ended")


def check_limits(sched, batch, launched_upto: dict[int, int], where: str) -> None:
    """The step holds the token budget and max_num_seqs, max_loras adapters run at once, and a prompt whose every
    position is scored (prompt_logprobs) skips none of them."""
    config = sched.config
    assert sum(batch.num_new_tokens) <= config.max_num_batched_tokens, f"{where}: over the token budget"
    assert len(sched.running) <= config.max_num_seqs, f"{where}: {len(sched.running)} sequences run"
    adapters = {seq.request.lora.lora_int_id for seq in sched.running if seq.request.lora}
    assert len(adapters) <= config.max_loras, f"{where}: adapters {adapters} run at once"
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start = seq.num_computed_tokens
        if seq.request.prompt_logprobs is not None and seq.index == 0 and start < seq.num_prompt_tokens:
            assert start <= launched_upto.get(seq.seq_id, 0), f"{where}: positions {start} skipped"


def check_blocks(sched, requests, where: str) -> None:
    """The KV blocks' bookkeeping: each block's reference count is the tables holding it, the free list holds
    exactly the blocks no table holds, a cached hash names the block holding it, and a block a sequence writes
    next (from its first token not computed on) is its own: a block two sequences wrote would mix their KV."""
    blocks = sched.blocks
    live = [seq for request in requests for seq in request.sequences if seq.status != SequenceStatus.FINISHED]
    held = collections.Counter(block for seq in live for block in seq.block_table)
    assert all(blocks.ref_counts[b] == held[b] for b in range(blocks.num_blocks)), f"{where}: reference counts"
    assert set(blocks.free) == {b for b in range(blocks.num_blocks) if not held[b]}, f"{where}: the free list"
    assert all(blocks.block_hash[b] == h for h, b in blocks.cached.items()), f"{where}: the cached hashes"
    for seq in live:
        for block in seq.block_table[seq.num_computed_tokens // BLOCK :]:
            assert held[block] == 1, f"{where}: sequence {seq.seq_id} writes block {block}, which others hold"


def test_every_step_runs_or_encodes_until_every_prompt_ends():
    for draw in range(DRAWS):
        check_schedule(draw)
