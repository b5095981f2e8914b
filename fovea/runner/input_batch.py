"""The sequences the runner has seen, one row each, kept from step to step (a persistent input batch).

A decode step changes little: each row gains a token and, every `block_size` tokens, a KV block. So the block
tables live in one array that rows append to, and each sequence's sampling row (its parameters, RNG and token
list) is made once. A step's arrays are gathered from the rows (numpy, no per-token Python); only prefill chunks
are laid out one sequence at a time. A running sequence's block table only grows; the scheduler names those whose
tables changed otherwise (`ScheduledBatch.relaid`: freed when finished, preempted or isolated, or given cached
blocks in place of its own): their rows are dropped before the step's sequences are looked up, so that they are
laid out afresh.
"""

from __future__ import annotations

import numpy as np

from fovea.core.request import ScheduledBatch, Sequence
from fovea.runner.sampler import SampleRow


class InputBatch:
    def __init__(self, max_blocks_per_seq: int):
        self.max_blocks = max_blocks_per_seq
        self.row_of: dict[int, int] = {}  # sequence id -> row
        self.free_rows: list[int] = []
        self.tables = np.zeros((0, max_blocks_per_seq), dtype=np.int32)
        self.table_lens = np.zeros(0, dtype=np.int64)
        self.mrope_deltas = np.zeros(0, dtype=np.int64)  # what a generated token adds to its index: its position
        self.sample_rows: list[SampleRow | None] = []  # each row's first sample (forks are made when they split)

    def rows(self, batch: ScheduledBatch) -> np.ndarray:
        """The rows of the batch's sequences, in order, their block tables brought up to date."""
        for seq_id in batch.relaid:
            row = self.row_of.pop(seq_id, None)
            if row is not None:
                self.tables[row, : self.table_lens[row]] = 0  # padding for whoever takes the row next
                self.table_lens[row] = 0
                self.free_rows.append(row)
                self.sample_rows[row] = None
        rows = np.empty(len(batch.seqs), dtype=np.int64)
        for i, seq in enumerate(batch.seqs):
            row = self.row_of.get(seq.seq_id)
            if row is None:
                row = self._add(seq)
            if len(seq.block_table) != self.table_lens[row]:
                self._write_table(row, seq.block_table, int(self.table_lens[row]))
            rows[i] = row
        return rows

    def sample_row(self, row: int, seq: Sequence) -> SampleRow:
        """The row's first sample; a request with a grammar gets a new one each step (the grammar starts only once
        its reasoning has ended)."""
        cached = self.sample_rows[row]
        if cached is None or seq.request.grammars:
            cached = self.sample_rows[row] = make_sample_row(seq, 0)
        return cached

    def block_tables(self, rows: np.ndarray) -> np.ndarray:
        """(rows, longest table) int32, padded with 0."""
        width = max(1, int(self.table_lens[rows].max())) if rows.size else 1
        return self.tables[rows, :width]

    def _add(self, seq: Sequence) -> int:
        if not self.free_rows:
            grown = max(16, 2 * len(self.table_lens))
            self.free_rows = list(range(grown - 1, len(self.table_lens) - 1, -1))
            self.tables = np.concatenate([self.tables, np.zeros((grown - len(self.tables), self.max_blocks), np.int32)])
            more = np.zeros(grown - len(self.table_lens), np.int64)
            self.table_lens, self.mrope_deltas = (
                np.concatenate([self.table_lens, more]),
                np.concatenate([self.mrope_deltas, more]),
            )
            self.sample_rows += [None] * (grown - len(self.sample_rows))
        row = self.free_rows.pop()
        self.row_of[seq.seq_id] = row
        self.mrope_deltas[row] = seq.request.mrope_delta
        return row

    def _write_table(self, row: int, table: list[int], start: int) -> None:
        self.tables[row, start : len(table)] = table[start:]
        self.table_lens[row] = len(table)


def make_sample_row(seq: Sequence, fork: int) -> SampleRow:
    request, sample = seq.request, seq.index + fork
    return SampleRow(
        seq.params,
        seq.token_ids,
        seq.num_prompt_tokens,
        request.generators[sample],
        request.stop_ids,
        request.grammars[sample] if request.grammars and not seq.grammar_waiting else None,
        (seq.seq_id, fork),
    )
