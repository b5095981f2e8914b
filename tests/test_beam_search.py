"""Beam search (vLLM's `use_beam_search`, `LLM.beam_search`), run by the front end over one-token engine requests:
the beams transformers' beam search finds, where no beam ends; where beams end at an end-of-sequence token, vLLM's
rule for them, checked against a search written here over transformers' own forward passes."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import hf_inputs, hf_model, hf_tokenizer, random_image

from fovea import LLM, BeamSearchParams, SamplingParams
from fovea.core.request import RequestInput

WIDTH, STEPS = 3, 6
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    return LLM(str(tiny_dirs["tiny-3b"]), dtype="float32", max_model_len=1024)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_beams_are_transformers_beams(llm, tiny_dirs, length_penalty):
    """With no beam ending (ignore_eos; transformers: end tokens kept out), the n beams of an image chat are
    transformers' num_beams beams, in its order, with its scores: the cumulative logprob over the generated
    length ** length_penalty (vLLM's ranking counts the prompt too; with equal lengths the order is the same)."""
    model_dir = tiny_dirs["tiny-3b"]
    image = random_image(224, 168, seed=11)
    params = SamplingParams(
        n=WIDTH, use_beam_search=True, max_tokens=STEPS, ignore_eos=True, temperature=0, logprobs=0,
        length_penalty=length_penalty,
    )  # fmt: skip
    ours = llm.chat(
        [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": QUESTION}]}],
        params,
        use_tqdm=False,
    )[0]
    inputs = hf_inputs(
        model_dir, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}], [image]
    )
    with torch.no_grad():
        theirs = hf_model(model_dir).generate(
            **inputs,
            num_beams=WIDTH,
            num_return_sequences=WIDTH,
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            do_sample=False,
            length_penalty=length_penalty,
            output_scores=True,
            return_dict_in_generate=True,
        )
    prompt_len = inputs["input_ids"].shape[1]
    assert ours.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert [o.token_ids for o in ours.outputs] == theirs.sequences[:, prompt_len:].tolist()
    assert len({tuple(o.token_ids) for o in ours.outputs}) == WIDTH  # three beams, not one thrice
    scores = [o.cumulative_logprob / STEPS**length_penalty for o in ours.outputs]
    torch.testing.assert_close(torch.tensor(scores), theirs.sequences_scores.float(), atol=1e-4, rtol=0)
    assert [o.finish_reason for o in ours.outputs] == ["length"] * WIDTH


def reference_search(model, prompt: list[int], eos: set[int], width: int, steps: int, length_penalty: float):
    """vLLM's rule, written out over transformers' forward passes (no cache): every beam's 2 x width likeliest
    tokens are candidates; an end token ends its beam; the width best others go on; at the end the ended and the
    live beams are ranked by cumulative logprob / (prompt + generated, end token not counted) ** length_penalty."""
    beams, ended = [([], 0.0)], []
    for _ in range(steps):
        candidates = []
        for tokens, total in beams:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, -1]
            top = torch.log_softmax(logits.float(), -1).topk(2 * width)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                (ended if token in eos else candidates).append((tokens + [token], total + value))
        beams = sorted(candidates, key=lambda b: -b[1])[:width]
    every = [(t, s, True) for t, s in ended] + [(t, s, False) for t, s in beams]

    def score(beam):
        tokens, total, stopped = beam
        return total / (len(prompt) + len(tokens) - stopped) ** length_penalty

    return sorted(every, key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def ending_model(tiny_dirs, tmp_path_factory):
    """The tiny checkpoint with its end-of-sequence token made one its beams reach (so beams end), and the prompt."""
    model_dir = tiny_dirs["tiny-3b"]
    prompt = hf_tokenizer(model_dir).encode("The lighthouse keeper wrote", add_special_tokens=False)
    free = reference_search(hf_model(model_dir), prompt, set(), WIDTH, STEPS, 1.0)
    end_token = free[1][0][2]  # the second beam's third token
    copy = tmp_path_factory.mktemp("ending") / "tiny"
    shutil.copytree(model_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "eos_token_id": end_token}))
    return copy, prompt, end_token


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_ended_beams_follow_vllms_rule(tiny_dirs, ending_model, length_penalty):
    """Beams that end at the end token are ranked with the live ones as vLLM ranks them, end token left out of
    the answer (kept with include_stop_str_in_output); LLM.beam_search gives them with the prompt."""
    model_dir, prompt, end_token = ending_model
    expected = reference_search(hf_model(tiny_dirs["tiny-3b"]), prompt, {end_token}, WIDTH, STEPS, length_penalty)
    assert {stopped for _, _, stopped in expected} == {True, False}, "the check needs ended and live beams"
    with LLM(str(model_dir), dtype="float32", max_model_len=1024) as llm:
        found = llm.beam_search(
            [{"prompt_token_ids": prompt}], BeamSearchParams(WIDTH, STEPS, length_penalty=length_penalty)
        )[0].sequences
        kept = llm.generate(
            [prompt],
            BeamSearchParams(
                WIDTH, STEPS, length_penalty=length_penalty, include_stop_str_in_output=True
            ).sampling_params(),
            use_tqdm=False,
        )[0].outputs
        tokenizer = llm.get_tokenizer()
    assert [s.tokens for s in found] == [prompt + (t[:-1] if stopped else t) for t, _, stopped in expected]
    assert [o.token_ids for o in kept] == [t for t, _, _ in expected]
    torch.testing.assert_close([s.cum_logprob for s in found], [s for _, s, _ in expected], atol=1e-4, rtol=0)
    assert [(s.finish_reason, s.stop_reason) for s in found] == [
        ("stop", end_token) if stopped else ("length", None) for _, _, stopped in expected
    ]
    assert [s.text for s in found] == [tokenizer.decode(s.tokens) for s in found]
    assert all(len(s.logprobs) == len(s.tokens) - len(prompt) for s in found)


def test_settings_beam_search_cannot_apply_are_refused(llm):
    with pytest.raises(ValueError, match="top_p, stop cannot be used with beam search"):
        SamplingParams(use_beam_search=True, top_p=0.5, stop="x")
    with pytest.raises(ValueError, match="length_penalty must be a finite number"):
        SamplingParams(use_beam_search=True, length_penalty=float("inf"))
    with pytest.raises(ValueError, match="needs 22 logprobs a step, more than max_logprobs=20"):
        llm.generate(["Hi"], SamplingParams(n=11, use_beam_search=True), use_tqdm=False)
    request = RequestInput("direct", [1, 2, 3], SamplingParams(n=2, use_beam_search=True))
    with pytest.raises(ValueError, match="beam search runs in the front end"):
        llm.engine.add_request(request)
    assert not llm.engine.has_unfinished_requests()


def test_a_served_search_lends_its_steps_the_same_shared_pixels(llm, tiny_dirs):
    """Steps sent to an engine process name one shared-memory segment (not a copy of the pixels each), which the
    engine maps and leaves; closing the search frees it. The in-process search hands the arrays themselves."""
    from fovea.frontend.beam_search import BeamSearch
    from fovea.multimodal.image_workers import SharedPixels

    image = random_image(64, 48, seed=5)
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "Hi"}]}]
    params = SamplingParams(n=2, use_beam_search=True, max_tokens=3, temperature=0)
    root = llm.inputs.make_request("root", llm.inputs.process_chat(chat), params)
    pixels = root.mm_items[0].pixels.copy()
    search = BeamSearch(root, 1024, lend_pixels=True)
    first, second = search.step_requests()[0], search.step_requests()[0]
    handle = first.mm_items[0].pixels
    assert isinstance(handle, SharedPixels) and handle.borrowed and second.mm_items[0].pixels == handle
    for step in (first, second):  # what the engine does on arrival: maps the pixels, frees nothing
        step.take_shared_pixels()
        np.testing.assert_array_equal(step.mm_items[0].pixels, pixels)
    search.close()
    with pytest.raises(ValueError, match="withdrawn by their owner"):
        search.step_requests()[0].take_shared_pixels()
    in_process = BeamSearch(llm.inputs.make_request("root2", llm.inputs.process_chat(chat), params), 1024)
    assert in_process.step_requests()[0].mm_items[0].pixels is in_process.root.mm_items[0].pixels
