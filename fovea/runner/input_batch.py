"""The sequences the runner has seen, one row each, kept from step to step (a persistent input batch).

A row holds what the runner needs of its sequence, given once (`NewSequence`): the tokens known on the host, the
prompt's positions and images, the block table, the sampling row. A decode step changes little: each row gains a
token, which the runner writes in itself when the engine reads the step's samples (`record`), and, every
`block_size` tokens, a KV block (`ScheduledStep.new_blocks`). So tokens, counts and block tables live in arrays, and
a step's arrays are gathered from the rows (numpy, no per-token Python); only prefill chunks are laid out one
sequence at a time. A row whose sequence changed otherwise is dropped (`ScheduledStep.relaid`) and sent again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fovea.runner.sampler import SampleRow

if TYPE_CHECKING:
    from fovea.runner.step_input import NewSequence, SamplePlan, ScheduledStep


class InputBatch:
    def __init__(self, max_model_len: int, block_size: int):
        self.max_len, self.max_blocks = max_model_len + 1, -(-max_model_len // block_size)
        self.tokens = np.zeros((0, self.max_len), dtype=np.int32)  # each row's tokens known on the host
        self.row_of: dict[int, int] = {}  # sequence id -> row
        self.free_rows: list[int] = []
        self.tables = np.zeros((0, self.max_blocks), dtype=np.int32)
        self.table_lens = np.zeros(0, dtype=np.int64)
        self.seq_ids = np.zeros(0, dtype=np.int64)  # -1: a free row
        self.num_dropped = 0  # rows dropped so far
        self.computed = np.zeros(0, dtype=np.int64)  # tokens whose KV is computed or queued on the device
        self.known = np.zeros(0, dtype=np.int64)  # tokens in the row's list
        self.pending = np.zeros(0, dtype=np.int64)  # its samples still on the device (async scheduling)
        self.prompt_lens = np.zeros(0, dtype=np.int64)
        self.mrope_deltas = np.zeros(0, dtype=np.int64)
        self.seqs: list[NewSequence | None] = []
        # rows of sequences with a LoRA adapter, and with grammars: a step with none skips looking for them
        self.num_lora_rows = self.num_grammar_rows = 0
        self.first_samples: list[SampleRow | None] = []  # each row's first sample (forks are made when they split)

    def update(self, step: ScheduledStep) -> np.ndarray:
        """Drops the relaid rows, adds the new ones, appends blocks; the rows of the step's sequences, in order."""
        for seq_id in step.relaid:
            row = self.row_of.pop(seq_id, None)
            if row is not None:
                self.num_dropped += 1
                self.tables[row, : self.table_lens[row]] = 0  # padding for whoever takes the row next
                self.table_lens[row] = 0
                self.seq_ids[row] = -1
                self.free_rows.append(row)
                self.num_lora_rows -= self.seqs[row].lora is not None
                self.num_grammar_rows -= self.seqs[row].grammars is not None
                self.seqs[row] = self.first_samples[row] = None
        for seq in step.new:
            self._add(seq)
        for seq_id, blocks in step.new_blocks:
            row = self.row_of[seq_id]
            start = int(self.table_lens[row])
            self.tables[row, start : start + len(blocks)] = blocks
            self.table_lens[row] = start + len(blocks)
        return np.fromiter(map(self.row_of.__getitem__, step.seq_ids), dtype=np.int64, count=len(step.seq_ids))

    def record(self, plan: SamplePlan, sampled: np.ndarray) -> None:
        """A step's samples (`sampled`: its token ids), read on the host: appended to the rows that still hold the
        sequences they were drawn for (async scheduling drops and reuses rows before the samples of the step in
        flight are read)."""
        rows, index = plan.sample_rows, plan.sample_index
        if self.num_dropped != plan.num_dropped:  # rows were dropped since the step was built
            kept = np.flatnonzero(self.seq_ids[rows] == plan.sample_seq_ids)
            rows, index = rows[kept], index[kept]
        self.tokens[rows, self.known[rows]] = sampled[index]
        self.known[rows] += 1
        self.pending[rows] -= 1

    def block_tables(self, rows: np.ndarray) -> np.ndarray:
        """(rows, longest table) int32, padded with 0."""
        width = max(1, int(self.table_lens[rows].max())) if rows.size else 1
        return self.tables[rows, :width]

    def _add(self, seq: NewSequence) -> None:
        if not self.free_rows:
            self._grow()
        row = self.free_rows.pop()
        self.row_of[seq.seq_id] = row
        self.seq_ids[row] = seq.seq_id
        self.seqs[row] = seq
        self.first_samples[row] = make_sample_row(seq, RowTokens(self, row), 0)
        self.num_lora_rows += seq.lora is not None
        self.num_grammar_rows += seq.grammars is not None
        self.tokens[row, : len(seq.token_ids)] = seq.token_ids
        self.computed[row], self.known[row], self.pending[row] = seq.num_computed_tokens, len(seq.token_ids), 0
        self.prompt_lens[row], self.mrope_deltas[row] = seq.num_prompt_tokens, seq.mrope_delta
        self.tables[row, : len(seq.block_table)] = seq.block_table
        self.table_lens[row] = len(seq.block_table)

    def _grow(self) -> None:
        size = len(self.table_lens)
        grown = max(16, 2 * size)
        self.free_rows = list(range(grown - 1, size - 1, -1))
        self.tables = np.concatenate([self.tables, np.zeros((grown - size, self.max_blocks), np.int32)])
        self.tokens = np.concatenate([self.tokens, np.zeros((grown - size, self.max_len), np.int32)])
        for name in ("table_lens", "seq_ids", "computed", "known", "pending", "prompt_lens", "mrope_deltas"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(grown - size, np.int64)]))
        self.seq_ids[size:] = -1
        for name in ("seqs", "first_samples"):
            getattr(self, name).extend([None] * (grown - size))


class RowTokens:
    """A row's tokens known on the host, read as a sequence (the penalties read what a sample has seen)."""

    __slots__ = ("batch", "row")

    def __init__(self, batch: InputBatch, row: int):
        self.batch, self.row = batch, row

    def __len__(self) -> int:
        return int(self.batch.known[self.row])

    def __getitem__(self, index):
        return self.batch.tokens[self.row, : self.batch.known[self.row]][index]


def make_sample_row(seq: NewSequence, token_ids: RowTokens, fork: int) -> SampleRow:
    sample = seq.index + fork
    return SampleRow(
        seq.params,
        token_ids,
        seq.num_prompt_tokens,
        seq.generators[sample],
        seq.stop_ids,
        seq.grammars[sample] if seq.grammars else None,
        (seq.seq_id, fork),
    )
