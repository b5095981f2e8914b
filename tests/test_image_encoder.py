"""The vision tower runs beside the language model: decoding goes on while images are encoded, and the per-step
encoder budget spreads image work over steps (an image larger than the budget still goes, alone)."""

from __future__ import annotations

import threading

from conftest import random_image
from test_engine_vs_hf import LOREM, assert_engine_idle

from fovea import LLM, SamplingParams
from fovea.core.sampling_params import RequestOutputKind

OPTIONS = dict(dtype="float32", max_model_len=2048, num_gpu_blocks_override=300, max_num_batched_tokens=256)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def image_prompt(*images):
    return {"prompt": IMAGE * len(images) + "Describe.", "multi_modal_data": {"image": list(images)}}


def add(llm, request_id, prompt):
    llm.engine.add_request(llm.inputs.make_request(request_id, llm.inputs.process(prompt), GREEDY))


def test_decoding_goes_on_while_an_image_is_encoded(tiny_dirs):
    llm = LLM(str(tiny_dirs["tiny-3b"]), **OPTIONS)
    picture = random_image(640, 480, 3)
    final_only = GREEDY.clone(output_kind=RequestOutputKind.FINAL_ONLY)
    reference = LLM(str(tiny_dirs["tiny-3b"]), **OPTIONS).generate(
        [LOREM, image_prompt(picture)], final_only, use_tqdm=False
    )
    engine = llm.engine
    release = threading.Event()
    encode = engine.image_encoder._encode

    def held_encode(items):
        release.wait(60)
        return encode(items)

    engine.image_encoder._encode = held_encode
    tokens = {"text": [], "image": []}

    def step():
        for output in engine.step():
            tokens[output.request_id] += output.outputs[0].token_ids

    add(llm, "text", LOREM)
    step()  # the text prompt is prefilled
    add(llm, "image", image_prompt(picture))
    for _ in range(6):  # the encoder is stuck on the picture: the text request keeps decoding meanwhile
        step()
    assert len(tokens["text"]) >= 7 and tokens["image"] == []
    assert engine.image_encoder.in_flight
    release.set()
    while engine.has_unfinished_requests():
        step()
    assert tokens["text"] == reference[0].outputs[0].token_ids
    assert tokens["image"] == reference[1].outputs[0].token_ids
    assert_engine_idle(engine)


def test_the_encoder_budget_spreads_images_over_steps(tiny_dirs):
    pictures = [random_image(224, 168, 10 + i) for i in range(3)]  # 48 image tokens each
    prompt = image_prompt(*pictures)
    params = GREEDY.clone(output_kind=RequestOutputKind.FINAL_ONLY)
    unlimited = LLM(str(tiny_dirs["tiny-3b"]), **OPTIONS).generate(prompt, params, use_tqdm=False)[0]
    llm = LLM(str(tiny_dirs["tiny-3b"]), **OPTIONS, max_num_encoder_input_tokens=100)
    submitted = []
    submit = llm.engine.image_encoder.submit
    llm.engine.image_encoder.submit = lambda items: submitted.append(len(items)) or submit(items)
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == unlimited.outputs[0].token_ids
    assert submitted == [2, 1]  # 48 + 48 <= 100 < 144: two in the first step, the third in a later one
    alone = LLM(str(tiny_dirs["tiny-3b"]), **OPTIONS, max_num_encoder_input_tokens=16)
    submitted.clear()
    submit_alone = alone.engine.image_encoder.submit
    alone.engine.image_encoder.submit = lambda items: submitted.append(len(items)) or submit_alone(items)
    assert alone.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == unlimited.outputs[0].token_ids
    assert submitted == [1, 1, 1]  # each over the budget of 16: each goes alone
    assert_engine_idle(alone.engine)


def test_a_closed_encoder_lets_its_process_exit_cleanly():
    """close() waits for the encoder's thread: a thread still freeing its last images' tensors while the interpreter
    shut down aborted the process (the engine process, at every server stop: "terminate called without an active
    exception", exit status 134)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import torch
        from fovea.runner.image_encoder import ImageEncoder

        class Item:
            def __init__(self, i):
                self.content_hash, self.pixels = str(i), [torch.randn(256, 1024) for _ in range(8)]

        encoder = ImageEncoder(lambda items: [torch.ones(64, 64) for _ in items], torch.device("cpu"))
        encoder.submit([Item(i) for i in range(8)])
        assert len(encoder.collect(wait_s=60)) == 1
        encoder.close()
        """
    )
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "terminate called" not in done.stderr, (done.returncode, done.stderr[-2000:])


def test_a_waiting_engine_thread_encodes_queued_pieces_itself():
    """shares=2 (the CPU): a submission is cut in two; the encoder's thread takes the first piece, and a caller
    that would wait for results (a step with nothing else to run) encodes the second itself instead of idling."""
    import torch

    from fovea.runner.image_encoder import ImageEncoder

    class Item:
        def __init__(self, i):
            self.content_hash = str(i)

    held, threads = threading.Event(), {}

    def encode(items):
        threads.update({item.content_hash: threading.current_thread().name for item in items})
        if items[0].content_hash == "0":
            held.wait(60)  # the encoder's thread, on the first piece, until released
        return [torch.full((1,), float(item.content_hash)) for item in items]

    encoder = ImageEncoder(encode, torch.device("cpu"), shares=2)
    try:
        encoder.submit([Item(i) for i in range(4)])
        while "0" not in threads:  # the encoder's thread has the first piece
            threading.Event().wait(0.01)
        second = encoder.collect(wait_s=30)
        assert [[item.content_hash for item in r.items] for r in second] == [["2", "3"]]
        assert [float(e) for e in second[0].embeddings] == [2.0, 3.0]
        assert threads["2"] == threads["3"] == threading.current_thread().name
        assert encoder.in_flight == {"0", "1"}
        assert encoder.collect(wait_s=0.05) == []  # nothing queued: it waits, and the first piece is still held
        held.set()
        first = encoder.collect(wait_s=30)
        assert [item.content_hash for item in first[0].items] == ["0", "1"] and not encoder.in_flight
        assert threads["0"] == threads["1"] == "fovea-image-encoder"
    finally:
        held.set()
        encoder.close()


def test_an_engine_that_helps_its_encoder_gives_the_same_tokens(tiny_dirs):
    """Images of a step encoded half in the engine's thread (the CPU default) give the tokens that the encoder's
    thread alone gives."""
    prompts = [image_prompt(random_image(224, 168, 20 + i), random_image(168, 224, 40 + i)) for i in range(4)]
    params = GREEDY.clone(output_kind=RequestOutputKind.FINAL_ONLY)
    alone = LLM(str(tiny_dirs["tiny-3b"]), **{**OPTIONS, "max_num_batched_tokens": 2048, "device": "cpu"})
    alone.engine.image_encoder.shares = 1
    helped = LLM(str(tiny_dirs["tiny-3b"]), **{**OPTIONS, "max_num_batched_tokens": 2048, "device": "cpu"})
    assert helped.engine.image_encoder.shares == 2
    names = []
    encode = helped.engine.image_encoder._encode
    helped.engine.image_encoder._encode = lambda items: names.append(threading.current_thread().name) or encode(items)
    expected = [o.outputs[0].token_ids for o in alone.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in helped.generate(prompts, params, use_tqdm=False)] == expected
    assert threading.current_thread().name in names and "fovea-image-encoder" in names
    assert_engine_idle(helped.engine)
