"""The runner's persistent input batch (runner/input_batch.py), told each step only what changed (ScheduledStep, as
the scheduler writes it): over many steps of decodes, new blocks, prefill chunks that adopt cached blocks in place,
preemptions that come back with other blocks (also straight into a decode), and finished sequences, each step's
arrays equal the ones laid out from scratch from the sequences' state as it is then (every sequence sent whole),
and equal the published layout (slot = block * block_size + offset, positions + delta); the tokens the runner
records from its samples are the engine's."""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import numpy as np
import torch

from fovea.config.engine import EngineConfig
from fovea.core.request import RequestInput
from fovea.core.sampling_params import SamplingParams
from fovea.engine.block_manager import BlockManager
from fovea.engine.encoder_cache import EncoderCache
from fovea.engine.scheduler import Scheduler
from fovea.engine.sequence import Request, ScheduledBatch, Sequence
from fovea.runner.input_batch import InputBatch
from fovea.runner.step_input import ScheduledStep, build_step

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


def scheduler() -> Scheduler:
    config = EngineConfig.__new__(EngineConfig)
    config.__dict__.update(max_num_batched_tokens=64, max_num_seqs=4, enable_lora=False, encoder_budget=0)
    config.__dict__["model"] = SimpleNamespace(bidirectional_images=False)
    return Scheduler(config, BlockManager(64, BLOCK, False), EncoderCache(0))


def layout(step: ScheduledStep, inputs: InputBatch):
    step_input, _, plan, _ = build_step(step, lambda key: None, BLOCK, inputs)
    return step_input, plan


def from_scratch(batch: ScheduledBatch) -> ScheduledStep:
    """The step with every sequence sent whole, as to a runner that has seen none of them."""
    new = [copy.copy(seq).for_runner() for seq in batch.seqs]
    return ScheduledStep([s.seq_id for s in batch.seqs], list(batch.num_new_tokens), new)


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
    inputs = InputBatch(MAX_BLOCKS * BLOCK, BLOCK)
    sched = scheduler()  # writes each step's description (ScheduledStep) as it does when it schedules
    running: list[Sequence] = []
    next_id = 0
    checked = {"preempted into a decode": 0, "adopted": 0, "decode": 0, "new blocks": 0}
    for _ in range(300):
        while len(running) < 6:  # admitted: a prefill from the start, or from a cached prefix
            seq = new_sequence(next_id, rng)
            next_id += 1
            seq.block_table = blocks_for(seq.num_tokens, rng)
            running.append(seq)
        batch = ScheduledBatch()
        for seq in rng.sample(running, rng.randint(1, len(running))):  # some sit this step out
            left = seq.num_tokens - seq.num_computed_tokens
            if left > 1 and rng.random() < 0.3:  # a prefill adopting cached blocks: its table changes in place
                first = seq.num_computed_tokens // BLOCK
                seq.block_table[first:] = blocks_for(seq.num_tokens - first * BLOCK, rng)
                sched.relay(seq)
                checked["adopted"] += 1
            n = rng.randint(1, left) if left > 1 else 1
            checked["new blocks"] += seq.on_runner and len(seq.block_table) != seq.blocks_sent
            sched._add_to_batch(batch, seq, n)
            checked["decode"] += n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
        batch.step.relaid, sched.relaid = sched.relaid, []
        step, plan = layout(batch.step, inputs)
        fresh, fresh_plan = layout(from_scratch(batch), InputBatch(MAX_BLOCKS * BLOCK, BLOCK))
        slots, positions = expected_slots_and_positions(batch)
        assert np.array_equal(step.slots, slots) and np.array_equal(step.positions, positions)
        for name in ("token_ids", "slots", "positions", "query_starts", "seq_lens", "block_tables"):
            assert np.array_equal(getattr(step, name), getattr(fresh, name)), name
        assert step.logits_rows == fresh.logits_rows and plan.owners == fresh_plan.owners
        assert plan.forks == fresh_plan.forks == [0] * len(plan.owners)
        ends = [
            i
            for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
            if s.num_computed_tokens + n == s.num_tokens
        ]
        assert sorted(plan.owners) == ends  # a sample where a sequence's last token is computed
        assert [r.key for r in plan.rows] == [r.key for r in fresh_plan.rows]
        sampled = np.array([rng.randrange(1000) for _ in plan.rows])
        inputs.record(plan, sampled)  # the engine reads the samples: the runner's rows take them too
        for seq, n in zip(batch.seqs, batch.num_new_tokens):  # the step ran: tokens computed
            seq.num_computed_tokens += n
        for index, token in zip(plan.owners, sampled.tolist()):
            seq = batch.seqs[index]
            seq.token_ids.append(token)
            assert list(plan.rows[plan.owners.index(index)].token_ids) == seq.token_ids
            if len(seq.block_table) * BLOCK < seq.num_tokens:
                seq.block_table.append(rng.randrange(1, 500))
        for seq in list(running):
            if seq.num_tokens > 40 or rng.random() < 0.03:  # finished
                running.remove(seq)
                sched.relay(seq)
            elif rng.random() < 0.05:  # preempted: back with other blocks, maybe straight into a decode
                sched.relay(seq)
                seq.block_table = blocks_for(seq.num_tokens, rng)
                cached = seq.num_output_tokens > 0 and rng.random() < 0.5
                seq.num_computed_tokens = seq.num_tokens - 1 if cached else 0
                checked["preempted into a decode"] += cached
    assert all(count >= 5 for count in checked.values()), checked


def test_a_sequence_is_sent_once_and_what_is_freed_is_named_once():
    """A sequence's data reaches the runner in the first step that runs it, and not again; finished sequences
    are named in the next step that runs, whatever empty steps come between; a waiting sequence that never ran
    is not named."""
    sched = scheduler()
    rng = random.Random(1)
    seqs = [new_sequence(i, rng) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    first = sched.schedule().step
    assert first.seq_ids == [0, 1, 2] and [s.seq_id for s in first.new] == [0, 1, 2] and first.relaid == []
    sched.finish(seqs[0])
    sched.finish(seqs[1])
    waiting = new_sequence(9, rng)
    sched.add(waiting)
    sched.finish(waiting)  # never ran: no row to drop
    sched.running.clear()  # nothing runs in this step: the names wait for one that does
    assert sched.schedule().step.relaid == []
    sched.running.append(seqs[2])
    step = sched.schedule().step
    assert step.relaid == [0, 1] and step.seq_ids == [2] and step.new == []
    assert sched.schedule().step.relaid == []


def test_sample_rows_are_made_once_per_sequence():
    rng = random.Random(2)
    inputs, sched = InputBatch(MAX_BLOCKS * BLOCK, BLOCK), scheduler()
    seq = new_sequence(0, rng)
    seq.block_table = blocks_for(seq.num_tokens + 1, rng)

    def run(n: int):
        batch = ScheduledBatch()
        sched._add_to_batch(batch, seq, n)
        batch.step.relaid, sched.relaid = sched.relaid, []
        _, plan = layout(batch.step, inputs)
        seq.num_computed_tokens += n
        inputs.record(plan, np.array([7]))
        seq.token_ids.append(7)
        return plan

    plan = run(seq.num_tokens)
    again = run(1)
    assert again.rows[0] is plan.rows[0] and list(again.rows[0].token_ids) == seq.token_ids
    assert again.rows[0].token_ids is not seq.token_ids  # the runner's own
    sched.relay(seq)
    after_relay = run(1)
    assert after_relay.rows[0] is not plan.rows[0]
    assert torch.equal(torch.tensor(after_relay.rows[0].key), torch.tensor((0, 0)))


def test_samples_of_a_step_read_after_its_rows_were_reused_go_nowhere():
    """Scheduling ahead: step 2 is built before step 1's samples are read, and drops the row of a sequence that
    finished meanwhile; a new sequence takes that row. Step 1's sample for the finished one must not land in it."""
    rng = random.Random(3)
    inputs, sched = InputBatch(MAX_BLOCKS * BLOCK, BLOCK), scheduler()
    finished, kept = new_sequence(0, rng), new_sequence(1, rng)
    for seq in (finished, kept):
        seq.block_table = blocks_for(seq.num_tokens + 8, rng)

    def build(seqs_and_counts):
        batch = ScheduledBatch()
        for seq, n in seqs_and_counts:
            sched._add_to_batch(batch, seq, n)
        batch.step.relaid, sched.relaid = sched.relaid, []
        return layout(batch.step, inputs)[1]

    plan = build([(finished, finished.num_tokens), (kept, kept.num_tokens)])
    for seq in (finished, kept):
        seq.num_computed_tokens = seq.num_tokens
    row_of_finished = inputs.row_of[finished.seq_id]
    sched.relay(finished)  # it finished (on a stop token, say) while step 1 was on the device
    newcomer = new_sequence(2, rng)
    newcomer.block_table = blocks_for(newcomer.num_tokens, rng)
    build([(newcomer, newcomer.num_tokens)])  # step 2, built ahead
    assert inputs.row_of[newcomer.seq_id] == row_of_finished  # the freed row, taken
    inputs.record(plan, np.array([111, 222]))  # step 1's samples, read now
    assert list(inputs.first_samples[row_of_finished].token_ids) == newcomer.token_ids
    assert list(inputs.first_samples[inputs.row_of[kept.seq_id]].token_ids) == kept.token_ids + [222]
