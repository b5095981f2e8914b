"""The engine's step orders, each forced whatever the device: overlapped (a GPU engine's default: the next step is
queued before the previous one's outputs are built) and ahead (async scheduling: the next step is scheduled and
queued before the previous one's tokens are back, and reads them on the device) must give what stepping in order
gives, and a request aborted or failed while its step is in flight must end once."""

from __future__ import annotations

import argparse
from collections import defaultdict

import pytest
from conftest import random_image
from test_engine_vs_hf import LOREM, assert_engine_idle

from fovea import LLM, SamplingParams
from fovea.config.engine import EngineConfig
from fovea.config.flags import add_engine_flags
from fovea.core.sampling_params import RequestOutputKind
from fovea.engine.engine import StepFailed

OPTIONS = dict(dtype="float32", max_model_len=2048, num_gpu_blocks_override=400, max_num_batched_tokens=256)
STREAM = SamplingParams(temperature=0, max_tokens=12, output_kind=RequestOutputKind.DELTA)
ORDERS = {
    "in order": dict(overlap_outputs=False, async_scheduling=False),
    "overlapped": dict(overlap_outputs=True, async_scheduling=False),
    "ahead": dict(async_scheduling=True),
}


@pytest.fixture(scope="module")
def engines(tiny_dirs):
    return {order: LLM(str(tiny_dirs["tiny-3b"]), **ORDERS[order], **OPTIONS) for order in ORDERS}


def request(llm, request_id, prompt, params):
    return llm.inputs.make_request(request_id, llm.inputs.process(prompt), params)


def seen(output):
    """What a caller reads off an output: its ids, texts and finish reasons, and its log-probabilities (on a GPU
    a step run at another batch size, as ahead steps near a request's end are, may round their last bits)."""
    exact = [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in output.outputs]
    entries = [e for c in output.outputs for e in c.logprobs or []] + [e for e in output.prompt_logprobs or [] if e]
    numbers = [c.cumulative_logprob or 0.0 for c in output.outputs]
    numbers += [value.logprob for entry in entries for value in entry.values()]
    exact += [(token, value.rank, value.decoded_token) for entry in entries for token, value in entry.items()]
    return output.prompt_token_ids, exact, numbers


def assert_same(outputs, expected, label):
    assert len(outputs) == len(expected)
    for got, want in zip(map(seen, outputs), map(seen, expected)):
        assert got[:2] == want[:2], label
        assert got[2] == pytest.approx(want[2], rel=1e-5, abs=1e-5), label


def test_overlapped_and_ahead_steps_give_what_steps_in_order_give(engines, monkeypatch):
    assert engines["overlapped"].engine.overlap and not engines["in order"].engine.overlap
    ahead = []  # per step of the ahead engine: whether it was scheduled before the previous one was back
    runner = engines["ahead"].engine.runner
    real_execute = runner.execute

    def execute(step, encoded, previous=None):
        ahead.append(previous is not None)
        return real_execute(step, encoded, previous)

    monkeypatch.setattr(runner, "execute", execute)
    image = {"prompt": "<|vision_start|><|image_pad|><|vision_end|>Describe.", "multi_modal_data": {}}
    image["multi_modal_data"]["image"] = random_image(160, 120, 3)
    prompts = ["The cat sat on the", LOREM, "Numbers: 1 2 3 4", image, "Hi", LOREM * 3, "Colours of the sea"]
    params = [
        SamplingParams(temperature=0, max_tokens=9),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=14, logprobs=2),
        SamplingParams(temperature=0.8, n=3, seed=7, max_tokens=6),  # forks after the prompt
        SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1),
        SamplingParams(temperature=0, max_tokens=20, stop=["e", "a"], min_tokens=2),
        engines["in order"].get_default_sampling_params().clone(max_tokens=11),  # the repetition penalty
        SamplingParams(temperature=1.0, seed=3, max_tokens=5, frequency_penalty=0.5, presence_penalty=0.3),
    ]
    # the image encoded before: its embeddings come from the encoder cache, so no step waits for the encoder's
    # thread, whose timing (a busy machine's) changed which step the image request joined, the batches' sizes,
    # and so on the CPU the rounding of small batches' matmuls, which moved a sampled token (once in a full run)
    for llm in engines.values():
        llm.generate([image], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    encoded = [llm.engine.encoder_cache.encoded for llm in engines.values()]
    results = {order: llm.generate(prompts, params, use_tqdm=False) for order, llm in engines.items()}
    assert [llm.engine.encoder_cache.encoded for llm in engines.values()] == encoded
    for order in ("overlapped", "ahead"):
        assert_same(results[order], results["in order"], order)
    assert any(c.finish_reason == "stop" for o in results["ahead"] for c in o.outputs)  # the stop strings did stop
    assert sum(ahead) > len(ahead) / 2  # most steps went ahead (those after a fork or min_tokens could not)
    for llm in engines.values():
        assert_engine_idle(llm.engine)


def test_penalties_see_the_token_still_on_the_device(engines):
    """Biased to 500, then (once 500 is seen and penalized) 501: scheduled ahead, the second step must count
    the first step's 500, still on the device, or it repeats 500."""
    params = SamplingParams(temperature=0, max_tokens=4, repetition_penalty=4.0, logit_bias={500: 100.0, 501: 90.0})
    for order, llm in engines.items():
        assert llm.generate("Hi", params, use_tqdm=False)[0].outputs[0].token_ids[:2] == [500, 501], order


def run_streams(engine, abort_after: int | None = None) -> tuple[dict, dict]:
    """(request, sample) -> its streamed tokens, and request -> whether each of its outputs was final;
    `abort_after`: 'go' is aborted after that many steps."""
    tokens, finals = defaultdict(list), defaultdict(list)
    calls = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            finals[output.request_id].append(output.finished)
            for completion in output.outputs:
                tokens[output.request_id, completion.index] += completion.token_ids
            if output.finished and output.request_id == "go":
                assert all(c.finish_reason == ("abort" if abort_after else "length") for c in output.outputs)
        calls += 1
        if abort_after is not None and calls > abort_after:  # nothing of it runs any more (no fork made late)
            assert all(seq.request.request_id != "go" for seq in engine.scheduler.running)
        if calls == abort_after:
            assert engine.in_flight is not None or not engine.overlap  # a step of 'go' is queued
            engine.abort_request("go")
    return tokens, finals


def test_a_request_aborted_while_its_step_is_in_flight_ends_once(engines):
    """Aborted after each step in turn: while its prompt's step is in flight (its samples fork when that step is
    recorded), while a step filling a KV block is, and so on. Its blocks come back, it ends with one final
    output, and what it streamed is the start of what it streams unaborted."""
    go = SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=20, output_kind=RequestOutputKind.DELTA)
    full = {}
    for order, llm in engines.items():
        engine = llm.engine
        for abort_after in (None, *range(1, 20)):
            engine.add_request(request(llm, "stay", LOREM, STREAM))
            engine.add_request(request(llm, "go", "Hello there", go))
            tokens, finals = run_streams(engine, abort_after)
            assert all(f == [False] * (len(f) - 1) + [True] for f in finals.values())  # one final output, last
            assert_engine_idle(engine)
            if abort_after is None:
                full[order] = tokens
                continue
            assert tokens["stay", 0] == full[order]["stay", 0]
            for index in (0, 1):
                streamed = tokens.get(("go", index), [])
                assert streamed == full[order]["go", index][: len(streamed)], (order, abort_after, index)
    assert full["overlapped"] == full["in order"] == full["ahead"]


def test_a_step_failing_behind_one_in_flight_keeps_that_ones_outputs(engines, monkeypatch):
    """'short' finishes in the step recorded just before the next one fails to start: its last output still
    comes, and the failure names only the request that step ran."""
    for llm in engines.values():
        engine = llm.engine
        final = SamplingParams(temperature=0, max_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY)
        engine.add_request(request(llm, "short", "Hi", final))
        engine.add_request(request(llm, "long", LOREM, final.clone(max_tokens=10)))
        real_execute, calls = engine.runner.execute, []

        def execute(*args):
            calls.append(1)
            if len(calls) == 3:  # the step after 'short' sampled its second token
                raise RuntimeError("device error")
            return real_execute(*args)

        monkeypatch.setattr(engine.runner, "execute", execute)
        outputs = []
        with pytest.raises(StepFailed) as failed:
            for _ in range(5):
                outputs += engine.step()
        assert failed.value.request_ids == ["long"]
        for _ in range(3):  # a request left unreported would keep the engine busy
            outputs += engine.step()
        assert not engine.has_unfinished_requests()
        assert [(o.request_id, o.finished, len(o.outputs[0].token_ids)) for o in outputs] == [("short", True, 2)]
        assert_engine_idle(engine)
        monkeypatch.setattr(engine.runner, "execute", real_execute)


def test_preempted_while_a_step_is_in_flight_gives_the_same_tokens(tiny_dirs):
    """A KV cache too small for every sequence at once (~560 tokens, it holds 384): scheduling ahead preempts
    sequences whose token is still on the device; recomputed later, they give what stepping in order gives."""
    options = {**OPTIONS, "num_gpu_blocks_override": 24, "max_num_batched_tokens": 128, "max_model_len": 384}
    prompts = [LOREM * 2, "The cat sat on the", LOREM * 2 + " And so", "Numbers: 1 2 3 4", "Colours of the sea"]
    # seeded draws: a token lost and recomputed would come from the next draw (greedy would find it again). Between
    # each step's two best tokens: over a random model's near-flat 152k vocabulary a draw moves to the next token on
    # a 1e-6 change in the logits, which a GPU's decode graph of another batch size (ahead, some steps run with
    # other sequences) gives (benchmarks/README "GPU", H200 at 4bce646)
    params = [
        SamplingParams(temperature=0.8, top_k=2, seed=i, max_tokens=80, ignore_eos=True) for i in range(len(prompts))
    ]
    outputs, preemptions = {}, {}
    for order in ("in order", "ahead"):
        llm = LLM(str(tiny_dirs["tiny-3b"]), **ORDERS[order], **options)
        outputs[order] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        preemptions[order] = llm.engine.scheduler.num_preemptions
        assert_engine_idle(llm.engine)
    assert preemptions["ahead"] > 0
    assert outputs["ahead"] == outputs["in order"]


def test_scheduling_ahead_is_the_default_on_a_gpu_and_either_flag_overrides_it(tiny_dirs):
    """As in vLLM: --async-scheduling unset schedules ahead on a GPU, not on the CPU; --[no-]async-scheduling wins."""
    parser = argparse.ArgumentParser()
    add_engine_flags(parser, ["async_scheduling"])
    given = {(): None, ("--async-scheduling",): True, ("--no-async-scheduling",): False}
    assert {flags: parser.parse_args(list(flags)).async_scheduling for flags in given} == given
    for device, flag, ahead in [
        ("cpu", None, False),
        ("cuda", None, True),
        ("cuda", False, False),
        ("cpu", True, True),
    ]:
        config = EngineConfig.build(tiny_dirs["tiny-3b"], device=device, async_scheduling=flag)
        assert config.schedules_ahead is ahead, (device, flag)
