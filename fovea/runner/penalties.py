"""allowed_token_ids, logit_bias, min_tokens and bad_words bans and the repetition / frequency / presence
penalties, applied in place to a step's logits (the sampler's first stage), and the per-sample token sets the
penalties read, kept between steps.

Penalties touch only the (row, token) entries a row has seen: no vocabulary-wide count tensors. Which entries those
are is kept per sample (`SeenTokens`): the prompt's distinct ids once on the device, the generated ids on the host,
extended by the tokens added since the last step. Rebuilding both from each sequence's token list every step was
O(context) host work per row: ~136k ids a step at 16 x 8k tokens, 2-6 ms of every decode step.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from fovea.core.host_copy import to_device

if TYPE_CHECKING:
    from fovea.core.sampling_params import SamplingParams
    from fovea.runner.sampler import SampleRow


def penalized(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or bool(params.frequency_penalty) or bool(params.presence_penalty)


class SeenTokens:
    """One sample's tokens as its penalties need them: `prompt` (device, int64) its prompt's distinct ids, and
    `output()` (host) the ids it generated, in order, repeats kept (the frequency penalty counts them). Ids outside
    the vocabulary (no logit to change) are left out."""

    def __init__(self, row: SampleRow, vocab: int, device: torch.device):
        self.vocab = vocab
        prompt = np.unique(np.asarray(row.prompt_ids, dtype=np.int64))
        # a plain copy would wait for the queued forward: a new sample (nearly every step under image traffic)
        # would cost the step its overlap with the next one
        self.prompt = to_device(prompt[(prompt >= 0) & (prompt < vocab)], None, device)
        self.generated = np.empty(64, dtype=np.int64)
        self.num_generated = 0  # entries of `generated` filled
        self.num_read = 0  # output tokens of the row already read (out-of-vocabulary ones included)

    def output(self, row: SampleRow) -> np.ndarray:
        """The generated ids, after reading the ones the row gained since the last call."""
        start = row.num_prompt_tokens + self.num_read
        if len(row.token_ids) == start + 1 and self.num_generated < self.generated.size:  # one new token: the usual
            token = row.token_ids[start]
            self.num_read += 1
            if 0 <= token < self.vocab:
                self.generated[self.num_generated] = token
                self.num_generated += 1
            return self.generated[: self.num_generated]
        new = row.token_ids[start:]
        if len(new):
            ids = np.asarray(new, dtype=np.int64)
            ids = ids[(ids >= 0) & (ids < self.vocab)]
            end = self.num_generated + ids.size
            if end > self.generated.size:
                self.generated = np.resize(self.generated, max(2 * self.generated.size, end))
            self.generated[self.num_generated : end] = ids
            self.num_generated, self.num_read = end, self.num_read + len(new)
        return self.generated[: self.num_generated]


def banned_tokens(row: SampleRow) -> list[int]:
    """What the row may not draw now: its stop tokens while it has fewer than min_tokens, and the last token of
    each bad word whose other tokens its output ends with (a one-token word's always), as vLLM bans them (generated
    tokens only, the prompt's not)."""
    tokens, params = row.token_ids, row.params
    generated = len(tokens) - row.num_prompt_tokens
    banned = list(row.stop_ids) if generated < params.min_tokens else []
    for ids in params.bad_words_token_ids:
        head = len(ids) - 1
        if head == 0 or (generated >= head and list(tokens[len(tokens) - head :]) == ids[:head]):
            banned.append(ids[-1])
    return banned


def column(rows: list[SampleRow], getter, dtype, device) -> torch.Tensor:
    """One sampling parameter of every row, as a device tensor (`getter` reads it off a row's SamplingParams)."""
    return to_device([getter(r.params) for r in rows], dtype, device)


@dataclass
class SeenKeys:
    """Flat (row * vocab + token) positions in a step's logits of the penalized rows' seen tokens, each with its
    row: `keys` the prompt-or-generated ones, `generated` the generated ones (repeats kept)."""

    keys: torch.Tensor
    key_rows: torch.Tensor
    generated: torch.Tensor
    generated_rows: torch.Tensor


def _seen_keys(rows: list[int], prompts: list[torch.Tensor], outputs: list[np.ndarray], vocab: int, device) -> SeenKeys:
    """`rows`: the penalized rows' indices in the batch; `prompts`, `outputs`: their SeenTokens'."""
    counts = [p.numel() for p in prompts]
    prompt_rows = torch.repeat_interleave(
        to_device(rows, torch.long, device), to_device(counts, torch.long, device), output_size=sum(counts)
    )
    prompt_keys = torch.cat(prompts) + prompt_rows * vocab
    row_of_output = np.repeat(np.asarray(rows, dtype=np.int64), [len(o) for o in outputs])
    generated_rows = to_device(row_of_output, torch.long, device)
    generated = to_device(np.concatenate(outputs) + row_of_output * vocab, torch.long, device)
    return SeenKeys(
        torch.cat([prompt_keys, generated]), torch.cat([prompt_rows, generated_rows]), generated, generated_rows
    )


def _with_pending(found: SeenKeys, rows: list[SampleRow], pending: tuple, vocab: int, device) -> SeenKeys:
    which = [k for k, row in enumerate(pending[0]) if penalized(rows[row].params)]
    if not which:
        return found
    key_rows = to_device([pending[0][k] for k in which], torch.long, device)
    keys = key_rows * vocab + pending[1].index_select(0, to_device(which, torch.long, device))
    return SeenKeys(
        torch.cat([found.keys, keys]),
        torch.cat([found.key_rows, key_rows]),
        torch.cat([found.generated, keys]),
        torch.cat([found.generated_rows, key_rows]),
    )


def apply_penalties_and_bias(
    logits: torch.Tensor, rows: list[SampleRow], seen: dict | None = None, pending: tuple | None = None
) -> None:
    """Applies allowed_token_ids, logit_bias, min_tokens and bad_words bans and the penalties to `logits` in place
    (the step's logits are read only by the sampler, which takes log-probabilities before this). Only the entries
    changed are touched: at batch 256 the seen tokens are ~256k entries scattered over a 150 MB batch, each a cache
    miss on the CPU, so they are read once and written once. `seen`: the caller's SeenTokens by row key, kept across
    steps; without it they are built for this call. `pending`: (rows, their tokens on the device) sampled by the
    step still on the device and not yet in the rows' token lists (async scheduling): seen too."""
    vocab = logits.shape[1]
    device = logits.device
    bias = [
        (i * vocab + t, b) for i, r in enumerate(rows) for t, b in (r.params.logit_bias or {}).items() if 0 <= t < vocab
    ]
    banned = [
        i * vocab + t for i, r in enumerate(rows) if r.params.bans_tokens for t in banned_tokens(r) if 0 <= t < vocab
    ]
    rows_penalized = [i for i, r in enumerate(rows) if penalized(r.params)]
    flat = logits.view(-1)
    allowed = [(i, r.params.allowed_token_ids) for i, r in enumerate(rows) if r.params.allowed_token_ids]
    if allowed:  # every other token -inf: the allowed ones' logits kept, the row filled, they put back
        keys = to_device([i * vocab + t for i, ids in allowed for t in ids], torch.long, device)
        kept = flat.index_select(0, keys)
        logits[to_device([i for i, _ in allowed], torch.long, device)] = float("-inf")
        flat.index_copy_(0, keys, kept)
    if bias:
        keys = to_device([k for k, _ in bias], torch.long, device)
        flat.index_put_((keys,), to_device([b for _, b in bias], logits.dtype, device), accumulate=True)
    if banned:
        flat[to_device(banned, torch.long, device)] = float("-inf")
    if not rows_penalized:
        return
    prompts, outputs = [], []
    for i in rows_penalized:
        row = rows[i]
        tokens = None if seen is None or row.key is None else seen.get(row.key)
        if tokens is None:
            tokens = SeenTokens(row, vocab, device)
            if seen is not None and row.key is not None:
                seen[row.key] = tokens
        prompts.append(tokens.prompt)
        outputs.append(tokens.output(row))
    found = _seen_keys(rows_penalized, prompts, outputs, vocab, device)
    if pending is not None:
        found = _with_pending(found, rows, pending, vocab, device)
    # index_select / index_copy_ rather than flat[keys]: on the CPU they read and write the scattered entries 2.5x
    # and 1.5x as fast. Keys repeat (a token seen twice): each copy reads the same value and writes the same
    # result, and the frequency penalty accumulates once per occurrence, so no unique() (a sort of every key)
    params = lambda name: column(rows, operator.attrgetter(name), logits.dtype, device)  # noqa: E731
    values, rep = flat.index_select(0, found.keys), params("repetition_penalty").index_select(0, found.key_rows)
    flat.index_copy_(0, found.keys, torch.where(values > 0, values / rep, values * rep))
    if not found.generated.numel():
        return
    if any(rows[i].params.frequency_penalty for i in rows_penalized):
        flat.index_add_(0, found.generated, -params("frequency_penalty").index_select(0, found.generated_rows))
    if any(rows[i].params.presence_penalty for i in rows_penalized):
        presence = params("presence_penalty").index_select(0, found.generated_rows)
        flat.index_copy_(0, found.generated, flat.index_select(0, found.generated) - presence)
