"""A scheduled batch flattened into what the model runs on.

`StepInput` is what every tensor-parallel rank needs for one step of the language model: host arrays only (token
ids, M-RoPE positions, KV slots, block tables, which rows to score), small enough to send to the other ranks each
step. The image embeddings of the step travel beside it as one tensor. `SamplePlan` stays on rank 0, which alone
samples: the sampling parameters and RNGs of the rows it scores, and the targets of prompt log-probabilities.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from fovea.core.request import LoRARequest, ScheduledBatch
from fovea.runner.sampler import SampleRow


@dataclass
class StepInput:
    token_ids: np.ndarray  # (N,) int64: each sequence's new tokens back to back
    positions: np.ndarray  # (3, N) int64 M-RoPE positions
    slots: np.ndarray  # (N,) int64 KV-cache slot of each token
    query_starts: np.ndarray  # (sequences + 1,) int32
    seq_lens: np.ndarray  # (sequences,) int32 context length after this step
    block_tables: np.ndarray  # (sequences, longest table) int32
    mm_mask: np.ndarray  # (N,) bool: rows that take an image embedding (a generated placeholder id is text)
    num_mm_rows: int
    logits_rows: list[int]  # rows to score for sampling, in order
    logprob_spans: list[tuple[int, int]]  # (first row, rows) whose prompt log-probabilities were asked for
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) KV blocks before the step
    loras: list[LoRARequest] = field(default_factory=list)  # the adapters of the step's sequences
    lora_of_seq: np.ndarray | None = None  # (sequences,) int32 index in `loras`, -1: the base model
    # async scheduling: rows whose token is the sample `fill_from` (its row) of the step still on the device
    fill_rows: list[int] = field(default_factory=list)
    fill_from: list[int] = field(default_factory=list)

    def lora_rows(self) -> list[tuple[np.ndarray, LoRARequest]]:
        """The rows (tokens) of each adapter of the step."""
        if not self.loras:
            return []
        of_token = np.repeat(self.lora_of_seq, np.diff(self.query_starts))
        return [(np.flatnonzero(of_token == i), lora) for i, lora in enumerate(self.loras)]

    @property
    def max_query_len(self) -> int:
        return int(np.diff(self.query_starts).max())

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())


@dataclass
class SamplePlan:
    rows: list[SampleRow]  # one per logits row
    owners: list[tuple[int, int]]  # (batch index, fork number) of each logits row
    prompt_logprobs: list[tuple[int, list[int], int]]  # per logprob span: (batch index, target ids, top k)
    # (logits row, its sequence's sample row in the step on the device): the penalties count that token too
    pending: list[tuple[int, int]] = field(default_factory=list)


def block_table_array(tables: list[list[int]]) -> np.ndarray:
    """The block tables as one (sequences, longest table) int32 array padded with 0, filled in one go."""
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    array = np.zeros((len(tables), int(lengths.max())), dtype=np.int32)
    array[np.arange(array.shape[1])[None, :] < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum())
    )
    return array


def build_step(
    batch: ScheduledBatch,
    encoded: Callable[[str], torch.Tensor],
    block_size: int,
    pending_rows: dict[int, int] | None = None,
) -> tuple[StepInput, torch.Tensor | None, SamplePlan]:
    """`pending_rows`: sequence id -> its sample's row in the step still on the device (async scheduling); a
    sequence with a pending token decodes it, read there."""
    total = batch.num_tokens
    ids: list[int] = []
    fill_rows, fill_from = [], []
    positions = np.empty((3, total), dtype=np.int64)
    slots = np.empty(total, dtype=np.int64)
    mm_embeds, mm_mask = [], np.zeros(total, dtype=bool)
    logits_rows, logprob_spans = [], []
    plan = SamplePlan([], [], [])
    decode_rows, decode_positions, decode_slots = [], [], []  # written into the arrays once, below
    offset = 0
    for index, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        request = seq.request
        if seq.num_pending:  # its one new token is the pending one
            fill_rows.append(offset)
            fill_from.append(pending_rows[seq.seq_id])
            ids.append(0)
        else:
            ids += seq.token_ids[start:end]
        if n == 1 and start >= seq.num_prompt_tokens:  # decode: the common case, kept cheap
            decode_rows.append(offset)
            decode_positions.append(start + request.mrope_delta)
            decode_slots.append(seq.block_table[start // block_size] * block_size + start % block_size)
        else:
            prompt_end = min(end, seq.num_prompt_tokens)
            positions[:, offset : offset + max(prompt_end - start, 0)] = request.positions[:, start:prompt_end]
            generated = np.arange(max(start, seq.num_prompt_tokens), end)
            positions[:, offset + n - generated.size : offset + n] = generated + request.mrope_delta
            token_index = np.arange(start, end)
            slots[offset : offset + n] = (
                np.asarray(seq.block_table)[token_index // block_size] * block_size + token_index % block_size
            )
            for item in request.mm_items:
                lo, hi = max(start, item.span.start), min(end, item.end)
                if lo < hi:
                    rows = encoded(item.content_hash)
                    mm_embeds.append(rows[lo - item.span.start : hi - item.span.start])
                    mm_mask[offset + lo - start : offset + hi - start] = True
            if request.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                # rows start..end-1 predict tokens start+1..end, those inside the prompt are wanted
                count = min(end, seq.num_prompt_tokens - 1) - start
                logprob_spans.append((offset, count))
                plan.prompt_logprobs.append(
                    (index, seq.token_ids[start + 1 : start + 1 + count], seq.params.prompt_logprobs)
                )
        if end == seq.num_tokens:
            if seq.num_pending:
                plan.pending.append((len(plan.rows), fill_from[-1]))
            for fork in range(1 + seq.pending_forks):
                logits_rows.append(offset + n - 1)
                plan.owners.append((index, fork))
                sample = seq.index + fork
                plan.rows.append(
                    SampleRow(
                        seq.params,
                        seq.token_ids,
                        seq.num_prompt_tokens,
                        request.generators[sample],
                        request.stop_ids,
                        request.grammars[sample] if request.grammars and not seq.grammar_waiting else None,
                        (seq.seq_id, fork),
                    )
                )
        offset += n
    if decode_rows:
        positions[:, decode_rows] = decode_positions
        slots[decode_rows] = decode_slots
    q_lens = np.asarray(batch.num_new_tokens, dtype=np.int32)
    query_starts = np.zeros(len(batch) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=query_starts[1:])
    seq_lens = np.fromiter(
        (s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens)), dtype=np.int32, count=len(batch)
    )
    embeds = torch.cat(mm_embeds) if mm_embeds else None
    adapters: dict[LoRARequest, int] = {}
    lora_of_seq = None
    if any(seq.request.lora for seq in batch.seqs):
        lora_of_seq = np.array(
            [-1 if s.request.lora is None else adapters.setdefault(s.request.lora, len(adapters)) for s in batch.seqs],
            dtype=np.int32,
        )
    step = StepInput(
        np.asarray(ids, dtype=np.int64),
        positions,
        slots,
        query_starts,
        seq_lens,
        block_table_array([seq.block_table for seq in batch.seqs]),
        mm_mask,
        0 if embeds is None else embeds.shape[0],
        logits_rows,
        logprob_spans,
        batch.block_copies,
        list(adapters),
        lora_of_seq,
        fill_rows,
        fill_from,
    )
    return step, embeds, plan
