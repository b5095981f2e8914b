"""From the last hidden state's logits to the next token of every sequence in the batch, in a few batched ops.

Order, as in vLLM: log-probabilities are taken from the model's raw logits; then logit_bias, min_tokens (stop
tokens banned), repetition/frequency/presence penalties; greedy rows take the argmax; the others are divided by
their temperature, filtered by top_k, top_p and min_p, and drawn with the exponential-race trick
(argmax(p / E), E ~ Exp(1)), which needs one noise tensor instead of a multinomial per row. A request with a
seed draws its noise from its own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fovea.engine.sampling_params import SamplingParams


@dataclass
class SampleRow:
    """One token to draw: the parameters, the sequence's tokens so far (not copied), its RNG."""
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None
    stop_ids: tuple[int, ...]  # banned while fewer than min_tokens are generated

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # (R,)
    logprobs: torch.Tensor | None = None  # (R,) raw logprob of the sampled token
    ranks: torch.Tensor | None = None  # (R,)
    top_ids: torch.Tensor | None = None  # (R, k)
    top_logprobs: torch.Tensor | None = None  # (R, k)


def top_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int):
    """Log-probability and rank of `token_ids` in each row, and each row's k most likely tokens."""
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0]
    ranks = (logprobs > chosen[:, None]).sum(-1) + 1
    top = logprobs.topk(k, dim=-1) if k else None
    return chosen, ranks, (top.indices if top else None), (top.values if top else None)


def _padded(rows: list[list[int]], fill: int, device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def _column(rows: list[SampleRow], getter, dtype, device) -> torch.Tensor:
    return torch.tensor([getter(r.params) for r in rows], dtype=dtype, device=device)


def apply_penalties_and_bias(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    num_rows, vocab = logits.shape
    device = logits.device
    bias = [(i, t, b) for i, r in enumerate(rows) for t, b in (r.params.logit_bias or {}).items() if 0 <= t < vocab]
    if bias:
        i, t, b = zip(*bias)
        logits = logits.index_put((torch.tensor(i, device=device), torch.tensor(t, device=device)),
                                  torch.tensor(b, dtype=logits.dtype, device=device), accumulate=True)
    banned = [(i, t) for i, r in enumerate(rows) if len(r.token_ids) - r.num_prompt_tokens < r.params.min_tokens for t in r.stop_ids]
    if banned:
        i, t = zip(*banned)
        logits = logits.index_put((torch.tensor(i, device=device), torch.tensor(t, device=device)),
                                  torch.tensor(float("-inf"), dtype=logits.dtype, device=device))
    params = [r.params for r in rows]
    if any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in params):
        # counts over a spare column `vocab` that padding lands in, cut off afterwards
        outputs = _padded([r.output_ids for r in rows], vocab, device)
        counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=device)
        counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=logits.dtype))
        counts = counts[:, :vocab]
        seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, _padded([r.prompt_ids for r in rows], vocab, device), True)
        seen = seen[:, :vocab] | (counts > 0)
        rep = _column(rows, lambda p: p.repetition_penalty, logits.dtype, device)[:, None]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
        logits = logits - _column(rows, lambda p: p.frequency_penalty, logits.dtype, device)[:, None] * counts
        logits = logits - _column(rows, lambda p: p.presence_penalty, logits.dtype, device)[:, None] * (counts > 0)
    return logits


def filter_logits(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """top_k, top_p and min_p, each a no-op for rows that leave it at its default."""
    device, vocab = logits.device, logits.shape[1]
    top_k = _column(rows, lambda p: p.top_k or vocab, torch.long, device).clamp(max=vocab)
    top_p = _column(rows, lambda p: p.top_p, logits.dtype, device)
    if bool((top_p < 1).any()):
        ordered, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        ordered = ordered.masked_fill(rank >= top_k[:, None], float("-inf"))
        probs = ordered.softmax(-1)
        # drop a token when the tokens ranked above it already cover top_p (the first always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    elif bool((top_k < vocab).any()):
        kth = logits.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    min_p = _column(rows, lambda p: p.min_p, logits.dtype, device)
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}  # unseeded requests share one per device

    def _noise(self, shape, rows: list[SampleRow], device) -> torch.Tensor:
        if device not in self.generators:
            self.generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        noise = torch.empty(shape, device=device).exponential_(generator=self.generators[device])
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i].exponential_(generator=row.generator)
        return noise

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        logits = logits.float()
        max_logprobs = max((r.params.logprobs or 0) for r in rows)
        wants_logprobs = any(r.params.logprobs is not None for r in rows)
        raw_logprobs = logits.log_softmax(-1) if wants_logprobs else None
        logits = apply_penalties_and_bias(logits, rows)
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            tokens = logits.argmax(-1)
        else:
            temperature = _column(rows, lambda p: p.temperature if not p.greedy else 1.0, logits.dtype, logits.device)
            probs = filter_logits(logits / temperature[:, None], rows).softmax(-1)
            tokens = (probs / self._noise(probs.shape, rows, logits.device)).argmax(-1)
            if any(greedy):
                tokens = torch.where(torch.tensor(greedy, device=logits.device), logits.argmax(-1), tokens)
        if raw_logprobs is None:
            return SamplerOutput(tokens)
        return SamplerOutput(tokens, *top_logprobs(raw_logprobs, tokens, max_logprobs))
