"""From the last hidden state's logits to the next token of every sequence in the batch, in a few batched ops.

Order, as in vLLM: log-probabilities are taken from the model's raw logits; then logit_bias, min_tokens (stop
tokens banned), repetition/frequency/presence penalties; greedy rows take the argmax; the others are divided by
their temperature, filtered by top_k, top_p and min_p, and drawn with the exponential-race trick
(argmax(p / E), E ~ Exp(1)), which needs one noise tensor instead of a multinomial per row. A request with a
seed draws its noise from its own generator, so its tokens do not depend on what else is in the batch.

Two things keep a step cheap with a 150k vocabulary: penalties touch only the tokens a row has seen (penalties.py),
and top_k / top_p are resolved among each row's best `CANDIDATES` tokens (one topk instead of a sort of the whole vocabulary);
only a row whose top_p cut falls outside them sorts its full row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fovea.core.sampling_params import SamplingParams
from fovea.runner.grammar_masks import GrammarMasks
from fovea.runner.penalties import SeenTokens, apply_penalties_and_bias, column

CANDIDATES = 256  # best tokens in which a top_p-only row looks for its cut first
MAX_CANDIDATE_TOP_K = 1024  # rows with a larger top_k take the full-vocabulary path


@dataclass
class SampleRow:
    """One token to draw: the parameters, the sequence's tokens so far (not copied), its RNG."""

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None
    stop_ids: tuple[int, ...]  # banned while fewer than min_tokens are generated
    grammar: object | None = None  # structured outputs: the sample's llguidance matcher
    key: tuple | None = None  # (sequence id, fork): names the sample across steps (the penalties' SeenTokens)

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


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
    # summed as int32: the default int64 sum (or count_nonzero) of the (rows x vocab) comparison is 2x slower
    ranks = (logprobs > chosen[:, None]).sum(-1, dtype=torch.int32) + 1
    top = logprobs.topk(k, dim=-1) if k else None
    return chosen, ranks, (top.indices if top else None), (top.values if top else None)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    if not bool((min_p > 0).any()):
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))


def filter_logits(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """top_k, top_p and min_p over whole rows (sorting the vocabulary when top_p is set): the reference the
    candidate path below must agree with, and the path of rows it cannot resolve."""
    device, vocab = logits.device, logits.shape[1]
    top_k = column(rows, lambda p: min(p.top_k or vocab, vocab), torch.long, device)  # any int, clamped first
    top_p = column(rows, lambda p: p.top_p, logits.dtype, device)
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
    return _apply_min_p(logits, column(rows, lambda p: p.min_p, logits.dtype, device))


def filter_candidates(logits: torch.Tensor, temperature: torch.Tensor, rows: list[SampleRow]):
    """The same filters among each row's best K tokens of `logits` (not yet divided by `temperature`, which keeps
    their order): (filtered values / temperature (R, K), their token ids (R, K), which rows this settled). A row
    is settled when its top_k is at most K, or when its best K tokens already cover its top_p (every token after
    them would be dropped anyway)."""
    device, vocab = logits.device, logits.shape[1]
    top_k = [min(r.params.top_k or vocab, vocab) for r in rows]
    width = min(vocab, max(k if k < vocab else CANDIDATES for k in top_k))
    values, ids = logits.topk(width, dim=-1)
    values = values / temperature[:, None]
    rank = torch.arange(width, device=device)[None, :]
    values = values.masked_fill(rank >= torch.tensor(top_k, device=device)[:, None], float("-inf"))
    has_top_k = torch.tensor([k <= width for k in top_k], device=device)
    # probabilities before top_p: over the top_k survivors, or over the whole vocabulary without a top_k
    normalizer = values.logsumexp(-1)
    if not bool(has_top_k.all()):  # a whole-row reduction, only for the rows that need it
        whole = (~has_top_k).nonzero()[:, 0]
        normalizer[whole] = (logits[whole] / temperature[whole, None]).logsumexp(-1)
    probs = (values - normalizer[:, None]).exp()
    top_p = column(rows, lambda p: p.top_p, logits.dtype, device)
    settled = has_top_k | (probs.sum(-1) >= top_p)
    drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
    values = _apply_min_p(
        values.masked_fill(drop, float("-inf")), column(rows, lambda p: p.min_p, logits.dtype, device)
    )
    return values, ids, settled


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}  # unseeded requests share one per device
        self.seen: dict[tuple, SeenTokens] = {}  # penalized samples' tokens by row key, for the rows of the last step

    def _noise(self, shape, rows: list[SampleRow], vocab: int, device, ids: torch.Tensor | None = None):
        """Exp(1) noise; a seeded row always draws a whole vocabulary's worth from its own generator (gathered at
        `ids` on the candidate path), so which path its row takes cannot change its tokens."""
        if device not in self.generators:
            self.generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        noise = torch.empty(shape, device=device).exponential_(generator=self.generators[device])
        for i, row in enumerate(rows):
            if row.generator is not None:
                own = torch.empty(vocab, device=device).exponential_(generator=row.generator)
                noise[i] = own if ids is None else own[ids[i]]
        return noise

    def _draw(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Tokens for sampled (non-greedy) rows."""
        device, vocab = logits.device, logits.shape[1]
        temperature = column(rows, lambda p: p.temperature, logits.dtype, device)
        tokens = torch.empty(len(rows), dtype=torch.long, device=device)
        top_k = [min(r.params.top_k or vocab, vocab) for r in rows]
        narrowed = [
            i
            for i, (k, r) in enumerate(zip(top_k, rows))
            if k < vocab and k <= MAX_CANDIDATE_TOP_K or r.params.top_p < 1 and k == vocab
        ]
        rest = [i for i in range(len(rows)) if i not in set(narrowed)]
        if narrowed:
            index = torch.tensor(narrowed, device=device)
            values, ids, settled = filter_candidates(
                _take(logits, narrowed, index), temperature[index], [rows[i] for i in narrowed]
            )
            keep = [j for j, ok in enumerate(settled.tolist()) if ok]
            rest += [narrowed[j] for j, ok in enumerate(settled.tolist()) if not ok]
            if keep:
                keep_index = torch.tensor(keep, device=device)
                subset, ids = [rows[narrowed[j]] for j in keep], ids[keep_index]
                probs = values[keep_index].softmax(-1)
                chosen = (probs / self._noise(probs.shape, subset, vocab, device, ids)).argmax(-1, keepdim=True)
                tokens[index[keep_index]] = ids.gather(1, chosen)[:, 0]
        if rest:
            index = torch.tensor(sorted(rest), device=device)
            subset = [rows[i] for i in sorted(rest)]
            probs = filter_logits(_take(logits, rest, index) / temperature[index, None], subset).softmax(-1)
            tokens[index] = argmax(probs / self._noise(probs.shape, subset, vocab, device))
        return tokens

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow], masks: GrammarMasks | None = None) -> SamplerOutput:
        """`masks`: the rows' structured-output masks, started before the forward pass (else filled here)."""
        logits = logits.float().contiguous()
        max_logprobs = max((r.params.logprobs or 0) for r in rows)
        wants_logprobs = any(r.params.logprobs is not None for r in rows)
        raw_logprobs = logits.log_softmax(-1) if wants_logprobs else None
        # structured-output rows are masked in place and stay so (the engine's logits buffer is rewritten every step)
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        # only this step's samples stay: a sequence that is not in a step (finished, preempted) is rebuilt if it returns
        self.seen = {r.key: self.seen[r.key] for r in rows if r.key in self.seen}
        undo = apply_penalties_and_bias(logits, rows, self.seen)
        if constrained:
            (masks or GrammarMasks.start([r.grammar for r in rows], logits.shape[1])).apply(logits)
        try:
            sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
            if len(sampled) < len(rows):
                tokens = argmax(logits)
            else:
                tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            if sampled:
                index = torch.tensor(sampled, device=logits.device)
                tokens[index] = self._draw(_take(logits, sampled, index), [rows[i] for i in sampled])
        finally:
            undo()  # the caller's logits as they were
        if constrained:
            chosen = tokens[torch.tensor(constrained, device=tokens.device)].tolist()
            for i, token in zip(constrained, chosen):
                rows[i].grammar.consume_token(token)
        if raw_logprobs is None:
            return SamplerOutput(tokens)
        return SamplerOutput(tokens, *top_logprobs(raw_logprobs, tokens, max_logprobs))


ARGMAX_BLOCK = 128  # vocabularies are multiples of it (Qwen's 151,936 and 152,064; 64 for LLaVA's 32,064 works too)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first index of its largest value, as torch.argmax. On the CPU torch's argmax reads a row at a
    fifth of the memory speed that amax does (89 ms against 14 ms for 256 x 151,936 fp32, one thread); here amax
    finds each block's maximum, then argmax runs over the block maxima and inside the one block that holds the
    first maximum: 18 ms, the same indices."""
    rows, width = x.shape
    block = next((b for b in (ARGMAX_BLOCK, 64, 32) if width % b == 0), None)
    if x.device.type != "cpu" or block is None or width < 8 * block:
        return x.argmax(-1)
    blocks = x.contiguous().view(rows, width // block, block)
    block_max = blocks.amax(-1)
    first = (block_max == block_max.amax(-1, keepdim=True)).byte().argmax(-1)  # the first block holding it
    return first * block + blocks[torch.arange(rows), first].argmax(-1)


def _take(logits: torch.Tensor, rows: list[int], index: torch.Tensor) -> torch.Tensor:
    """logits[index], without the copy when that is every row in order."""
    return logits if rows == list(range(logits.shape[0])) else logits[index]
