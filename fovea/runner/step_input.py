"""What the scheduler tells the runner about a step, and that step flattened into what the model runs on.

`ScheduledStep` is the scheduler's description of one step: the sequences it runs and how many tokens each, with
everything about a sequence the runner has no row for yet (`NewSequence`, sent once) and, for the others, only what
changed (blocks appended, rows to drop). The runner keeps its rows (runner/input_batch.py) and never reads the
engine's objects. `StepInput` is what every tensor-parallel rank needs for one step of the language model: host
arrays only (token ids, M-RoPE positions, KV slots, block tables, which rows to score), small enough to send to the
other ranks each step. The image embeddings of the step travel beside it as one tensor. `SamplePlan` stays on rank
0, which alone samples: the sampling parameters and RNGs of the rows it scores, and the targets of prompt
log-probabilities.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from fovea.core.request import LoRARequest, MMItem
from fovea.core.sampling_params import SamplingParams
from fovea.runner.input_batch import InputBatch, RowTokens, make_sample_row
from fovea.runner.sampler import SampleRow


@dataclass
class NewSequence:
    """A sequence the runner has no row for (new, forked, or relaid: its row was dropped), with all the runner reads
    of it. The token ids are the ones known on the host: a sequence is never sent with a sample still on the device."""

    seq_id: int
    token_ids: list[int]  # the runner copies them
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose KV is in the cache (a cached prefix, or computed before it was relaid)
    block_table: list[int]
    positions: np.ndarray  # (3, prompt length) M-RoPE positions of the prompt
    mrope_delta: int  # what a generated token adds to its index: its position
    mm_items: list[MMItem]
    params: SamplingParams
    index: int  # which of its request's samples it is
    generators: list  # the request's RNGs, one per sample (None: unseeded)
    grammars: list | None  # the request's grammar matchers, one per sample, once its structured output has begun
    stop_ids: tuple[int, ...]  # banned while fewer than min_tokens are generated
    forks: int  # samples that split off it after its prompt's last token (n > 1)
    prompt_logprobs: int | None  # top-k of the prompt's log-probabilities, where asked for
    lora: LoRARequest | None


@dataclass
class ScheduledStep:
    """One step as the scheduler decides it: the sequences in order, and what the runner does not know of them."""

    seq_ids: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # of each sequence, this step
    new: list[NewSequence] = field(default_factory=list)  # those the runner has no row for, their data once
    new_blocks: list[tuple[int, list[int]]] = field(default_factory=list)  # (sequence id, blocks appended)
    # sequences whose rows the runner drops before the step: finished, preempted, isolated, given cached blocks in
    # place of their own, or changed otherwise; one that runs again comes back among `new`
    relaid: list[int] = field(default_factory=list)
    encode: list[MMItem] = field(default_factory=list)  # images to hand to the encoder (ImageEncoder)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) KV blocks, forks' partial blocks
    dropped_loras: list[int] = field(default_factory=list)  # ids of unloaded adapters whose weights go

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seq_ids)


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
    dropped_loras: list[int] = field(default_factory=list)  # adapters every rank frees before the step
    # by sequence (its index in the step): (first, end) prompt positions of the images its chunk holds
    image_spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

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
    owners: list[int]  # the batch index of each logits row's sequence
    prompt_logprobs: list[tuple[int, list[int], int]]  # per logprob span: (batch index, target ids, top k)
    # the fork number of each logits row: 0 for the sequence itself, k > 0 for its k-th new one (n > 1)
    forks: list[int] = field(default_factory=list)
    # (logits row, its sequence's sample row in the step on the device): the penalties count that token too
    pending: list[tuple[int, int]] = field(default_factory=list)
    sampled_rows: list[int] = field(default_factory=list)  # the runner's row of each logits row, -1 for a fork
    # the samples of the step's sequences (not forks): their index among the samples, rows and sequence ids
    sample_index: np.ndarray | None = None
    sample_rows: np.ndarray | None = None
    sample_seq_ids: np.ndarray | None = None
    num_dropped: int = 0  # InputBatch.num_dropped when the step was built


def build_step(
    step: ScheduledStep,
    encoded: Callable[[str], torch.Tensor],
    block_size: int,
    inputs: InputBatch,
    pending_from: np.ndarray | None = None,
) -> tuple[StepInput, torch.Tensor | None, SamplePlan, np.ndarray]:
    """`inputs`: the runner's rows, brought up to date with the step here. `pending_from`: by row, its sample's
    row in the step still on the device (async scheduling); a row with a sample there decodes it, read there.
    Also returns the step's rows."""
    rows, total = inputs.update(step), step.num_tokens
    starts, prompt_lens = inputs.computed[rows], inputs.prompt_lens[rows]
    lengths = inputs.known[rows] + inputs.pending[rows]
    q_lens = np.asarray(step.num_new_tokens, dtype=np.int32)
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=offsets[1:])
    ids = np.empty(total, dtype=np.int64)
    positions = np.empty((3, total), dtype=np.int64)
    slots = np.empty(total, dtype=np.int64)
    fill_rows, fill_from = [], []
    mm_embeds, mm_mask, image_spans = [], np.zeros(total, dtype=bool), {}
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
        pending = inputs.pending[decode_rows] > 0  # its one new token is the sample on the device
        if pending.any():
            fill_rows, fill_from = at[pending].tolist(), pending_from[decode_rows[pending]].tolist()
            plan.pending = list(zip(np.flatnonzero(pending).tolist(), fill_from))
            ids[at[pending]] = 0
        known = ~pending
        ids[at[known]] = inputs.tokens[decode_rows[known], start[known]]
        decode_rows_list = decode_rows.tolist()
        plan.rows += [inputs.first_samples[row] for row in decode_rows_list]
        plan.sampled_rows += decode_rows_list
        logits_rows += at.tolist()
        plan.owners += which.tolist()
        plan.forks += [0] * which.size
    for index in np.flatnonzero(~decode).tolist():
        row, offset, n = int(rows[index]), int(offsets[index]), int(q_lens[index])
        seq, tokens = inputs.seqs[row], inputs.tokens[row]
        start, end = int(starts[index]), int(starts[index]) + n
        ids[offset : offset + n] = tokens[start:end]  # (a pending token is only ever a decode's)
        prompt_end = min(end, seq.num_prompt_tokens)
        positions[:, offset : offset + max(prompt_end - start, 0)] = seq.positions[:, start:prompt_end]
        generated = np.arange(max(start, seq.num_prompt_tokens), end)
        positions[:, offset + n - generated.size : offset + n] = generated + seq.mrope_delta
        token_index = np.arange(start, end)
        slots[offset : offset + n] = (
            inputs.tables[row, token_index // block_size] * block_size + token_index % block_size
        )
        for item in seq.mm_items:
            lo, hi = max(start, item.span.start), min(end, item.end)
            if lo < hi:
                embeds = encoded(item.content_hash)
                mm_embeds.append(embeds[lo - item.span.start : hi - item.span.start])
                mm_mask[offset + lo - start : offset + hi - start] = True
                image_spans.setdefault(index, []).append((item.span.start, item.end))
        if seq.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
            # rows start..end-1 predict tokens start+1..end, those inside the prompt are wanted
            count = min(end, seq.num_prompt_tokens - 1) - start
            logprob_spans.append((offset, count))
            plan.prompt_logprobs.append((index, tokens[start + 1 : start + 1 + count].tolist(), seq.prompt_logprobs))
        if end == lengths[index]:
            forks, seq.forks = seq.forks, 0  # samples split off after the prompt: once
            for fork in range(1 + forks):
                logits_rows.append(offset + n - 1)
                plan.owners.append(index)
                plan.forks.append(fork)
                plan.rows.append(
                    inputs.first_samples[row] if fork == 0 else make_sample_row(seq, RowTokens(inputs, row), fork)
                )
                plan.sampled_rows.append(-1 if fork else row)
    inputs.computed[rows] += q_lens
    sampled_rows = np.asarray(plan.sampled_rows, dtype=np.int64)
    plan.sample_index = np.flatnonzero(sampled_rows >= 0)
    plan.sample_rows = sampled_rows[plan.sample_index]
    plan.sample_seq_ids = inputs.seq_ids[plan.sample_rows]
    inputs.pending[plan.sample_rows] += 1  # until the engine reads them (InputBatch.record)
    plan.num_dropped = inputs.num_dropped
    query_starts = offsets.astype(np.int32)
    seq_lens = (starts + q_lens).astype(np.int32)
    embeds = torch.cat(mm_embeds) if mm_embeds else None
    adapters: dict[LoRARequest, int] = {}
    lora_of_seq = None
    if inputs.num_lora_rows:
        seqs = [inputs.seqs[row] for row in rows.tolist()]
        lora_of_seq = np.array(
            [-1 if seq.lora is None else adapters.setdefault(seq.lora, len(adapters)) for seq in seqs], dtype=np.int32
        )
    step_input = StepInput(
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
        step.block_copies,
        list(adapters),
        lora_of_seq,
        fill_rows,
        fill_from,
        step.dropped_loras,
        image_spans,
    )
    return step_input, embeds, plan, rows
