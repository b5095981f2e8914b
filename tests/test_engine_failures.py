"""The engine survives any request: a failing step fails only the request that fails it (the others of its batch
run again, each alone, and finish with their own tokens) and leaves the caches consistent; a request the model
gives NaN logits fails alone; the engine process goes on after any number of them; one request with many prompts
cannot hold everyone behind it."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import threading
import weakref

import pytest
from conftest import random_image
from test_engine_vs_hf import LOREM, assert_engine_idle

from fovea import LLM, SamplingParams
from fovea.core.messages import AddRequest, RequestsFailed, Shutdown, StepOutputs
from fovea.core.request import MMItem, RequestDelta
from fovea.core.sampling_params import RequestOutputKind
from fovea.engine import engine as engine_module
from fovea.engine.engine import StepFailed
from fovea.engine.sequence import Request, Sequence

OPTIONS = dict(dtype="float32", max_model_len=2048, num_gpu_blocks_override=300, max_num_batched_tokens=512)
GREEDY = SamplingParams(temperature=0, max_tokens=6, output_kind=RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    return LLM(str(tiny_dirs["tiny-3b"]), **OPTIONS)


def image_prompt(image):
    return {"prompt": "<|vision_start|><|image_pad|><|vision_end|>Describe.", "multi_modal_data": {"image": image}}


def request(llm, request_id, prompt, params=GREEDY, fair_rank=0):
    return llm.inputs.make_request(request_id, llm.inputs.process(prompt), params, fair_rank=fair_rank)


def run(engine):
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    return outputs


def test_a_failing_step_fails_its_requests_and_nothing_else(llm, tiny_dirs, monkeypatch):
    engine = llm.engine
    picture = random_image(200, 150, 61)
    alone = LLM(str(tiny_dirs["tiny-3b"]), **OPTIONS).generate([image_prompt(picture), LOREM], GREEDY, use_tqdm=False)

    def encoder_breaks(items):  # in the encoder's thread, after the scheduler reserved the image's entry
        raise RuntimeError("injected encoder failure")

    monkeypatch.setattr(engine.image_encoder, "_encode", encoder_breaks)
    engine.add_request(request(llm, "broken", image_prompt(picture)))
    with pytest.raises(StepFailed, match="injected encoder failure") as failed:
        for _ in range(1000):  # the failure arrives from the encoder's thread a step or a few later
            engine.step()
    assert failed.value.request_ids == ["broken"]
    assert_engine_idle(engine)  # its KV blocks and encoder-cache references are back
    monkeypatch.setattr(engine.image_encoder, "_encode", engine.runner.encode_images)
    # the same picture again: the half-made encoder entry was dropped, so it is encoded afresh
    engine.add_request(request(llm, "again", image_prompt(picture)))
    engine.add_request(request(llm, "text", LOREM))
    outputs = run(engine)
    assert outputs["again"].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert outputs["text"].outputs[0].token_ids == alone[1].outputs[0].token_ids

    # a failure in the model that every step meets: the two requests of the failed step run again, each alone,
    # and each fails alone; a request added afterwards runs normally
    engine.add_request(request(llm, "first", LOREM))
    engine.step()
    engine.add_request(request(llm, "second", "Hello there"))
    real_execute = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda *a: (_ for _ in ()).throw(RuntimeError("device error")))
    assert failures_until_idle(engine) == [["first"], ["second"]]
    assert_engine_idle(engine)
    monkeypatch.setattr(engine.runner, "execute", real_execute)
    engine.add_request(request(llm, "after", LOREM))
    assert run(engine)["after"].outputs[0].token_ids == alone[1].outputs[0].token_ids
    assert_engine_idle(engine)


def fail_steps_running(engine, prefix: str | set[str], monkeypatch) -> None:
    """Every step that runs a request whose id starts with `prefix` (or is one of a set) raises, in the model's
    forward (as a real failure would: after the runner has taken the step's rows)."""
    real_execute, real_run_step = engine.runner.execute, engine.runner.run_step
    poisoned = [False]
    is_poison = prefix.__contains__ if isinstance(prefix, set) else lambda request_id: request_id.startswith(prefix)

    def execute(step, cache, *ahead):
        requests = [r for r in engine.requests.values() if is_poison(r.request_id)]
        poisoned[0] = bool({seq.seq_id for r in requests for seq in r.sequences}.intersection(step.seq_ids))
        return real_execute(step, cache, *ahead)

    def run_step(*args):
        if poisoned[0]:
            raise RuntimeError("injected step failure")
        return real_run_step(*args)

    monkeypatch.setattr(engine.runner, "execute", execute)
    monkeypatch.setattr(engine.runner, "run_step", run_step)


def failures_until_idle(engine, outputs: dict | None = None) -> list[list[str]]:
    """Steps until nothing is left; the request ids of each StepFailed, in order."""
    failures = []
    while engine.has_unfinished_requests():
        try:
            for output in engine.step():
                if output.finished and outputs is not None:
                    outputs[output.request_id] = output
        except StepFailed as failed:
            failures.append(failed.request_ids)
    return failures


def test_requests_batched_with_a_failing_one_finish_with_their_own_tokens(llm, monkeypatch):
    """A step fails whenever it runs one of ten 'poison' requests: the first failure recomputes everyone it ran,
    each alone; every poison request fails alone, and the others finish with the tokens they get alone."""
    engine = llm.engine
    prompts = {f"victim-{i}": f"Victim {i} writes" + " more" * i for i in range(4)}
    alone = dict(zip(prompts, llm.generate(list(prompts.values()), GREEDY.clone(max_tokens=8), use_tqdm=False)))
    fail_steps_running(engine, "poison", monkeypatch)
    for i, (request_id, prompt) in enumerate(prompts.items()):
        engine.add_request(request(llm, request_id, prompt, GREEDY.clone(max_tokens=8)))
        for j in range(3):
            engine.add_request(request(llm, f"poison-{i}-{j}", LOREM))
    outputs = {}
    failures = failures_until_idle(engine, outputs)
    assert sorted(failures) == sorted([[f"poison-{i}-{j}"] for i in range(4) for j in range(3)])  # each alone
    assert sorted(outputs) == sorted(prompts)
    for request_id, output in outputs.items():
        assert output.outputs[0].token_ids == alone[request_id].outputs[0].token_ids, request_id
    assert_engine_idle(engine)


def test_images_encoded_with_a_failing_one_are_encoded_again_alone(llm, monkeypatch):
    """The vision tower fails whenever it runs one poison picture: the images encoded with it are encoded again,
    each alone, so only the request showing the poison fails and the others end with their own tokens."""
    engine = llm.engine
    pictures = [random_image(120 + 28 * i, 90, 70 + i) for i in range(6)]
    alone = llm.generate([image_prompt(p) for p in pictures[1:]], GREEDY, use_tqdm=False)
    llm.reset_mm_cache()
    poison_hash = llm.inputs.process(image_prompt(pictures[0])).images[0].content_hash
    real_encode, runs = engine.image_encoder._encode, []

    def encode(items):
        runs.append(len(items))
        if any(item.content_hash == poison_hash for item in items):
            raise RuntimeError("injected: the tower fails on this picture")
        return real_encode(items)

    monkeypatch.setattr(engine.image_encoder, "_encode", encode)
    for i, picture in enumerate(pictures):
        engine.add_request(request(llm, f"image-{i}", image_prompt(picture)))
    outputs = {}
    assert failures_until_idle(engine, outputs) == [["image-0"]]
    assert max(runs) > 1  # the poison was encoded with others first
    assert {rid: o.outputs[0].token_ids for rid, o in outputs.items()} == {
        f"image-{i}": a.outputs[0].token_ids for i, a in enumerate(alone, 1)
    }
    assert_engine_idle(engine)


def test_image_failures_collected_together_each_reach_their_requests(llm, monkeypatch):
    """The tower fails on every image (a device out of memory) and the engine collects the failures of two
    requests at once: each request is failed and told (a request left out would wait for ever), and a text
    request beside them ends with its own tokens. Offline, the call that meets them raises, and the next call
    runs as if they had never been."""
    engine = llm.engine
    plain = "A plain request"
    alone = llm.generate([plain], GREEDY, use_tqdm=False)[0]
    llm.reset_mm_cache()
    pictures = [random_image(56 + 28 * i, 56, 90 + i) for i in range(3)]
    two = {
        "prompt": "<|vision_start|><|image_pad|><|vision_end|>" * 2 + "Compare.",
        "multi_modal_data": {"image": pictures[:2]},
    }
    prompts = {"two-pictures": two, "one-picture": image_prompt(pictures[2])}
    hashes = {image.content_hash for prompt in prompts.values() for image in llm.inputs.process(prompt).images}
    encoder, held, real_collect = engine.image_encoder, [], engine.image_encoder.collect

    def encode(items):
        raise RuntimeError("injected: out of memory in the tower")

    def collect(wait_s=0.0):  # holds the failures back until every image has failed, then hands all over at once
        held.extend(real_collect(wait_s))
        failed = {item.content_hash for result in held for item in result.items}
        if failed != hashes:
            encoder.in_flight.update(failed)  # still out, as far as the engine can tell
            return []
        encoder.in_flight.difference_update(failed)
        return [held.pop() for _ in range(len(held))][::-1]

    monkeypatch.setattr(encoder, "_encode", encode)
    monkeypatch.setattr(encoder, "collect", collect)
    for request_id, prompt in prompts.items():
        engine.add_request(request(llm, request_id, prompt))
    engine.add_request(request(llm, "plain", plain))
    outputs = {}
    failures = failures_until_idle(engine, outputs)
    assert sorted(request_id for failure in failures for request_id in failure) == sorted(prompts)
    assert list(outputs) == ["plain"] and outputs["plain"].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_engine_idle(engine)
    # offline: the call raises the first failure; the next call does not meet the second
    with pytest.raises(StepFailed, match="out of memory in the tower"):
        llm.generate(list(prompts.values()), GREEDY, use_tqdm=False)
    assert llm.generate([plain], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_engine_idle(engine)


def test_a_step_scheduled_ahead_and_the_step_before_it_failing_in_one_call_fail_both_requests(tiny_dirs, monkeypatch):
    """Scheduling ahead (async scheduling): the second request arrives as the first's last step runs, so that
    one call launches the second's first step and records the first's last; both fail there. Each request is
    told (the failure recorded second once replaced the first, whose client then waited for ever)."""
    llm = LLM(str(tiny_dirs["tiny-3b"]), **OPTIONS, async_scheduling=True)
    engine = llm.engine
    real_execute, real_step_done, broken = engine.runner.execute, engine.scheduler.step_done, []

    def ids_of(request_id):
        request = engine.requests.get(request_id)
        return {seq.seq_id for seq in request.sequences} if request is not None else set()

    def execute(step, cache, *ahead):
        if ids_of("second").intersection(step.seq_ids) and "second" not in broken:
            broken.append("second")
            raise RuntimeError("injected: the second request's first step fails")
        return real_execute(step, cache, *ahead)

    def step_done(batch):
        if "second" in broken and "first" not in broken and any(s.request.request_id == "first" for s in batch.seqs):
            broken.append("first")  # recorded after the second's launch failed, in the same call
            raise RuntimeError("injected: the first request's last step fails to record")
        return real_step_done(batch)

    monkeypatch.setattr(engine.runner, "execute", execute)
    monkeypatch.setattr(engine.scheduler, "step_done", step_done)
    engine.add_request(request(llm, "first", "Hello", GREEDY.clone(max_tokens=3)))
    for _ in range(3):  # its prompt's step, then its two decode steps are launched, the last one in flight
        assert engine.step() == []
    engine.add_request(request(llm, "second", "Hello again"))
    failures = failures_until_idle(engine)
    assert broken == ["second", "first"]
    assert sorted(failures) == [["first"], ["second"]]
    assert_engine_idle(engine)


def test_a_suspect_runs_with_the_others_again_once_a_step_samples_for_it(llm, monkeypatch):
    """After a failed step its requests are suspects, each run alone; one that a step samples for is cleared and
    joins the batch again: the step after everyone is cleared runs all of them together."""
    engine = llm.engine
    real_execute, sizes, failed = engine.runner.execute, [], []

    def execute(step, cache, *ahead):
        if not failed and len(step.seq_ids) == 3:  # the first step that runs all three: fails once
            failed.append(True)
            raise RuntimeError("injected step failure")
        sizes.append(len(step.seq_ids))
        return real_execute(step, cache, *ahead)

    monkeypatch.setattr(engine.runner, "execute", execute)
    for i in range(3):
        engine.add_request(request(llm, f"suspect-{i}", f"Suspect {i} says", GREEDY.clone(max_tokens=12)))
    assert failures_until_idle(engine) == []
    assert failed and 3 in sizes, sizes
    together = sizes.index(3)
    assert sizes[:together].count(1) >= 3  # each recomputed alone until a step sampled for it,
    assert sizes.count(3) >= 5  # then all three together again (until the first finishes)
    assert_engine_idle(engine)


def test_a_row_of_nan_logits_fails_its_request_alone(llm, monkeypatch):
    """The model gives one request NaN logits and another +inf (a broken adapter, an fp16 overflow), with top_p
    drawing over whole rows: those requests fail naming the cause, the others draw what they draw alone."""
    engine = llm.engine
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=6, output_kind=RequestOutputKind.FINAL_ONLY)
    prompts = {"plain": "A plain request", "other": LOREM}
    alone = dict(zip(prompts, llm.generate(list(prompts.values()), params, use_tqdm=False)))
    poison = {101: float("nan"), 102: float("inf")}  # by seed: the rows' parameters are the requests' own
    sampler = engine.runner.sampler

    def poisoned(logits, rows, *rest):
        for i, row in enumerate(rows):
            if row.params.seed in poison:
                logits[i, :] = poison[row.params.seed]
        return sampler(logits, rows, *rest)

    monkeypatch.setattr(engine.runner, "sampler", poisoned)
    for request_id, prompt in prompts.items():
        engine.add_request(request(llm, request_id, prompt, params))
    engine.add_request(request(llm, "broken-nan", "Another request", params.clone(seed=101)))
    engine.add_request(request(llm, "broken-inf", "And one more", params.clone(seed=102)))
    outputs, failures = {}, []
    while engine.has_unfinished_requests():
        try:
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
        except StepFailed as failed:
            assert "NaN or infinite" in str(failed)
            failures += failed.request_ids
    assert sorted(failures) == ["broken-inf", "broken-nan"]
    assert {k: v.outputs[0].token_ids for k, v in outputs.items()} == {
        k: v.outputs[0].token_ids for k, v in alone.items()
    }
    assert_engine_idle(engine)


def test_a_failed_request_whose_samples_had_not_forked_is_no_longer_a_suspect(llm, monkeypatch):
    """A request of n=2 fails before its second sample forks. It must stop being a suspect: the first suspect in
    line runs alone, so one that stayed there would keep every later suspect (here the request whose step it
    failed) from running again."""
    engine = llm.engine
    fail_steps_running(engine, "poison", monkeypatch)
    engine.add_request(request(llm, "poison", LOREM, GREEDY.clone(n=2)))
    engine.add_request(request(llm, "victim", "A victim writes", GREEDY))
    outputs, failures = {}, []
    for _ in range(100):  # a few dozen steps at most; not a hang when it breaks
        if not engine.has_unfinished_requests():
            break
        try:
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
        except StepFailed as failed:
            failures.append(failed.request_ids)
    assert failures == [["poison"]] and list(outputs) == ["victim"], (failures, list(outputs))
    assert_engine_idle(engine)


def test_requests_that_leave_the_engine_are_freed_without_the_cyclic_collector(llm, monkeypatch):
    """A request that finishes, one aborted and one whose step fails: once the engine has let them go, nothing is
    left of them, their pixels included, before any run of the cyclic garbage collector. (A request and its samples
    point to each other: left so, they waited for a collection that runs rarely in a process of this size, and the
    engine's heap grew by hundreds of MB under image traffic in between: issue 56.)"""
    engine = llm.engine
    fail_steps_running(engine, "poison", monkeypatch)
    # pytest keeps the log records it captures (in CI it captured fovea's), and the failure's is logged with its
    # traceback, whose frames hold the step that failed and the one run ahead of it: here the engine's go nowhere
    quiet = logging.getLogger("fovea.tests.quiet")
    quiet.propagate = False
    monkeypatch.setattr(engine_module, "logger", quiet)
    long = GREEDY.clone(max_tokens=40, output_kind=RequestOutputKind.DELTA)
    gc.collect()
    gc.disable()
    try:
        for request_id, params in [("finishes", GREEDY), ("aborted", long), ("poison", GREEDY)]:
            picture = random_image(120 + len(request_id), 90, len(request_id))
            engine.add_request(request(llm, request_id, image_prompt(picture), params.clone(n=2)))
        ours = set(engine.requests)  # (objects of the module's earlier tests may still be held: not counted)
        hashes = {item.content_hash for r in engine.requests.values() for item in r.mm_items}
        pixels = [weakref.ref(item.pixels) for r in engine.requests.values() for item in r.mm_items]
        for _ in range(3):
            engine.step()
        engine.abort_request("aborted")
        failures = failures_until_idle(engine)
        assert failures == [["poison"]]
        # the runner keeps a finished sample's row (and its images) until the next step says it is gone
        engine.add_request(request(llm, "next", "And now?", GREEDY))
        assert failures_until_idle(engine) == []
        left = [
            type(o).__name__
            for o in gc.get_objects()
            if (isinstance(o, Request) and o.request_id in ours)
            or (isinstance(o, Sequence) and o.request.request_id in ours)
            or (isinstance(o, MMItem) and o.content_hash in hashes)
        ]
        alive = sum(ref() is not None for ref in pixels)
    finally:
        gc.enable()
    assert left == [] and alive == 0, (left, alive)
    assert len(pixels) == 3
    assert_engine_idle(engine)


def test_the_engine_process_loop_goes_on_after_failed_steps(llm, monkeypatch):
    """engine_core._serve answers a failed request with RequestsFailed(ids, message) and keeps serving, however
    many fail; only steps that fail in a row with no request to blame (a scheduler bug, a broken device) end it
    (the front end then starts a new engine process)."""
    from fovea.engine.engine_core import MAX_FAILED_STEPS_IN_A_ROW, _serve

    engine = llm.engine
    fail_steps_running(engine, "boom", monkeypatch)
    command_reader, commands = multiprocessing.Pipe(duplex=False)
    results, result_writer = multiprocessing.Pipe(duplex=False)
    stopped = []

    def serve():
        try:
            _serve(engine, command_reader, result_writer.send)
        except RuntimeError as error:
            stopped.append(error)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def until(kind):
        while True:
            message = results.recv()
            if isinstance(message, kind):
                return message

    commands.send(AddRequest(request(llm, "boom-1", LOREM)))
    assert until(RequestsFailed) == RequestsFailed(["boom-1"], "RuntimeError: injected step failure")
    commands.send(AddRequest(request(llm, "fine", "Hello", GREEDY.clone(max_tokens=3))))
    while not any(o.request_id == "fine" and o.finished for o in map(RequestDelta._make, until(StepOutputs).outputs)):
        pass
    for i in range(3 * MAX_FAILED_STEPS_IN_A_ROW):  # one failing request after another: none ends the loop
        commands.send(AddRequest(request(llm, f"boom-again-{i}", LOREM)))
        assert until(RequestsFailed).request_ids == [f"boom-again-{i}"]
    commands.send(AddRequest(request(llm, "fine-again", "Hello", GREEDY.clone(max_tokens=3))))
    while not any(
        o.request_id == "fine-again" and o.finished for o in map(RequestDelta._make, until(StepOutputs).outputs)
    ):
        pass
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: (_ for _ in ()).throw(RuntimeError("scheduler bug")))
    commands.send(AddRequest(request(llm, "unlucky", "Hello", GREEDY.clone(max_tokens=3))))
    thread.join(timeout=60)
    assert stopped and "scheduler bug" in str(stopped[0])
    engine.abort_request(list(engine.requests))
    engine.finished_outputs.clear()
    assert_engine_idle(engine)


def test_the_engine_process_sends_a_message_when_a_step_reports_or_the_stats_are_due(llm, monkeypatch):
    """A non-streamed request's steps send nothing up the pipe until it finishes; the gauges come with that
    report (and, while steps go on, at most every STATS_EVERY_S, here never)."""
    from fovea.engine import engine_core

    monkeypatch.setattr(engine_core, "STATS_EVERY_S", 1e9)
    command_reader, commands = multiprocessing.Pipe(duplex=False)
    results, result_writer = multiprocessing.Pipe(duplex=False)
    thread = threading.Thread(target=engine_core._serve, args=(llm.engine, command_reader, result_writer.send))
    thread.start()
    try:
        commands.send(AddRequest(request(llm, "quiet", "Hello", GREEDY.clone(max_tokens=8))))
        message = results.recv()
        assert isinstance(message, StepOutputs)
        assert [(o.request_id, o.finished) for o in map(RequestDelta._make, message.outputs)] == [("quiet", True)]
        assert len(message.outputs[0][1][0][1]) == 8  # its 8 tokens, in 8 steps with no message before
        assert message.stats.num_running == 0
    finally:
        commands.send(Shutdown())
        thread.join(timeout=60)
    assert not results.poll()


def test_a_request_with_many_prompts_does_not_hold_the_others_back(tiny_dirs):
    """Prompt i of one API request waits behind the first prompts of requests that arrive after it."""
    llm = LLM(str(tiny_dirs["tiny-3b"]), **{**OPTIONS, "max_num_seqs": 2})
    engine = llm.engine
    for i in range(4):
        engine.add_request(request(llm, f"many-{i}", LOREM, fair_rank=i))
    engine.add_request(request(llm, "later", "Hello"))
    engine.step()
    assert sorted(seq.request.request_id for seq in engine.scheduler.running) == ["later", "many-0"]
    outputs = run(engine)
    assert len(outputs) == 5 and all(o.outputs[0].finish_reason == "length" for o in outputs.values())


def test_n_above_max_num_seqs_is_refused_offline(tiny_dirs):
    llm = LLM(str(tiny_dirs["tiny-3b"]), **{**OPTIONS, "max_num_seqs": 4})
    with pytest.raises(ValueError, match="n=5 is more than max_num_seqs=4"):
        llm.generate("Hi", SamplingParams(n=5), use_tqdm=False)
    assert_engine_idle(llm.engine)
