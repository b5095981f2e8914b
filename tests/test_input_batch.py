"""The runner's persistent input batch (runner/input_batch.py): over many steps of decodes, new blocks, prefill
chunks that adopt cached blocks in place, preemptions that come back with other blocks (also straight into a
decode), forks and finished sequences, each step's arrays equal the ones laid out from scratch from the sequences'
state as it is then, and equal the published layout (slot = block * block_size + offset, positions + delta)."""

from __future__ import annotations

import random

import numpy as np
import torch

from fovea.core.request import Request, RequestInput, ScheduledBatch, Sequence
from fovea.core.sampling_params import SamplingParams
from fovea.runner.input_batch import InputBatch
from fovea.runner.step_input import build_step

BLOCK = 4
MAX_BLOCKS = 64


def new_sequence(seq_id: int, rng: random.Random) -> Sequence:
    length = rng.randint(3, 20)
    positions = np.sort(np.array([rng.sample(range(100), length) for _ in range(3)]), axis=1)
    request = Request(
        RequestInput(
            f"r{seq_id}",
            [rng.randrange(1000) for _ in range(length)],
            SamplingParams(n=1),
            positions=positions,
            mrope_delta=rng.randint(-5, 40),
        )
    )
    request.generators = [None]
    return Sequence(seq_id, request)


def blocks_for(tokens: int, rng: random.Random) -> list[int]:
    return rng.sample(range(1, 500), -(-tokens // BLOCK))


def layout(batch: ScheduledBatch, inputs: InputBatch):
    step, _, plan = build_step(batch, lambda key: None, BLOCK, inputs)
    return step, plan


def expected_slots_and_positions(batch: ScheduledBatch):
    slots, positions = [], []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        for index in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            slots.append(seq.block_table[index // BLOCK] * BLOCK + index % BLOCK)
            if index < seq.num_prompt_tokens:
                positions.append(seq.request.positions[:, index])
            else:
                positions.append(np.full(3, index + seq.request.mrope_delta))
    return np.array(slots), np.stack(positions, 1)


def test_rows_kept_between_steps_give_the_arrays_laid_out_from_scratch():
    rng = random.Random(5)
    inputs = InputBatch(MAX_BLOCKS)
    running: list[Sequence] = []
    next_id = 0
    relaid: list[int] = []  # as the scheduler names them: freed, or blocks swapped
    checked = {"preempted into a decode": 0, "adopted": 0, "decode": 0}
    for _ in range(300):
        while len(running) < 6:  # admitted: a prefill from the start, or from a cached prefix
            seq = new_sequence(next_id, rng)
            next_id += 1
            seq.block_table = blocks_for(seq.num_tokens, rng)
            running.append(seq)
        batch = ScheduledBatch(relaid=relaid)
        relaid = []
        for seq in rng.sample(running, rng.randint(1, len(running))):  # some sit this step out
            left = seq.num_tokens - seq.num_computed_tokens
            if left > 1 and rng.random() < 0.3:  # a prefill adopting cached blocks: its table changes in place
                first = seq.num_computed_tokens // BLOCK
                seq.block_table[first:] = blocks_for(seq.num_tokens - first * BLOCK, rng)
                batch.relaid.append(seq.seq_id)
                checked["adopted"] += 1
            n = rng.randint(1, left) if left > 1 else 1
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            checked["decode"] += n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
        step, plan = layout(batch, inputs)
        fresh, fresh_plan = layout(ScheduledBatch(list(batch.seqs), list(batch.num_new_tokens)), InputBatch(MAX_BLOCKS))
        slots, positions = expected_slots_and_positions(batch)
        assert np.array_equal(step.slots, slots) and np.array_equal(step.positions, positions)
        for name in ("token_ids", "slots", "positions", "query_starts", "seq_lens", "block_tables"):
            assert np.array_equal(getattr(step, name), getattr(fresh, name)), name
        assert step.logits_rows == fresh.logits_rows and plan.owners == fresh_plan.owners
        ends = [
            i
            for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
            if s.num_computed_tokens + n == s.num_tokens
        ]
        assert sorted(plan.owners) == [(i, 0) for i in ends]  # a sample where a sequence's last token is computed
        assert [r.key for r in plan.rows] == [r.key for r in fresh_plan.rows]
        for seq, n in zip(batch.seqs, batch.num_new_tokens):  # the step ran: tokens computed, one sampled
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(rng.randrange(1000))
                if len(seq.block_table) * BLOCK < seq.num_tokens:
                    seq.block_table.append(rng.randrange(1, 500))
        for seq in list(running):
            if seq.num_tokens > 40 or rng.random() < 0.03:  # finished
                running.remove(seq)
                relaid.append(seq.seq_id)
            elif rng.random() < 0.05:  # preempted: back with other blocks, maybe straight into a decode
                relaid.append(seq.seq_id)
                seq.block_table = blocks_for(seq.num_tokens, rng)
                cached = seq.num_output_tokens > 0 and rng.random() < 0.5
                seq.num_computed_tokens = seq.num_tokens - 1 if cached else 0
                checked["preempted into a decode"] += cached
    assert all(count >= 5 for count in checked.values()), checked


def test_the_scheduler_names_what_it_freed_once():
    """Finished sequences reach the runner in the next batch that runs, whatever empty steps come between; a
    waiting sequence that never ran is not named."""
    from fovea.config.engine import EngineConfig
    from fovea.engine.block_manager import BlockManager
    from fovea.engine.encoder_cache import EncoderCache
    from fovea.engine.scheduler import Scheduler

    config = EngineConfig.__new__(EngineConfig)
    config.__dict__.update(max_num_batched_tokens=64, max_num_seqs=4, enable_lora=False, encoder_budget=0)
    scheduler = Scheduler(config, BlockManager(64, BLOCK, False), EncoderCache(0))
    rng = random.Random(1)
    seqs = [new_sequence(i, rng) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    first = scheduler.schedule()
    assert [s.seq_id for s in first.seqs] == [0, 1, 2] and first.relaid == []
    scheduler.finish(seqs[0])
    scheduler.finish(seqs[1])
    waiting = new_sequence(9, rng)
    scheduler.add(waiting)
    scheduler.finish(waiting)  # never ran: no row to drop
    scheduler.running.clear()  # nothing runs in this step: the names wait for one that does
    assert scheduler.schedule().relaid == []
    scheduler.running.append(seqs[2])
    assert scheduler.schedule().relaid == [0, 1]
    assert scheduler.schedule().relaid == []


def test_sample_rows_are_made_once_per_sequence():
    rng = random.Random(2)
    inputs = InputBatch(MAX_BLOCKS)
    seq = new_sequence(0, rng)
    seq.block_table = blocks_for(seq.num_tokens + 1, rng)
    _, plan = layout(ScheduledBatch([seq], [seq.num_tokens]), inputs)
    seq.num_computed_tokens = seq.num_tokens
    seq.token_ids.append(7)
    _, again = layout(ScheduledBatch([seq], [1]), inputs)
    assert again.rows[0] is plan.rows[0] and again.rows[0].token_ids is seq.token_ids
    _, after_free = layout(ScheduledBatch([seq], [1], relaid=[0]), inputs)
    assert after_free.rows[0] is not plan.rows[0]
    assert torch.equal(torch.tensor(after_free.rows[0].key), torch.tensor((0, 0)))
