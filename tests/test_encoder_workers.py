"""The vision tower in worker processes of its own (--mm-encoder-workers, issue 58; one host): the same tokens as
the engine's own tower for one image, two images, a text prompt, a video and an image with a video, the engine
holding no tower; a worker killed while idle is replaced and the requests go on; one killed while it holds a job
fails that job's requests only, naming it; text requests are answered while every worker is busy; LoRA adapters of
the language model run with workers, one that changes the tower is refused."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from conftest import random_image

from fovea import LLM, SamplingParams

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


@pytest.fixture
def llms():
    """LLM(...) whose engines (and encoder workers) are closed when the test ends: a later test in this process
    counts the processes it started."""
    made = []
    yield lambda *args, **kwargs: made.append(LLM(*args, **kwargs)) or made[-1]
    for llm in made:
        llm.close()


def prompts():
    images = [random_image(120 + 30 * i, 90 + 20 * i, seed=i) for i in range(4)]
    clips = [np.random.default_rng(seed).integers(0, 255, (4, 56, 84, 3), dtype=np.uint8) for seed in (1, 2)]
    return [
        {"prompt": IMAGE + "What is it?", "multi_modal_data": {"image": images[0]}},
        {"prompt": IMAGE + IMAGE + "Both?", "multi_modal_data": {"image": images[1:3]}},
        {"prompt": "No image at all.", "multi_modal_data": {}},
        {"prompt": IMAGE + "And this one?", "multi_modal_data": {"image": images[3]}},
        {"prompt": VIDEO + "What moves?", "multi_modal_data": {"video": clips[0]}},
        {"prompt": IMAGE + VIDEO + "Both?", "multi_modal_data": {"image": images[0], "video": clips[1]}},
    ]


def assert_same_answers(got, expected) -> None:
    """The same prompt ids and greedy tokens, log-probabilities within 1e-4."""
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.prompt_token_ids == theirs.prompt_token_ids
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        for a, b in zip(mine.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True):
            assert abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob) <= 1e-4


def test_tokens_are_the_engines_own(tiny_dirs, llms):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    model_dir = str(tiny_dirs["tiny-3b"])
    expected = LLM(model_dir, dtype="float32", max_model_len=1024).generate(prompts(), params, use_tqdm=False)
    llm = llms(model_dir, dtype="float32", max_model_len=1024, mm_encoder_workers=2)
    assert llm.engine.runner.model.visual is None  # the engine holds no tower: the workers do
    got = llm.generate(prompts(), params, use_tqdm=False)
    assert_same_answers(got, expected)
    pool = llm.engine.remote_tower.encoders.pool
    victim = next(iter(pool._started))
    os.kill(victim.pid, signal.SIGKILL)  # while idle: seen when next taken, the job goes on, a replacement starts
    victim.join()  # dead before the next job (a worker dying as it is taken takes that job with it)
    for seed in (10, 11, 12):  # a job each (new images: the others are cached), the workers taken in turn
        fresh = {"prompt": IMAGE + "What is it?", "multi_modal_data": {"image": random_image(100, 80, seed=seed)}}
        assert len(llm.generate(fresh, params, use_tqdm=False)[0].outputs[0].token_ids) == 8
    deadline = time.monotonic() + 60
    while len([p for p in pool._started if p.is_alive()]) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len([p for p in pool._started if p.is_alive()]) == 2


def test_a_worker_killed_with_its_job_fails_only_its_requests(tiny_dirs, llms):
    model_dir = str(tiny_dirs["tiny-3b"])
    llm = llms(model_dir, dtype="float32", max_model_len=1024, mm_encoder_workers=1)
    worker = llm.engine.remote_tower.encoders.pool._idle[0]
    send = worker.conn.send

    def send_and_die(message):  # the worker dies holding this job (stopped first: a tiny job can be done at once)
        os.kill(worker.process.pid, signal.SIGSTOP)
        send(message)
        os.kill(worker.process.pid, signal.SIGKILL)
        worker.process.join()

    worker.conn.send = send_and_die
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(Exception, match="vision encoder worker died"):
        llm.generate(prompts()[:1], params, use_tqdm=False)
    assert not [name for name in os.listdir("/dev/shm") if f"fovea{os.getpid()}_enc_" in name]  # none left
    text = llm.generate(prompts()[2:3], params, use_tqdm=False)[0]  # the engine serves on
    assert len(text.outputs[0].token_ids) == 4
    fresh = {"prompt": IMAGE + "And?", "multi_modal_data": {"image": random_image(100, 80, seed=20)}}
    image = llm.generate(fresh, params, use_tqdm=False)[0]  # and a replacement encodes
    assert len(image.outputs[0].token_ids) == 4


def test_served_with_encoder_workers(tiny_dirs):
    """`fovea serve --mm-encoder-workers 2`: the engine process is a daemon, so its workers are plain processes
    (fovea/worker_pool.py); the chat with an image is the offline engine's, and no worker outlives the server."""
    import httpx
    import psutil
    from serving import running_server
    from test_llava_serving import data_url

    model_dir = tiny_dirs["tiny-3b"]
    image = random_image(200, 90, seed=5)
    content = [{"type": "text", "text": "What is in this picture?"}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = LLM(str(model_dir), dtype="float32", max_model_len=1024).chat(
        [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, *content]}], params, use_tqdm=False
    )[0]
    flags = ["--dtype", "float32", "--max-model-len", "1024", "--served-model-name", "m", "--mm-encoder-workers", "2"]
    with running_server(model_dir, *flags) as (base, server):
        workers = [p for p in psutil.Process(server.pid).children(recursive=True) if "fovea.worker_pool" in p.cmdline()]
        assert len(workers) == 2
        messages = [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}}, *content]}
        ]
        body = {"model": "m", "temperature": 0, "max_tokens": 6, "ignore_eos": True, "messages": messages}
        reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()
        assert reply["choices"][0]["message"]["content"] == expected.outputs[0].text
    assert not [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_image_embeddings_skip_the_workers(tiny_dirs, llms):
    """An image given as the tower's output (--enable-mm-embeds) goes to the encoder cache as it is; the same image
    as pixels goes through a worker: the same tokens."""
    from fovea.models.loader import load_tower
    from fovea.multimodal.patchify import patchify
    from fovea.multimodal.prompt import PromptProcessor

    model_dir = str(tiny_dirs["tiny-3b"])
    image = random_image(140, 100, seed=7)
    tower, config = load_tower(model_dir, dtype="float32")
    processed = PromptProcessor(model_dir, config).image_processor(image)
    with torch.no_grad():
        embeds = tower(patchify(torch.from_numpy(processed.pixels), config.image), [processed.grid_thw])
    llm = llms(model_dir, dtype="float32", max_model_len=1024, mm_encoder_workers=1, enable_mm_embeds=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    given = {"image_embeds": embeds, "image_grid_thw": list(processed.grid_thw)}
    as_embeds = llm.generate({"prompt": IMAGE + "What?", "multi_modal_data": {"image": given}}, params, use_tqdm=False)
    as_pixels = llm.generate({"prompt": IMAGE + "Why?", "multi_modal_data": {"image": image}}, params, use_tqdm=False)
    plain = LLM(model_dir, dtype="float32", max_model_len=1024)
    expected = plain.generate(
        [{"prompt": IMAGE + p, "multi_modal_data": {"image": image}} for p in ("What?", "Why?")], params, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in (*as_embeds, *as_pixels)] == [o.outputs[0].token_ids for o in expected]


def test_text_is_answered_while_every_worker_is_busy(tiny_dirs, llms):
    """The only worker taken (as a long job would hold it): an image request waits for it, a text request added
    after it is answered meanwhile; once the worker is free the image request is answered too."""
    llm = llms(str(tiny_dirs["tiny-3b"]), dtype="float32", max_model_len=1024, mm_encoder_workers=1)
    pool, engine = llm.engine.remote_tower.encoders.pool, llm.engine
    held = pool._take(time.monotonic() + 5)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for name, prompt in (("image", prompts()[0]), ("text", prompts()[2])):
        engine.add_request(llm.inputs.make_request(name, llm.inputs.process(prompt), params))
    finished, deadline = {}, time.monotonic() + 120
    while "text" not in finished:
        finished |= {out.request_id: out for out in engine.step() if out.finished}
        assert time.monotonic() < deadline
    assert "image" not in finished and len(finished["text"].outputs[0].token_ids) == 4
    pool._give_back(held)
    while "image" not in finished:
        finished |= {out.request_id: out for out in engine.step() if out.finished}
        assert time.monotonic() < deadline
    assert len(finished["image"].outputs[0].token_ids) == 4


def test_tensor_parallel_ranks_take_the_workers_embeddings(tiny_dirs, llms):
    """Two ranks on the CPU (gloo) and one worker: rank 0's encoder thread gets the embeddings from the worker and
    broadcasts them with each step, as it does its own tower's; no rank holds a tower. The single engine's
    tokens, log-probabilities within 1e-4."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    model_dir, options = str(tiny_dirs["tiny-3b"]), dict(dtype="float32", max_model_len=1024, device="cpu")
    expected = LLM(model_dir, **options).generate(prompts(), params, use_tqdm=False)
    llm = llms(model_dir, **options, tensor_parallel_size=2, mm_encoder_workers=1)
    assert llm.engine.runner.model.visual is None
    got = llm.generate(prompts(), params, use_tqdm=False)
    assert_same_answers(got, expected)


def test_lora_adapters_of_the_language_model_run_with_workers(tiny_dirs, llms, tmp_path):
    """With LoRA on, an adapter of the language model only answers as it does with the engine's own tower (text and
    image prompts); one that changes the vision tower is refused by name, since the workers run the tower bare."""
    from test_lora import write_adapter

    from fovea import LoRARequest

    model_dir = tiny_dirs["tiny-3b"]
    language = LoRARequest("language", 1, str(write_adapter(model_dir, tmp_path / "lm", ["q_proj", "v_proj"], seed=3)))
    vision = LoRARequest("vision", 2, str(write_adapter(model_dir, tmp_path / "vision", ["qkv"], seed=4)))
    options = dict(dtype="float32", max_model_len=1024, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    chosen = prompts()[:3]
    colocated = llms(str(model_dir), **options)
    expected = colocated.generate(chosen, params, use_tqdm=False, lora_request=language)
    bare = colocated.generate(chosen, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in expected] != [o.outputs[0].token_ids for o in bare]  # it changes them
    llm = llms(str(model_dir), **options, mm_encoder_workers=1)
    assert_same_answers(llm.generate(chosen, params, use_tqdm=False, lora_request=language), expected)
    with pytest.raises(ValueError, match="'vision' changes the vision tower.*--mm-encoder-workers"):
        llm.generate(chosen[:1], params, use_tqdm=False, lora_request=vision)


@pytest.mark.parametrize("family", ["qwen3-vl", "gemma3", "internvl"])
def test_other_families_through_a_worker(family, family_dirs, llms):
    """Qwen3-VL's embeddings carry its DeepStack features (wider rows), Gemma 3's are pooled to a fixed count and
    InternVL's come from tiles: through a worker, each gives the engine's own tower's tokens for two images."""
    model_dir = str(family_dirs[family])
    images = [random_image(150, 100, seed=1), random_image(90, 120, seed=2)]
    content = [*({"type": "image_pil", "image_pil": image} for image in images), {"type": "text", "text": "Which?"}]
    chat = [{"role": "user", "content": content}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    options = dict(dtype="float32", max_model_len=2048)
    expected = llms(model_dir, **options).chat(chat, params, use_tqdm=False)
    llm = llms(model_dir, **options, mm_encoder_workers=1)
    assert llm.engine.runner.model.visual is None
    assert_same_answers(llm.chat(chat, params, use_tqdm=False), expected)
