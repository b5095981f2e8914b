"""Sampler: filters hold statistically, penalties follow their definitions, seeds are batch-independent."""

from __future__ import annotations

import math

import pytest
import torch

from fovea.core.sampling_params import SamplingParams
from fovea.runner.penalties import apply_penalties_and_bias, penalized
from fovea.runner.sampler import Sampler, SampleRow

DRAWS = 4000


def rows(params: SamplingParams, count: int, prompt=(), output=(), stop_ids=(), generator=None):
    return [
        SampleRow(params, list(prompt) + list(output), len(prompt), generator, tuple(stop_ids)) for _ in range(count)
    ]


def logits_of(probs: list[float], vocab: int = 10) -> torch.Tensor:
    full = torch.full((vocab,), 1e-9)
    full[: len(probs)] = torch.tensor(probs)
    return full.log()


def draw(params: SamplingParams, probs: list[float]) -> torch.Tensor:
    logits = logits_of(probs).expand(DRAWS, -1).clone()
    return Sampler(seed=1)(logits, rows(params, DRAWS)).token_ids


def frequencies(tokens: torch.Tensor, vocab: int = 10) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


PROBS = [0.5, 0.3, 0.15, 0.05]


def test_plain_sampling_follows_the_distribution():
    freq = frequencies(draw(SamplingParams(temperature=1.0), PROBS))
    assert torch.allclose(freq[:4], torch.tensor(PROBS), atol=0.03)


def test_top_k_never_draws_outside_the_k_best():
    freq = frequencies(draw(SamplingParams(temperature=1.0, top_k=2), PROBS))
    assert freq[2:].sum() == 0
    assert torch.allclose(freq[:2], torch.tensor([0.625, 0.375]), atol=0.03)


def test_top_p_keeps_the_smallest_set_covering_p():
    # 0.5 + 0.3 = 0.8 covers top_p = 0.8: tokens 2 and 3 are cut
    freq = frequencies(draw(SamplingParams(temperature=1.0, top_p=0.8), PROBS))
    assert freq[2:].sum() == 0 and freq[1] > 0.3
    freq = frequencies(draw(SamplingParams(temperature=1.0, top_p=0.81), PROBS))
    assert freq[2] > 0.05 and freq[3] == 0


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    freq = frequencies(draw(SamplingParams(temperature=1.0, min_p=0.2), PROBS))  # threshold 0.1
    assert freq[3] == 0 and freq[2] > 0.1


def test_low_temperature_sharpens_and_zero_is_argmax():
    freq = frequencies(draw(SamplingParams(temperature=0.2), PROBS))
    assert freq[0] > 0.9
    assert (draw(SamplingParams(temperature=0), PROBS) == 0).all()


def test_top_k_one_is_the_argmax_after_penalties_and_bias():
    """top_k 1 (Qwen2.5-VL's generation_config) takes the greedy path: the best token once penalties and bias are
    applied, whatever temperature, top_p, min_p or seed say. Penalties and bias go into the logits in place and
    stay: the engine rewrites its logits buffer every step, and nothing reads it after the sampler."""
    logits = torch.tensor([[2.0, 1.9, 0.5, -1.0]]).expand(6, -1).clone()
    generator = torch.Generator().manual_seed(5)
    params = [
        SamplingParams(temperature=t, top_k=1, top_p=p, min_p=m, repetition_penalty=1.5)
        for t, p, m in ((0.1, 0.001, 0.0), (1.5, 1.0, 0.0), (2.0, 0.5, 0.3))
    ]
    batch = [SampleRow(p, [0, 0], 1, generator if i else None, ()) for i, p in enumerate(params)]  # 0 was seen
    batch += [SampleRow(p.clone(logit_bias={2: 5.0}), [3], 1, None, ()) for p in params]
    assert Sampler(seed=2)(logits, batch).token_ids.tolist() == [1, 1, 1, 2, 2, 2]
    assert logits[:3, 0].tolist() == pytest.approx([2.0 / 1.5] * 3) and logits[3:, 2].tolist() == [5.5] * 3


def test_penalties_change_logits_as_defined():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # token 0 in the prompt; token 2 generated twice, token 4 once
    got = logits.clone()
    apply_penalties_and_bias(got, rows(params, 1, prompt=[0], output=[2, 2, 4]))
    got = got[0]
    expected = [2.0 / 2, -1.0, 0.5 / 2 - 0.5 * 2 - 0.25, 3.0, -2.0 * 2 - 0.5 - 0.25]
    assert got.tolist() == pytest.approx(expected)


def test_logit_bias_and_min_tokens():
    logits = torch.zeros(2, 6)
    biased = rows(SamplingParams(logit_bias={3: 5.0, "4": -1.0}), 1)
    held = rows(SamplingParams(min_tokens=2), 1, prompt=[1], output=[2], stop_ids=[5, 0])
    got = logits.clone()
    apply_penalties_and_bias(got, biased + held)
    assert got[0].tolist() == [0, 0, 0, 5.0, -1.0, 0]
    assert got[1, 5] == -math.inf and got[1, 0] == -math.inf and got[1, 1:5].eq(0).all()


def test_allowed_token_ids_leave_only_those_tokens():
    """vLLM's allowed_token_ids: every other token's logit is -inf, the allowed ones keep theirs (bias and penalties
    still apply to them); a row without it is untouched, and draws come only from the allowed set."""
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.5, -1.0, 4.0], [3.0, 1.0, 2.0, 0.5, -1.0, 4.0]])
    allowed = rows(SamplingParams(allowed_token_ids=[1, 4, 4], logit_bias={4: 2.0, 0: 9.0}), 1)
    got = logits.clone()
    apply_penalties_and_bias(got, allowed + rows(SamplingParams(), 1))
    inf = -math.inf
    assert got[0].tolist() == [inf, 1.0, inf, inf, 1.0, inf] and got[1].tolist() == logits[1].tolist()
    draws = draw(SamplingParams(temperature=1.0, allowed_token_ids=[2, 3]), PROBS)
    assert set(draws.tolist()) == {2, 3}
    assert (draw(SamplingParams(temperature=0, allowed_token_ids=[3, 1]), PROBS) == 1).all()
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])


def test_seeded_rows_do_not_depend_on_the_batch():
    vocab = 50
    torch.manual_seed(0)
    logits = torch.randn(8, vocab)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7)

    def seeded_draws(batch_logits, index):
        generator = torch.Generator().manual_seed(7)
        batch = rows(SamplingParams(temperature=1.0), batch_logits.shape[0])
        batch[index] = rows(params, 1, generator=generator)[0]
        sampler = Sampler(seed=123)
        return [int(sampler(batch_logits, batch).token_ids[index]) for _ in range(20)]

    alone = seeded_draws(logits[3:4], 0)
    in_batch = seeded_draws(logits[[0, 3, 5, 6]], 1)
    assert alone == in_batch
    assert len(set(alone)) > 1  # it really samples


def test_logprobs_are_raw_log_softmax_with_ranks():
    torch.manual_seed(1)
    logits = torch.randn(3, 30)
    expected = logits.log_softmax(-1)  # before the penalty, which goes into the logits in place
    out = Sampler()(logits, rows(SamplingParams(temperature=0, logprobs=4, repetition_penalty=1.5), 3, prompt=[1]))
    assert torch.allclose(out.logprobs, expected.gather(1, out.token_ids[:, None])[:, 0])
    assert torch.allclose(out.top_logprobs, expected.topk(4).values)
    assert out.ranks.tolist() == [int((expected[i] > expected[i, t]).sum()) + 1 for i, t in enumerate(out.token_ids)]


def reference_processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """A row as vLLM's processed_logits has it, the slow way: bias, then (temperature above 0) divided by the
    temperature and sorted once for top_k, top_p (a token goes when the better ones already reach p) and min_p."""
    row = logits.clone()
    for token, bias in (params.logit_bias or {}).items():
        row[int(token)] += bias
    if params.temperature < 1e-5:
        return row
    row /= params.temperature
    order = row.argsort(descending=True)
    keep = torch.zeros(len(row), dtype=torch.bool)
    probs = row.softmax(-1)
    covered = 0.0
    for rank, token in enumerate(order.tolist()):
        if rank >= (params.top_k or len(row)) or (rank and covered >= params.top_p):
            break
        keep[token] = probs[token] >= params.min_p * probs[order[0]]
        covered += float(probs[token])
    return row.masked_fill(~keep, float("-inf"))


@pytest.mark.parametrize("reads_back", [None, False])  # False: a GPU's way (top_p cut by sorting), on this CPU
@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes_report_the_raw_or_the_processed_distribution(mode, reads_back):
    torch.manual_seed(3)
    vocab = 300
    logits = torch.randn(6, vocab) * 3
    params = [
        SamplingParams(temperature=0, logprobs=5, logit_bias={7: 4.0}),
        SamplingParams(temperature=0.7, top_k=5, logprobs=5),
        SamplingParams(temperature=1.3, top_p=0.6, logprobs=5),
        SamplingParams(temperature=0.5, min_p=0.2, logprobs=5, logit_bias={3: 2.0}),
        SamplingParams(temperature=1.0, top_k=1, logprobs=5),  # greedy by its top_k, drawn for vLLM
        SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05, logprobs=5),
    ]
    batch = [SampleRow(p, [1, 2], 2, None, ()) for p in params]
    raw = logits.clone()
    out = Sampler(seed=5, reads_back=reads_back, logprobs_mode=mode)(logits, batch)
    for i, p in enumerate(params):
        if mode.startswith("raw"):
            expected = raw[i] if mode == "raw_logits" else raw[i].log_softmax(-1)
        else:
            expected = reference_processed(raw[i], p)
            expected = expected if mode == "processed_logits" else expected.log_softmax(-1)
        token = int(out.token_ids[i])
        assert torch.allclose(out.logprobs[i], expected[token], atol=1e-5), (i, mode)
        assert out.ranks[i] == int((expected > expected[token]).sum()) + 1
        assert torch.allclose(out.top_logprobs[i], expected.topk(5).values, atol=1e-5), (i, mode)
        if mode.startswith("processed"):
            assert out.logprobs[i].isfinite(), "the drawn token is one the filters kept"
    if mode == "processed_logprobs":  # top_k=5 keeps five tokens: the five reported hold all of the mass
        assert math.isclose(float(out.top_logprobs[1].exp().sum()), 1.0, rel_tol=1e-5)
        assert out.top_logprobs[4, 0] == 0 and out.top_logprobs[4, 1:].isneginf().all()


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_k=-5),
        dict(min_p=1.5),
        dict(n=0),
        dict(max_tokens=0),
        dict(logprobs=-1),
        dict(stop=[""]),
        dict(min_tokens=5, max_tokens=2),
        dict(presence_penalty=3),
    ],
)
def test_invalid_parameters_are_rejected_with_their_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
        SamplingParams(**bad)


def mixed_rows(vocab: int):
    """Logits and rows of every kind the sampler distinguishes: peaked and flat rows, top_k small and beyond the
    candidate limit, top_p alone (settled among the candidates or not), min_p, and combinations."""
    torch.manual_seed(3)
    peaked = torch.randn(vocab)
    peaked[torch.randperm(vocab)[:20]] += 12  # the mass sits in 20 tokens, as in a language model
    flat = torch.randn(vocab) * 0.1  # no 256 tokens cover 90 %
    cases = [
        (peaked, dict(top_p=0.9)),
        (flat, dict(top_p=0.9)),
        (flat, dict(top_k=7)),
        (peaked, dict(top_k=50, top_p=0.5)),
        (flat, dict(top_k=3000, top_p=0.95)),
        (peaked, dict(min_p=0.1, top_p=0.99)),
        (peaked, dict(top_k=5, min_p=0.3)),
        (flat, dict(top_k=1)),
    ]
    logits = torch.stack([row for row, _ in cases])
    return logits, [SampleRow(SamplingParams(temperature=0.8, **kw), [1, 2], 1, None, ()) for _, kw in cases]


def test_candidate_filters_equal_the_whole_vocabulary_filters():
    from fovea.runner.sampler import MAX_CANDIDATE_TOP_K, filter_candidates, filter_logits

    vocab = 5000
    logits, batch = mixed_rows(vocab)
    temperature = torch.full((len(batch),), 0.8)
    reference = filter_logits(logits / 0.8, batch).softmax(-1)
    narrowed = [
        i
        for i, r in enumerate(batch)
        if r.params.top_k <= MAX_CANDIDATE_TOP_K and r.params.top_k or r.params.top_p < 1 and not r.params.top_k
    ]
    values, ids, settled = filter_candidates(logits[narrowed], temperature[narrowed], [batch[i] for i in narrowed])
    assert settled.tolist() == [True, False, True, True, True, True, True]  # both outcomes happen
    for row, (i, ok) in enumerate(zip(narrowed, settled.tolist())):
        if ok:
            probs = torch.zeros(vocab).index_put_((ids[row],), values[row].softmax(-1), accumulate=True)
            assert torch.allclose(probs, reference[i], atol=1e-6), i


@pytest.mark.parametrize("sort_rows", [False, True], ids=["binned", "sorted"])
def test_whole_row_top_p_keeps_the_sorted_definitions_tokens(sort_rows):
    """Both top_p cuts over whole rows (the binned one, drop_outside_top_p, and the GPU's by sorting) keep the
    tokens of the definition written out here in float64: sort the row, drop a token once the tokens above it
    cover top_p. Flat rows whose cut lies deep in the vocabulary, peaked ones, a top_k before it, and a row of many
    equal logits (where the definition fixes how many of them stay, not which)."""
    from fovea.runner.sampler import filter_logits

    vocab = 20000
    generator = torch.Generator().manual_seed(4)
    flat = torch.randn(vocab, generator=generator) * 0.1
    peaked = torch.randn(vocab, generator=generator)
    peaked[:30] += 9
    tied = (torch.randn(vocab, generator=generator) * 2).round()  # a few distinct values, thousands of each
    cases = [(flat, 0.9, 0), (flat, 0.3, 0), (peaked, 0.95, 0), (flat, 0.5, 5000), (tied, 0.7, 0), (peaked, 0.2, 0)]
    logits = torch.stack([row for row, _, _ in cases])
    batch = [SampleRow(SamplingParams(temperature=1.0, top_p=p, top_k=k), [1], 1, None, ()) for _, p, k in cases]
    kept = filter_logits(logits.clone(), batch, sort_rows).isfinite()
    for i, (row, top_p, top_k) in enumerate(cases):
        values, order = row.double().sort(descending=True)
        if top_k:
            values[top_k:] = float("-inf")
        probs = values.softmax(-1)
        stays = (probs.cumsum(-1) - probs) < top_p
        assert int(kept[i].sum()) == int(stays.sum()), i
        assert torch.equal(row[kept[i]].sort().values, row[order[stays]].sort().values), i  # the same values
        if i != 4:  # no ties: the same tokens
            assert set(kept[i].nonzero()[:, 0].tolist()) == set(order[stays].tolist()), i
    assert 1000 < int(kept[0].sum()) < vocab  # the cut really lies deep


def test_seeded_rows_draw_the_same_token_on_either_path():
    """A seeded row draws one uniform number a step from its generator, and both paths invert the cumulative
    distribution in vocabulary order, so its tokens are those of the whole-vocabulary draw, written out here in
    float64 (the path taken may depend on the batch)."""
    from fovea.runner.sampler import filter_logits

    vocab = 5000
    logits, batch = mixed_rows(vocab)
    for i in range(len(batch)):
        row = SampleRow(batch[i].params.clone(seed=11), [1, 2], 1, torch.Generator().manual_seed(11), ())
        mirror = torch.Generator().manual_seed(11)
        probs = filter_logits(logits[i : i + 1] / 0.8, [row]).double().softmax(-1)[0]
        sampler = Sampler()
        drawn = []
        for _ in range(5):
            token = int(sampler(logits[i : i + 1], [row]).token_ids[0])
            target = float(torch.rand(1, generator=mirror)) * float(probs.sum())
            assert token == int(
                torch.searchsorted(probs.cumsum(-1), torch.tensor([target], dtype=torch.float64), right=True)
            ), i
            drawn.append(token)
        assert probs[drawn].min() > 0  # never a filtered token


def test_top_p_rows_settled_on_the_device_draw_the_tokens_read_back_rows_do(monkeypatch):
    """Where the host must not wait for the device (a GPU), a top_p-only row gets both its candidates' token and
    its whole row's (sorted) and the device picks one by whether the candidates covered top_p: the tokens are
    those of the path that reads that answer back (the CPU's), for every kind of row, seeded rows and a greedy one
    among them, and no value is read back meanwhile (any read fails the test)."""
    logits, batch = mixed_rows(5000)
    params = [r.params for r in batch] + [r.params.clone(seed=20 + i) for i, r in enumerate(batch)]
    params.append(SamplingParams(temperature=0))
    logits = torch.cat([logits, logits, logits[:1]])

    def rows_drawn_with(seed: int) -> list[SampleRow]:
        def generator(p):
            return None if p.seed is None else torch.Generator().manual_seed(p.seed + seed)

        return [SampleRow(p, [1, 2], 1, generator(p), ()) for p in params]

    for seed in range(4):
        read_back = Sampler(seed=seed)(logits.clone(), rows_drawn_with(seed)).token_ids
        with monkeypatch.context() as no_reads:
            for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
                no_reads.setattr(torch.Tensor, name, lambda *_: pytest.fail("a value read back from the device"))
            on_device = Sampler(seed=seed, reads_back=False)(logits.clone(), rows_drawn_with(seed)).token_ids
        assert torch.equal(read_back, on_device), seed


def test_sparse_penalties_equal_dense_ones():
    torch.manual_seed(5)
    vocab = 300
    logits = torch.randn(4, vocab) * 3
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.2),
        SamplingParams(repetition_penalty=0.7),
        SamplingParams(),
        SamplingParams(frequency_penalty=1.0),
    ]
    batch = [SampleRow(p, torch.randint(0, vocab, (50,)).tolist(), 30, None, ()) for p in params]
    got = logits.clone()
    apply_penalties_and_bias(got, batch)
    for row, (r, expected) in enumerate(zip(batch, logits.clone())):  # the definitions, written out per token
        p = r.params
        outputs = r.output_ids
        for token in set(r.token_ids):
            value = expected[token]
            value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            count = outputs.count(token)
            expected[token] = value - p.frequency_penalty * count - p.presence_penalty * (count > 0)
        assert torch.allclose(got[row], expected, atol=1e-6), row
    assert not torch.equal(got, logits)  # penalized in place


def test_penalty_tokens_kept_across_steps_equal_ones_rebuilt_each_step():
    """The sampler keeps each penalized sample's tokens between steps and reads only the new ones: step after step
    (tokens appended, a row leaving and coming back, an id outside the vocabulary) the logits are penalized as
    from the whole token list."""
    torch.manual_seed(6)
    vocab = 40
    params = [
        SamplingParams(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2),
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(temperature=0),
    ]
    tokens = [torch.randint(0, vocab, (12,)).tolist() + [vocab + 3] for _ in params]  # one id past the vocabulary
    sampler = Sampler(seed=0)
    for step in range(6):
        live = [0, 2] if step == 3 else [0, 1, 2]  # row 1 sits out a step (preempted, say)
        batch = [SampleRow(params[i], tokens[i], 10, None, (), key=(i, 0)) for i in live]
        logits = torch.randn(len(batch), vocab)
        cached, rebuilt = logits.clone(), logits.clone()
        apply_penalties_and_bias(cached, batch, sampler.seen)
        apply_penalties_and_bias(rebuilt, batch)
        assert torch.equal(cached, rebuilt), step
        assert not torch.equal(cached, logits)
        sampled = sampler(logits, batch).token_ids.tolist()
        assert set(sampler.seen) == {(i, 0) for i in live if i != 2}  # the unpenalized row keeps nothing
        for i, token in zip(live, sampled):
            tokens[i].append(token)


NO_WAIT = {  # batches a served step samples every step, whose sampling must not wait for the device
    # Qwen2.5-VL's generation_config (repetition_penalty 1.05, top_k 1) penalizes every served request by default
    "penalized greedy": SamplingParams(
        temperature=0.1, top_k=1, repetition_penalty=1.05, logit_bias={3: 1.0}, min_tokens=2
    ),
    # what Qwen3-VL's model card recommends for vision tasks
    "Qwen3-VL's card": SamplingParams(temperature=0.7, top_k=20, top_p=0.8, presence_penalty=1.5),
    "top_k, top_p and min_p": SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05),
    # what most OpenAI clients send: whether a row's best tokens cover top_p is known on the device only
    "top_p alone": SamplingParams(temperature=0.7, top_p=0.9),
    "a top_k past the candidates, and top_p": SamplingParams(temperature=0.7, top_k=2000, top_p=0.9),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the host waits for a GPU only")
@pytest.mark.parametrize("params", NO_WAIT.values(), ids=NO_WAIT)
def test_a_step_of_new_samples_is_queued_without_waiting_for_the_device(params):
    """A sample new to the sampler copied its prompt's ids to the device for its penalties, and a plain copy waits
    for the queued forward: under image traffic that cost nearly every step its overlap with the next (py-spy,
    random-mm on an H200). min_p and top_k rows asked the device whether to act, and top_p-only rows whether their
    candidates covered top_p. Under CUDA's sync debug mode any such wait raises."""
    vocab, device = 5000, torch.device("cuda")
    batch = [SampleRow(params, list(range(i, i + 50)), 48, None, (7,), key=(i, 0)) for i in range(4)]
    pending = ([1, 3], torch.tensor([5, 9], device=device))  # tokens of the step still on the device
    sampler = Sampler(seed=0)
    logits = torch.randn(len(batch), vocab, device=device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        sampled = sampler(logits, batch, pending=pending)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert set(sampler.seen) == ({(i, 0) for i in range(4)} if penalized(params) else set())
    assert sampled.token_ids.shape == (4,)


@pytest.mark.parametrize("vocab", [96, 100, 130])
def test_cpu_bitmask_matches_llguidance(vocab):
    """The eager CPU masking (no torch.compile at start-up) gives exactly llguidance's logits (its numpy kernel:
    the arithmetic of its torch.compile'd one, without seconds of compiling), for a vocabulary that fills its last
    mask word, one that does not, and one wider than the mask."""
    import llguidance.numpy as ln

    from fovea.runner.grammar_masks import apply_bitmask

    gen = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(3, vocab, generator=gen)
    ours, theirs = logits.clone(), logits.clone()
    apply_bitmask(ours, bitmask)
    ln.apply_token_bitmask_inplace(theirs.numpy(), bitmask.numpy())
    assert torch.equal(ours, theirs) and torch.isinf(ours).any() and torch.isfinite(ours).any()


def test_blocked_topk_gives_torchs_values():
    """The block-maxima topk (the CPU candidates' path) gives torch.topk's values, sorted, at indices holding
    them, each index once: with ties across and inside blocks, -inf rows, and k near the block count."""
    from fovea.runner.sampler import topk

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(6, 151936, generator=generator)
    x[1, :300] = 3.0  # more ties than k, over several blocks
    x[2] = float("-inf")
    x[3, ::128] = 9.0  # every block's maximum equal
    for k in (1, 50, 256):
        values, ids = topk(x, k)
        assert torch.equal(values, x.topk(k, dim=-1).values), k
        assert torch.equal(x.gather(1, ids), values), k
        assert all(len(set(row)) == k for row in ids.tolist()), k


def test_large_vocabulary_draws_follow_the_distribution():
    """Plain sampling over a 151,936-token vocabulary (the whole-row inverse cdf): the draws' frequencies over 16
    groups of tokens match the groups' probabilities within a chi-square bound, at two temperatures."""
    vocab, draws = 151936, 4096
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(vocab, generator=generator) * 2
    groups = torch.randperm(vocab, generator=generator) % 16
    for temperature in (1.0, 0.5):
        probs = (logits / temperature).double().softmax(-1)
        expected = torch.zeros(16, dtype=torch.float64).index_add_(0, groups, probs) * draws
        batch = rows(SamplingParams(temperature=temperature), draws)
        tokens = Sampler(seed=3)(logits.expand(draws, -1).clone(), batch).token_ids
        observed = torch.bincount(groups[tokens], minlength=16).double()
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < 37.7, (temperature, chi2)  # the 0.1 % tail of chi-square with 15 degrees of freedom


def test_blocked_argmax_is_torchs_first_maximum():
    from fovea.runner.sampler import argmax

    generator = torch.Generator().manual_seed(0)
    for width in (151936, 32064, 1000, 4099):  # Qwen's, LLaVA's (blocks of 64), small, and one that no block divides
        x = torch.randn(9, width, generator=generator)
        x[1, 7] = x[1, width - 3] = 50.0  # ties across blocks: the first wins
        x[2, 130] = x[2, 131] = 50.0  # a tie inside a block
        x[3] = float("-inf")  # a row a grammar masked whole
        x[4, :] = 1.0
        torch.testing.assert_close(argmax(x), x.argmax(-1), rtol=0, atol=0)
        rows = x[torch.tensor([5, 1, 2])]  # a gathered (fresh) tensor, and a strided view of rows
        assert torch.equal(argmax(rows), rows.argmax(-1)) and torch.equal(argmax(x[::2]), x[::2].argmax(-1))


@pytest.mark.parametrize("rows, width", [(64, 64), (16, 512), (2, 64), (1, 512)])
def test_the_lm_heads_sliced_product_gives_the_whole_products_logits(rows, width):
    """The CPU's vocabulary-sliced product (from rows x width >= 4096) writes every logit, the last slice's
    short tail included (a vocabulary no slice divides), equal to one matmul's; into a given buffer too."""
    from fovea.layers.basic import VOCAB_SLICE_MIN_ELEMENTS, vocab_product

    gen = torch.Generator().manual_seed(rows)
    vocab = 20_011  # prime: no slice width divides it
    weight, hidden = torch.randn(vocab, width, generator=gen), torch.randn(rows, width, generator=gen)
    expected = hidden @ weight.t()
    torch.testing.assert_close(vocab_product(hidden, weight), expected, rtol=1e-6, atol=1e-5)
    buffer = torch.full((rows + 3, vocab), float("nan"))
    got = vocab_product(hidden, weight, out=buffer[:rows])
    assert got.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert (rows * width >= VOCAB_SLICE_MIN_ELEMENTS) == (rows >= 16)  # both paths are covered above


@pytest.mark.parametrize(
    "bad, bound",
    [
        (dict(repetition_penalty=1e-300), "repetition_penalty must be in [0.01, 100]"),
        (dict(repetition_penalty=1e300), "repetition_penalty must be in [0.01, 100]"),
        (dict(temperature=1e300), "temperature must be in [0, 10000]"),
        (dict(logit_bias={5: 1e38}), "logit_bias values must be in [-100, 100]"),
        (dict(logit_bias={5: float("nan")}), "logit_bias values must be in [-100, 100]"),
    ],
)
def test_numbers_the_float32_arithmetic_cannot_take_are_refused_naming_the_bound(bad, bound):
    with pytest.raises(ValueError) as refused:
        SamplingParams(**bad)
    assert bound in str(refused.value)


def test_at_every_bound_the_sampler_stays_finite_and_in_range():
    """Each parameter at its extremes, over seen tokens with large logits: the penalized and scaled logits stay
    finite (or -inf where dropped), every row draws a token of the vocabulary and counts as finite. A top_p below
    float32's range is taken as the smallest one kept (the best token alone)."""
    vocab = 3000
    assert SamplingParams(top_p=1e-300).top_p == 1e-8
    extremes = [
        dict(repetition_penalty=0.01, temperature=1e-5 * 1.01),
        dict(repetition_penalty=100.0, temperature=10000.0),
        dict(logit_bias={7: 100.0, 8: -100.0}, frequency_penalty=2.0, presence_penalty=-2.0),
        dict(top_p=1e-300, temperature=0.5),
        dict(min_p=1e-300, top_k=3, temperature=0.01),
    ]
    torch.manual_seed(0)
    logits = torch.randn(len(extremes), vocab) * 30
    batch = [SampleRow(SamplingParams(**kw), list(range(0, 400, 3)) * 2, 100, None, ()) for kw in extremes]
    penalized = logits.clone()
    apply_penalties_and_bias(penalized, batch, {}, None)
    assert not penalized.isnan().any() and not penalized.isposinf().any()
    out = Sampler(seed=0)(logits.clone(), batch)
    assert out.finite.all() and ((0 <= out.token_ids) & (out.token_ids < vocab)).all()
    assert out.token_ids[3] == penalized[3].argmax()  # top_p 1e-8 keeps the best token alone


def test_rows_of_nan_or_infinite_logits_are_flagged_and_the_others_unchanged():
    """NaN, +inf and all -inf rows beside normal ones, on every sampling path (greedy, candidates, top_p over the
    whole row, which bins the row's weights): the bad rows are flagged and draw some token of the vocabulary; the
    normal rows draw what they draw alone (seeded)."""
    vocab = 3000
    torch.manual_seed(1)
    normal = torch.randn(4, vocab) * 0.1  # flat: no 256 candidates cover top_p 0.95, the whole row is binned
    kinds = [dict(temperature=0), dict(temperature=0.7, top_k=20), dict(top_p=0.95), dict(top_p=0.95, top_k=2000)]
    bad = torch.stack(
        [torch.full((vocab,), float("nan")), torch.full((vocab,), float("inf")), torch.full((vocab,), -float("inf"))]
    )

    def batch(params, seeds):
        return [SampleRow(p, [1, 2], 1, torch.Generator().manual_seed(i), ()) for p, i in zip(params, seeds)]

    alone = Sampler(seed=0)(normal.clone(), batch([SamplingParams(**k) for k in kinds], range(4))).token_ids
    for kw in kinds:
        params = [SamplingParams(**kw)] * 3 + [SamplingParams(**k) for k in kinds]
        out = Sampler(seed=0)(torch.cat([bad, normal]), batch(params, [7, 8, 9, 0, 1, 2, 3]))
        assert out.finite.tolist() == [False] * 3 + [True] * 4
        assert ((0 <= out.token_ids) & (out.token_ids < vocab)).all()
        assert out.token_ids[3:].tolist() == alone.tolist()
