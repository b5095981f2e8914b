"""A scheduled batch flattened into what the model runs on.

`StepInput` is what every tensor-parallel rank needs for one step of the language model: host arrays only (token
ids, M-RoPE positions, KV slots, block tables, which rows to score), small enough to send to the other ranks each
step. The image embeddings of the step travel beside it as one tensor. `SamplePlan` stays on rank 0, which alone
samples: the sampling parameters and RNGs of the rows it scores, and the targets of prompt log-probabilities.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from fovea.core.request import LoRARequest, ScheduledBatch
from fovea.runner.input_batch import InputBatch, make_sample_row
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


def build_step(
    batch: ScheduledBatch,
    encoded: Callable[[str], torch.Tensor],
    block_size: int,
    inputs: InputBatch,
    pending_rows: dict[int, int] | None = None,
) -> tuple[StepInput, torch.Tensor | None, SamplePlan]:
    """`inputs`: the runner's rows, brought up to date with the batch. `pending_rows`: sequence id -> its sample's
    row in the step still on the device (async scheduling); a sequence with a pending token decodes it, read there."""
    seqs, total = batch.seqs, batch.num_tokens
    rows = inputs.rows(batch)
    starts = np.fromiter((seq.num_computed_tokens for seq in seqs), dtype=np.int64, count=len(seqs))
    prompt_lens = np.fromiter((seq.num_prompt_tokens for seq in seqs), dtype=np.int64, count=len(seqs))
    lengths = np.fromiter((seq.num_tokens for seq in seqs), dtype=np.int64, count=len(seqs))
    q_lens = np.asarray(batch.num_new_tokens, dtype=np.int32)
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=offsets[1:])
    ids = np.empty(total, dtype=np.int64)
    positions = np.empty((3, total), dtype=np.int64)
    slots = np.empty(total, dtype=np.int64)
    fill_rows, fill_from = [], []
    mm_embeds, mm_mask = [], np.zeros(total, dtype=bool)
    logits_rows, logprob_spans = [], []
    plan = SamplePlan([], [], [])
    # decodes, the common case: a sequence's last token, generated, one sample (forks split off after a prompt),
    # laid out together
    decode = (q_lens == 1) & (starts >= prompt_lens) & (starts + 1 == lengths)
    which = np.flatnonzero(decode)
    if which.size:
        at, start, decode_rows = offsets[which], starts[which], rows[which]
        positions[:, at] = start + inputs.mrope_deltas[decode_rows]
        slots[at] = inputs.tables[decode_rows, start // block_size] * block_size + start % block_size
        for index, offset, token_index, row in zip(which.tolist(), at.tolist(), start.tolist(), decode_rows.tolist()):
            seq = seqs[index]
            if seq.num_pending:  # its one new token is the pending one
                fill_rows.append(offset)
                fill_from.append(pending_rows[seq.seq_id])
                plan.pending.append((len(plan.rows), fill_from[-1]))
                ids[offset] = 0
            else:
                ids[offset] = seq.token_ids[token_index]
            plan.rows.append(inputs.sample_row(row, seq))
        logits_rows += at.tolist()
        plan.owners += [(index, 0) for index in which.tolist()]
    for index in np.flatnonzero(~decode).tolist():
        seq, offset, n = seqs[index], int(offsets[index]), int(q_lens[index])
        start, end = int(starts[index]), int(starts[index]) + n
        request = seq.request
        ids[offset : offset + n] = seq.token_ids[start:end]  # (a pending token is only ever a decode's)
        prompt_end = min(end, seq.num_prompt_tokens)
        positions[:, offset : offset + max(prompt_end - start, 0)] = request.positions[:, start:prompt_end]
        generated = np.arange(max(start, seq.num_prompt_tokens), end)
        positions[:, offset + n - generated.size : offset + n] = generated + request.mrope_delta
        token_index = np.arange(start, end)
        slots[offset : offset + n] = (
            inputs.tables[rows[index], token_index // block_size] * block_size + token_index % block_size
        )
        for item in request.mm_items:
            lo, hi = max(start, item.span.start), min(end, item.end)
            if lo < hi:
                embeds = encoded(item.content_hash)
                mm_embeds.append(embeds[lo - item.span.start : hi - item.span.start])
                mm_mask[offset + lo - start : offset + hi - start] = True
        if request.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
            # rows start..end-1 predict tokens start+1..end, those inside the prompt are wanted
            count = min(end, seq.num_prompt_tokens - 1) - start
            logprob_spans.append((offset, count))
            plan.prompt_logprobs.append(
                (index, seq.token_ids[start + 1 : start + 1 + count], seq.params.prompt_logprobs)
            )
        if end == seq.num_tokens:
            for fork in range(1 + seq.pending_forks):  # samples split off after the prompt: once
                logits_rows.append(offset + n - 1)
                plan.owners.append((index, fork))
                plan.rows.append(inputs.sample_row(int(rows[index]), seq) if fork == 0 else make_sample_row(seq, fork))
    query_starts = offsets.astype(np.int32)
    seq_lens = (starts + q_lens).astype(np.int32)
    embeds = torch.cat(mm_embeds) if mm_embeds else None
    adapters: dict[LoRARequest, int] = {}
    lora_of_seq = None
    if any(seq.request.lora for seq in batch.seqs):
        lora_of_seq = np.array(
            [-1 if s.request.lora is None else adapters.setdefault(s.request.lora, len(adapters)) for s in batch.seqs],
            dtype=np.int32,
        )
    step = StepInput(
        ids,
        positions,
        slots,
        query_starts,
        seq_lens,
        inputs.block_tables(rows),
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
