"""Sampler: filters hold statistically, penalties follow their definitions, seeds are batch-independent."""

from __future__ import annotations

import math

import pytest
import torch

from fovea.engine.sampler import SampleRow, Sampler, apply_penalties_and_bias
from fovea.engine.sampling_params import SamplingParams

DRAWS = 4000


def rows(params: SamplingParams, count: int, prompt=(), output=(), stop_ids=(), generator=None):
    return [SampleRow(params, list(prompt) + list(output), len(prompt), generator, tuple(stop_ids))
            for _ in range(count)]


def logits_of(probs: list[float], vocab: int = 10) -> torch.Tensor:
    full = torch.full((vocab,), 1e-9)
    full[:len(probs)] = torch.tensor(probs)
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


def test_penalties_change_logits_as_defined():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # token 0 in the prompt; token 2 generated twice, token 4 once
    got = apply_penalties_and_bias(logits.clone(), rows(params, 1, prompt=[0], output=[2, 2, 4]))[0]
    expected = [2.0 / 2, -1.0, 0.5 / 2 - 0.5 * 2 - 0.25, 3.0, -2.0 * 2 - 0.5 - 0.25]
    assert got.tolist() == pytest.approx(expected)


def test_logit_bias_and_min_tokens():
    logits = torch.zeros(2, 6)
    biased = rows(SamplingParams(logit_bias={3: 5.0, "4": -1.0}), 1)
    held = rows(SamplingParams(min_tokens=2), 1, prompt=[1], output=[2], stop_ids=[5, 0])
    got = apply_penalties_and_bias(logits, biased + held)
    assert got[0].tolist() == [0, 0, 0, 5.0, -1.0, 0]
    assert got[1, 5] == -math.inf and got[1, 0] == -math.inf and got[1, 1:5].eq(0).all()


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
    out = Sampler()(logits, rows(SamplingParams(temperature=0, logprobs=4, repetition_penalty=1.5), 3, prompt=[1]))
    expected = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, expected.gather(1, out.token_ids[:, None])[:, 0])
    assert torch.allclose(out.top_logprobs, expected.topk(4).values)
    assert out.ranks.tolist() == [int((expected[i] > expected[i, t]).sum()) + 1 for i, t in enumerate(out.token_ids)]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-5), dict(min_p=1.5),
                                 dict(n=0), dict(max_tokens=0), dict(logprobs=21), dict(stop=[""]),
                                 dict(min_tokens=5, max_tokens=2), dict(presence_penalty=3)])
def test_invalid_parameters_are_rejected_with_their_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
        SamplingParams(**bad)
