"""A real `fovea serve` process on 127.0.0.1, driven by the official openai SDK (sync, async, streaming)."""

from __future__ import annotations

import asyncio
import base64
import json
import math

import httpx
import openai
import pytest
from conftest import hf_tokenizer, jpeg_bytes, random_image
from serving import running_server

from fovea import LLM, SamplingParams

KEY = "sk-fovea-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
HELLO = [{"role": "user", "content": "Say something."}]
OPTIONS = dict(dtype="float32", max_model_len=2048, num_gpu_blocks_override=400)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "boat.jpg").write_bytes(jpeg_bytes(random_image(320, 240, 50)))
    return root


@pytest.fixture(scope="module")
def server(tiny_dirs, media_dir):
    with running_server(
        tiny_dirs["tiny-3b"],
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--num-gpu-blocks-override",
        "400",
        "--served-model-name",
        "tiny",
        "tiny-alias",
        "--api-key",
        KEY,
        "--allowed-local-media-path",
        str(media_dir),
        "--trust-remote-code",
        "--enable-mm-embeds",
        "--disable-playground",
        "--enable-tokenizer-info-endpoint",
        env={"VLLM_SERVER_DEV_MODE": "1"},
    ) as (base, proc):
        yield base
    # SIGTERM is a clean shutdown, the engine process's too (its image-encoder thread ended before the interpreter)
    assert proc.returncode == 0 and "terminate called" not in proc.output, proc.output
    assert "accepted and ignored trust_remote_code=True" in proc.output


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    return LLM(str(tiny_dirs["tiny-3b"]), **OPTIONS)


def greedy(llm, max_tokens):
    """What a server request with temperature=0 and nothing else gets: the checkpoint's generation_config
    defaults (a repetition penalty here) for the fields it leaves out, as vLLM does."""
    return llm.get_default_sampling_params().clone(temperature=0, max_tokens=max_tokens)


def image_message(url: str, text: str = "What is in the picture?"):
    return [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}
    ]


def data_url_of(raw: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(raw).decode()


def data_url(path) -> str:
    return data_url_of(path.read_bytes())


def test_disable_playground_leaves_no_page(server):
    for path in ("/", "/playground", "/playground/app.js", "/playground/settings"):
        assert httpx.get(server + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 404, path
    for path in ("/start_profile", "/stop_profile"):  # without VLLM_TORCH_PROFILER_DIR, as vLLM
        assert httpx.post(server + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 404, path


def test_dev_mode_reset_prefix_cache_makes_the_next_prompt_compute_again(client, server):
    """vLLM's development route (VLLM_SERVER_DEV_MODE=1): after /reset_prefix_cache a prompt seen before finds no
    cached tokens; without the reset it finds its full blocks."""
    prompt = "Count the letters of every word in this sentence, one by one, carefully. " * 6

    def cached() -> int:
        usage = client.completions.create(model="tiny", prompt=prompt, max_tokens=1).usage
        return usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0

    cached()
    assert cached() >= 64  # the same prompt again: its full blocks come from the cache

    # vLLM's cache_salt: blocks are found only by requests with the same salt (once ignored, silently)
    def salted(salt: str):
        extra = {"cache_salt": salt}
        return client.completions.create(
            model="tiny", prompt=prompt, max_tokens=1, extra_body=extra
        ).usage.prompt_tokens_details

    assert salted("tenant-a") is None and salted("tenant-b") is None  # no cached tokens, no details
    assert salted("tenant-a").cached_tokens >= 64
    reply = httpx.post(server + "/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 200
    assert cached() == 0
    assert cached() >= 64


def test_dev_mode_reset_mm_cache_makes_the_next_image_encode_again(client, server, media_dir):
    """vLLM's /reset_mm_cache (VLLM_SERVER_DEV_MODE=1): an image seen before is encoded again after it (an
    encoder-cache miss), and found again after that."""
    from serving import metric

    url, auth = data_url(media_dir / "boat.jpg"), {"Authorization": f"Bearer {KEY}"}

    def hits_after_one_chat() -> float:
        client.chat.completions.create(model="tiny", messages=image_message(url), max_tokens=1)
        return metric(server, "fovea:encoder_cache_hits_total")

    before = hits_after_one_chat()
    assert hits_after_one_chat() == before + 1
    assert httpx.post(server + "/reset_mm_cache", headers=auth).status_code == 200
    assert hits_after_one_chat() == before + 1  # encoded again
    assert hits_after_one_chat() == before + 2


def test_a_clients_request_id_names_the_response_as_vllm_does(client, server):
    """vLLM's rule: the response's id is the prefix and the client's X-Request-Id header, else the body's
    request_id; two requests may carry the same one (the engine's own id adds a random part)."""
    import concurrent.futures

    hello = [{"role": "user", "content": "Hi"}]

    def chat_id(**extra) -> str:
        return client.chat.completions.create(model="tiny", messages=hello, max_tokens=2, **extra).id

    assert chat_id(extra_body={"request_id": "trace-7"}) == "chatcmpl-trace-7"
    headed = {"extra_headers": {"X-Request-Id": "from-header"}, "extra_body": {"request_id": "from-body"}}
    assert chat_id(**headed) == "chatcmpl-from-header"
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        same = list(pool.map(lambda _: chat_id(extra_body={"request_id": "same"}), range(3)))
    assert same == ["chatcmpl-same"] * 3
    completion = client.completions.create(
        model="tiny", prompt=["a", "b"], max_tokens=2, extra_body={"request_id": "c1"}
    )
    assert completion.id == "cmpl-c1" and len(completion.choices) == 2
    assert (
        client.responses.create(model="tiny", input="Hi", max_output_tokens=2, extra_body={"request_id": "r1"}).id
        == "resp_r1"
    )
    assert chat_id().startswith("chatcmpl-") and len(chat_id()) > len("chatcmpl-") + 16  # made up when none is given
    for bad in ("x" * 257, "line\nbreak"):
        with pytest.raises(openai.BadRequestError, match="printable characters"):
            chat_id(extra_body={"request_id": bad})


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    assert httpx.get(server + "/version").json()["version"]


def test_chat_with_images_equals_offline_greedy(client, llm, media_dir):
    path = media_dir / "boat.jpg"
    expected = llm.chat(image_message(data_url(path)), greedy(llm, 12), use_tqdm=False)[0]
    for url in (data_url(path), f"file://{path}"):
        reply = client.chat.completions.create(model="tiny", messages=image_message(url), temperature=0, max_tokens=12)
        assert reply.choices[0].message.content == expected.outputs[0].text
        assert reply.usage.completion_tokens == len(expected.outputs[0].token_ids)
        assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)  # image tokens counted


def test_a_repeated_image_is_a_processor_cache_hit(client, server):
    """--mm-processor-cache-gb (default 4): the same bytes again are not decoded again, and answer the same."""
    from serving import metric

    url = data_url_of(jpeg_bytes(random_image(180, 140, 61)))
    before = (metric(server, "fovea:mm_cache_queries_total"), metric(server, "fovea:mm_cache_hits_total"))
    replies = [
        client.chat.completions.create(model="tiny", messages=image_message(url), temperature=0, max_tokens=6)
        for _ in range(2)
    ]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    after = (metric(server, "fovea:mm_cache_queries_total"), metric(server, "fovea:mm_cache_hits_total"))
    assert (after[0] - before[0], after[1] - before[1]) == (2, 1)
    assert metric(server, "vllm:mm_cache_hits_total") == after[1]


def test_image_embeds_part_answers_as_the_image(client, media_dir, tiny_dirs):
    """--enable-mm-embeds: vLLM's image_embeds part (a base64 torch.save of our tower's output, with its grid)
    gets the image's answer; one that does not fit the model is a 400 naming the shapes."""
    import io

    import torch
    from conftest import our_model

    from fovea.multimodal.patchify import patchify

    path = media_dir / "boat.jpg"
    model, prompts = our_model(tiny_dirs["tiny-3b"])
    processed = prompts.process("<|vision_start|><|image_pad|><|vision_end|>", [path.read_bytes()]).images[0]
    with torch.inference_mode():
        embeds = model.encode_images(
            patchify(torch.from_numpy(processed.pixels), model.config.image), [processed.grid_thw]
        )[0]

    def part(tensor):
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        encoded = base64.b64encode(buffer.getvalue()).decode()
        return {
            "type": "image_embeds",
            "image_embeds": {"image_embeds": encoded, "image_grid_thw": list(processed.grid_thw)},
        }

    def ask(content):
        messages = [{"role": "user", "content": [content, {"type": "text", "text": "What is in the picture?"}]}]
        return client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=8)

    as_image = ask({"type": "image_url", "image_url": {"url": data_url(path)}})
    as_embeds = ask(part(embeds))
    assert as_embeds.choices[0].message.content == as_image.choices[0].message.content
    assert as_embeds.usage.prompt_tokens == as_image.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="do not fit the model"):
        ask(part(embeds[1:]))


def test_multi_image_multi_turn_chat_equals_offline_greedy(client, llm, media_dir):
    other = data_url_of(jpeg_bytes(random_image(200, 260, 51)))
    boat = data_url(media_dir / "boat.jpg")
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": boat}}, {"type": "text", "text": "What is this?"}],
        },
        {"role": "assistant", "content": "A boat on the water."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare it with"},
                {"type": "image_url", "image_url": {"url": other}},
                {"type": "text", "text": "and with"},
                {"type": "image_url", "image_url": {"url": f"file://{media_dir / 'boat.jpg'}"}},
            ],
        },
    ]
    expected = llm.chat(messages, greedy(llm, 12), use_tqdm=False)[0]
    reply = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12)
    assert reply.choices[0].message.content == expected.outputs[0].text
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_completions_equal_offline_greedy(client, llm):
    prompts = ["The harbour at dawn", "Count: one two"]
    expected = llm.generate(prompts, greedy(llm, 10), use_tqdm=False)
    reply = client.completions.create(model="tiny-alias", prompt=prompts, temperature=0, max_tokens=10)
    assert [c.text for c in reply.choices] == [e.outputs[0].text for e in expected]
    assert reply.choices[0].finish_reason == "length"


def test_completions_echo_the_prompt_streamed_as_whole(server):
    """vLLM's echo on completions: each choice's text starts with its prompt, and with logprobs its entries start
    with the prompt's tokens; streamed, the same text and entries (the prompt with each choice's first chunk; it
    was left out)."""
    prompts = ["The harbour at dawn", "Count: one two"]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 4, "echo": True, "logprobs": 1, "n": 2}
    body |= {"temperature": 1.0, "seed": 5, "ignore_eos": True}
    whole = httpx.post(server + "/v1/completions", json=body, headers=AUTH, timeout=60).json()["choices"]
    events = stream_events(server, "/v1/completions", {**body, "stream": True})
    assert len(whole) == 4
    for choice in whole:
        streamed = [c for event in events for c in event["choices"] if c["index"] == choice["index"]]
        assert choice["text"].startswith(prompts[choice["index"] // 2])
        assert "".join(c["text"] for c in streamed) == choice["text"]
        tokens = [t for c in streamed for t in c["logprobs"]["tokens"]]
        assert tokens == choice["logprobs"]["tokens"] and len(tokens) > 4  # the prompt's and the 4 sampled


def test_return_token_ids_gives_the_offline_ids_whole_and_streamed(server, llm, media_dir):
    """vLLM's return_token_ids: a chat's prompt ids (the image's placeholder tokens in them) beside the choices
    and each choice's ids, as offline generation gives them; streamed, the prompt's in the first chunk and each
    chunk's new ids with its choice; completions carry both with each choice (streamed: the prompt's once)."""
    messages = image_message(data_url(media_dir / "boat.jpg"))
    expected = llm.chat(messages, greedy(llm, 8), use_tqdm=False)[0]
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 8, "return_token_ids": True}
    whole = httpx.post(server + "/v1/chat/completions", json=body, headers=AUTH, timeout=60).json()
    assert whole["prompt_token_ids"] == list(expected.prompt_token_ids)
    assert whole["choices"][0]["token_ids"] == list(expected.outputs[0].token_ids)
    answer, ids = whole["choices"][0]["message"]["content"], whole["choices"][0]["token_ids"]
    events = stream_events(server, "/v1/chat/completions", {**body, "stream": True})
    assert events[0]["prompt_token_ids"] == list(expected.prompt_token_ids)
    assert all("prompt_token_ids" not in event for event in events[1:])
    assert [t for event in events[1:] for c in event["choices"] for t in c["token_ids"]] == ids
    # every prefix of the answer starts this stop string: the text is held back to the end, the ids are not
    held = stream_events(server, "/v1/chat/completions", {**body, "stream": True, "stop": [answer + "\u2603"]})
    assert [t for event in held[1:] for c in event["choices"] for t in c["token_ids"]] == ids
    first = held[1]["choices"][0]  # (outputs that queued behind a busy reader come joined: a prefix of the ids)
    assert first["token_ids"] and first["token_ids"] == ids[: len(first["token_ids"])]
    assert len(first["token_ids"]) == len(ids) or not first["delta"].get("content")
    plain = httpx.post(
        server + "/v1/chat/completions", json={**body, "return_token_ids": False}, headers=AUTH, timeout=60
    )
    assert "prompt_token_ids" not in plain.json() and "token_ids" not in plain.json()["choices"][0]

    prompts = ["The harbour at dawn", "Count: one two"]
    offline = llm.generate(prompts, greedy(llm, 5), use_tqdm=False)
    body = {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": 5, "return_token_ids": True}
    whole = httpx.post(server + "/v1/completions", json=body, headers=AUTH, timeout=60).json()
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in whole["choices"]] == [
        (list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in offline
    ]
    held = [offline[0].outputs[0].text + "\u2603"]  # the first prompt's text held back to its end
    for stop in (None, held):
        streamed = {0: [], 1: []}
        for event in stream_events(server, "/v1/completions", {**body, "stream": True, "stop": stop}):
            (choice,) = event["choices"]
            if not streamed[choice["index"]]:  # its first chunk
                assert choice["prompt_token_ids"] == list(offline[choice["index"]].prompt_token_ids)
            else:
                assert "prompt_token_ids" not in choice
            streamed[choice["index"]] += choice["token_ids"]
        assert streamed == {i: list(o.outputs[0].token_ids) for i, o in enumerate(offline)}, stop


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server):
    """vLLM's return_tokens_as_token_ids: every token in logprobs (chosen and top) is "token_id:N", N the id the
    choice's token_ids give (greedy: the top one is the chosen one); whole and streamed, chat and completions."""
    ids_of = lambda tokens: [int(t.removeprefix("token_id:")) for t in tokens]  # noqa: E731
    chat = {"model": "tiny", "messages": HELLO, "temperature": 0, "max_tokens": 5, "logprobs": True, "top_logprobs": 2}
    chat |= {"return_token_ids": True, "return_tokens_as_token_ids": True}
    whole = httpx.post(server + "/v1/chat/completions", json=chat, headers=AUTH, timeout=60).json()["choices"][0]
    content = whole["logprobs"]["content"]
    assert ids_of(t["token"] for t in content) == whole["token_ids"]
    assert [t["top_logprobs"][0]["token"] for t in content] == [t["token"] for t in content]
    assert all(t["bytes"] == list(t["token"].encode()) for t in content)
    events = stream_events(server, "/v1/chat/completions", {**chat, "stream": True})
    streamed = [t for e in events for c in e["choices"] for t in (c["logprobs"] or {}).get("content") or []]
    assert streamed == content

    body = {"model": "tiny", "prompt": "The harbour at dawn", "temperature": 0, "max_tokens": 5, "logprobs": 2}
    body |= {"return_token_ids": True, "return_tokens_as_token_ids": True}
    whole = httpx.post(server + "/v1/completions", json=body, headers=AUTH, timeout=60).json()["choices"][0]
    assert ids_of(whole["logprobs"]["tokens"]) == whole["token_ids"]
    assert [next(iter(top)) for top in whole["logprobs"]["top_logprobs"]] == whole["logprobs"]["tokens"]
    text = httpx.post(server + "/v1/completions", json={**body, "return_tokens_as_token_ids": False}, headers=AUTH)
    assert "".join(text.json()["choices"][0]["logprobs"]["tokens"]) == whole["text"]  # the default: the text
    events = stream_events(server, "/v1/completions", {**body, "stream": True})
    assert [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]] == whole["logprobs"]["tokens"]


def test_tokenizer_info_gives_the_tokenizers_settings_and_template(server, tiny_dirs):
    """vLLM's /tokenizer_info (--enable-tokenizer-info-endpoint): the settings transformers read from
    tokenizer_config.json, the tokenizer's class and the chat template served; no file path of this machine. Behind
    the API key like every route; absent without the flag (test_processed_logprobs_mode_... checks a 404)."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tiny_dirs["tiny-3b"])
    assert httpx.get(server + "/tokenizer_info").status_code == 401
    reply = httpx.get(server + "/tokenizer_info", headers=AUTH)
    assert reply.status_code == 200, reply.text
    info = reply.json()
    assert info["tokenizer_class"] == type(reference).__name__
    assert info["chat_template"] == reference.chat_template and "<|im_start|>" in info["chat_template"]
    assert info["model_max_length"] == reference.init_kwargs["model_max_length"]
    assert info["eos_token"] == str(reference.init_kwargs["eos_token"]) == "<|im_end|>"
    assert str(tiny_dirs["tiny-3b"]) not in reply.text and not any(key.endswith("_file") for key in info)


def strict_json(text: str):
    """JSON as the spec has it: NaN and Infinity are no numbers (Python's json reads them)."""
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in a response"))


def test_processed_logprobs_mode_sends_filtered_tokens_as_vllm_does(tiny_dirs):
    """--logprobs-mode processed_logprobs: tokens top_k filtered out have logprob -inf, sent as -9999.0 (vLLM's
    value) in valid JSON, whole and streamed; the kept ones hold all of the mass."""
    flags = ["--dtype", "float32", "--max-model-len", "1024", "--logprobs-mode", "processed_logprobs"]
    with running_server(tiny_dirs["tiny-3b"], *flags, "--disable-playground") as (base, _):
        assert httpx.get(base + "/tokenizer_info").status_code == 404  # (not asked for)
        # (top_p given: the tiny checkpoint's generation_config has Qwen2.5-VL's 0.001, which keeps one token)
        sampling = {"temperature": 1.0, "top_k": 2, "top_p": 1.0, "seed": 3, "max_tokens": 4, "ignore_eos": True}
        body = {"prompt": "The harbour at dawn", "logprobs": 4, **sampling}
        reply = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        logprobs = strict_json(reply.text)["choices"][0]["logprobs"]
        for chosen, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"]):
            kept = [v for v in top.values() if v > -9999.0]
            assert len(top) == 4 and len(kept) == 2 and chosen in kept
            assert sum(math.exp(v) for v in kept) == pytest.approx(1.0, abs=1e-4)
        chat = {"messages": HELLO, "logprobs": True, "top_logprobs": 4, "stream": True, **sampling}
        with httpx.stream("POST", base + "/v1/chat/completions", json=chat, timeout=60) as response:
            lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
        content = [
            t
            for line in lines[:-1]
            for c in strict_json(line)["choices"]
            for t in (c["logprobs"] or {}).get("content") or []
        ]
        assert len(content) == 4
        assert all(sum(t["logprob"] == -9999.0 for t in item["top_logprobs"]) == 2 for item in content)


def test_streamed_logprobs_cover_tokens_whose_text_is_held_back(server):
    """A stop string that every prefix of the answer starts holds the text back to the end; the tokens' logprobs
    still stream, each with its own chunk, as vLLM sends them (chat and completions alike)."""
    body = {"model": "tiny", "prompt": "The harbour at dawn", "temperature": 0, "max_tokens": 6, "logprobs": 1}
    whole = httpx.post(server + "/v1/completions", json=body, headers=AUTH, timeout=60).json()["choices"][0]
    stop = [whole["text"] + "\u2603"]
    events = stream_events(server, "/v1/completions", {**body, "stream": True, "stop": stop})
    assert [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]] == whole["logprobs"]["tokens"]
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"] and not events[0]["choices"][0]["text"]

    chat = {"model": "tiny", "messages": HELLO, "temperature": 0, "max_tokens": 6, "logprobs": True}
    whole = httpx.post(server + "/v1/chat/completions", json=chat, headers=AUTH, timeout=60).json()["choices"][0]
    stop = [whole["message"]["content"] + "\u2603"]
    events = stream_events(server, "/v1/chat/completions", {**chat, "stream": True, "stop": stop})
    streamed = [t["token"] for e in events for c in e["choices"] for t in (c["logprobs"] or {}).get("content") or []]
    assert streamed == [t["token"] for t in whole["logprobs"]["content"]]


def test_continue_final_message_goes_on_with_the_last_message(server, llm, tiny_dirs):
    """vLLM's continue_final_message: the prompt ends inside the last (assistant) message, as transformers'
    apply_chat_template(continue_final_message=True) writes it; served as offline; with add_generation_prompt
    left true, a 400 saying why."""
    messages = [{"role": "user", "content": "Name a boat."}, {"role": "assistant", "content": "The boat is called"}]
    reference = hf_tokenizer(tiny_dirs["tiny-3b"]).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert reference.endswith("The boat is called")  # (the template would close the turn otherwise)
    offline = llm.chat(
        messages, greedy(llm, 6), use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )[0]
    assert offline.prompt_token_ids == hf_tokenizer(tiny_dirs["tiny-3b"]).encode(reference)
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 6}
    body |= {"add_generation_prompt": False, "continue_final_message": True}
    reply = httpx.post(server + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert reply.json()["choices"][0]["message"]["content"] == offline.outputs[0].text
    counted = httpx.post(
        server + "/tokenize",
        json={k: body[k] for k in ("model", "messages", "add_generation_prompt", "continue_final_message")},
        headers=AUTH,
    )
    assert counted.json()["tokens"] == offline.prompt_token_ids
    both = httpx.post(server + "/v1/chat/completions", json={**body, "add_generation_prompt": True}, headers=AUTH)
    assert both.status_code == 400 and "add_generation_prompt" in both.json()["error"]["message"]
    # vLLM's echo: the reply starts with the last message when that is the reply's role (the prefill's text)
    whole = "The boat is called" + offline.outputs[0].text
    echoed = httpx.post(server + "/v1/chat/completions", json={**body, "echo": True}, headers=AUTH, timeout=60)
    assert echoed.json()["choices"][0]["message"]["content"] == whole
    events = stream_events(server, "/v1/chat/completions", {**body, "echo": True, "stream": True})
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == whole
    asked = {**body, "messages": messages[:1], "add_generation_prompt": True, "continue_final_message": False}
    plain, with_echo = (
        httpx.post(server + "/v1/chat/completions", json={**asked, "echo": echo}, headers=AUTH, timeout=60)
        for echo in (False, True)
    )
    assert with_echo.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]  # a user's: not echoed


def test_allowed_token_ids_are_the_only_tokens_drawn(server, llm):
    """vLLM's allowed_token_ids: sampled or greedy, every token is one of them (greedy: the one offline generation
    picks among them); an empty list or an id outside the vocabulary is a 400 naming the field."""
    allowed = [11, 220, 1879, 14990, 151643]
    body = {"model": "tiny", "prompt": "The harbour at dawn", "max_tokens": 8, "allowed_token_ids": allowed}
    body |= {"return_token_ids": True, "ignore_eos": True}
    sampled = httpx.post(
        server + "/v1/completions",
        json={**body, "n": 3, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "seed": 4},
        headers=AUTH,
    )
    ids = [t for c in sampled.json()["choices"] for t in c["token_ids"]]
    assert len(ids) == 24 and set(ids) <= set(allowed) and len(set(ids)) > 1
    greedy_reply = httpx.post(server + "/v1/completions", json={**body, "temperature": 0}, headers=AUTH).json()
    offline = llm.generate(
        ["The harbour at dawn"], greedy(llm, 8).clone(allowed_token_ids=allowed, ignore_eos=True), use_tqdm=False
    )
    assert greedy_reply["choices"][0]["token_ids"] == list(offline[0].outputs[0].token_ids)
    assert set(greedy_reply["choices"][0]["token_ids"]) <= set(allowed)
    refusals = [([], "must not be empty"), ([5, 10**7], "allowed_token_ids has token id 10000000")]
    refusals.append((list(range(1025)), "allowed_token_ids has 1025 entries; at most 1024"))
    refusals.append(([151645], "holds only stop tokens"))  # with min_tokens, nothing could be drawn
    for bad, words in refusals:
        asked = {**body, "allowed_token_ids": bad, "ignore_eos": False, "min_tokens": 2}
        refused = httpx.post(server + "/v1/completions", json=asked, headers=AUTH)
        assert refused.status_code == 400 and words in refused.json()["error"]["message"], refused.text


def test_sagemaker_invocations_route_chats_and_completions(server, client):
    """vLLM's /invocations (SageMaker's one route): a body with messages is a chat completion, one with a prompt a
    completion, each answered as its own route answers; anything else is a 400 saying what the route takes."""
    messages = [{"role": "user", "content": "Tell me about boats."}]
    chat = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=6)
    completion = client.completions.create(model="tiny", prompt="The harbour at dawn", temperature=0, max_tokens=6)
    bodies = [
        {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 6},
        {"model": "tiny", "prompt": "The harbour at dawn", "temperature": 0, "max_tokens": 6},
        {"model": "tiny", "input": "hi"},
    ]
    replies = [httpx.post(server + "/invocations", json=body, headers=AUTH, timeout=60) for body in bodies]
    assert [r.status_code for r in replies] == [200, 200, 400]
    assert replies[0].json()["object"] == "chat.completion"
    assert replies[0].json()["choices"][0]["message"]["content"] == chat.choices[0].message.content
    assert replies[1].json()["object"] == "text_completion"
    assert replies[1].json()["choices"][0]["text"] == completion.choices[0].text
    assert "messages" in replies[2].json()["error"]["message"]
    assert httpx.post(server + "/invocations", json=bodies[0], timeout=60).status_code == 401  # the key guards it


def test_streaming_chat_with_usage(client):
    kwargs = dict(
        model="tiny", messages=[{"role": "user", "content": "Tell me about boats."}], temperature=0, max_tokens=15
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 15


def stream_events(server: str, path: str, body: dict) -> list[dict]:
    """A streamed response's events, in order (the JSON of each `data:` line before [DONE])."""
    with httpx.stream("POST", server + path, json=body, headers=AUTH, timeout=60) as response:
        assert response.status_code == 200, response.read()
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_stream_options_usage_last_and_in_every_chunk(server):
    """vLLM's stream_options: the usage comes after the last choice once stream_options is sent (include_usage
    defaults to true there) and not without it; continuous_usage_stats puts it in every chunk too: the prompt's
    tokens and that choice's tokens so far, each prompt's own for completions."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about boats."}], "max_tokens": 5}
    chat |= {"n": 2, "temperature": 1.0, "seed": 1, "ignore_eos": True, "logprobs": True}
    plain = stream_events(server, "/v1/chat/completions", {**chat, "stream": True})
    assert all("usage" not in event for event in plain)
    last = stream_events(server, "/v1/chat/completions", {**chat, "stream": True, "stream_options": {}})
    assert all("usage" not in event for event in last[:-1])
    prompt = last[-1]["usage"]["prompt_tokens"]
    assert last[-1]["choices"] == [] and last[-1]["usage"]["completion_tokens"] == 10
    every = {"include_usage": True, "continuous_usage_stats": True}
    events = stream_events(server, "/v1/chat/completions", {**chat, "stream": True, "stream_options": every})
    counted = {0: 0, 1: 0}
    role, *events = events  # the first chunk gives each choice its role: no tokens yet
    assert len(role["choices"]) == 2 and role["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 0,
        "total_tokens": prompt,
    }
    for event in events[:-1]:
        (choice,) = event["choices"]
        counted[choice["index"]] += len((choice["logprobs"] or {}).get("content") or [])  # the chunk's tokens
        assert event["usage"] == {
            "prompt_tokens": prompt,
            "completion_tokens": counted[choice["index"]],
            "total_tokens": prompt + counted[choice["index"]],
        }, event
    assert counted == {0: 5, 1: 5} and events[-1]["usage"]["completion_tokens"] == 10

    prompts = ["A", "The harbour at dawn, the boats"]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 2, "logprobs": 1}
    body |= {"ignore_eos": True, "stream": True, "stream_options": every}
    events = stream_events(server, "/v1/completions", body)
    lengths = [
        len(httpx.post(server + "/tokenize", json={"prompt": p}, headers=AUTH).json()["tokens"]) for p in prompts
    ]
    counted = {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        counted[choice["index"]] = counted.get(choice["index"], 0) + len(choice["logprobs"]["tokens"])
        prompt = lengths[choice["index"] // 2]  # choice i * n + j is prompt i's sample j
        assert event["usage"] == {
            "prompt_tokens": prompt,
            "completion_tokens": counted[choice["index"]],
            "total_tokens": prompt + counted[choice["index"]],
        }, event
    assert counted == {0: 4, 1: 4, 2: 4, 3: 4}
    assert events[-1]["usage"]["prompt_tokens"] == sum(lengths) and events[-1]["usage"]["completion_tokens"] == 16


def test_n_seed_logprobs_stop(client):
    messages = [{"role": "user", "content": "Say something."}]
    first = client.chat.completions.create(
        model="tiny", messages=messages, n=2, seed=3, temperature=1.0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    again = client.chat.completions.create(
        model="tiny", messages=messages, n=2, seed=3, temperature=1.0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    assert len(first.choices) == 2
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    content = first.choices[0].logprobs.content
    assert len(content) == 8 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob >= t.top_logprobs[-1].logprob for t in content)
    text = first.choices[0].message.content
    if len(text) > 4:
        stop = text[2:4]
        cut = client.chat.completions.create(
            model="tiny", messages=messages, seed=3, temperature=1.0, max_tokens=8, stop=[stop]
        )
        assert cut.choices[0].message.content == text[: text.find(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_async_clients_run_concurrently(server, client):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
        replies = await asyncio.gather(
            *[
                aclient.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"Question {i}"}], temperature=0, max_tokens=6
                )
                for i in range(4)
            ]
        )
        await aclient.close()
        return [r.choices[0].message.content for r in replies]

    answers = asyncio.run(main())
    for i, answer in enumerate(answers):
        alone = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Question {i}"}], temperature=0, max_tokens=6
        )
        assert alone.choices[0].message.content == answer


def test_errors_are_sdk_exceptions_and_the_server_keeps_serving(server, client, media_dir, tmp_path):
    ok = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=ok)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=ok, temperature=-1)
    outside = tmp_path / "secret.jpg"
    outside.write_bytes((media_dir / "boat.jpg").read_bytes())
    with pytest.raises(openai.BadRequestError, match="outside the folder the server allows"):
        client.chat.completions.create(model="tiny", messages=image_message(f"file://{outside}"))
    with pytest.raises(openai.BadRequestError, match="not a readable image"):
        client.chat.completions.create(model="tiny", messages=image_message("data:image/png;base64,aGVsbG8="))
    with pytest.raises(openai.BadRequestError, match="non-public address"):
        client.chat.completions.create(model="tiny", messages=image_message("http://127.0.0.1:9/x.png"))
    body = httpx.post(
        server + "/v1/chat/completions", json={"model": "tiny"}, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert body.status_code == 400 and body.json()["error"]["param"] == "messages"
    reply = client.chat.completions.create(model="tiny", messages=ok, max_tokens=2)
    assert reply.choices[0].message.content is not None


def test_tokenize_and_detokenize_round_trip(server, llm):
    """Qwen's tokenizer adds no special tokens around a plain prompt, whichever way add_special_tokens is set."""
    tokenizer = llm.get_tokenizer()
    headers = {"Authorization": f"Bearer {KEY}"}
    text = "Hello, world: 42 boats"
    for special in (True, False):
        counted = httpx.post(
            server + "/tokenize",
            headers=headers,
            timeout=30,
            json={"model": "tiny", "prompt": text, "add_special_tokens": special},
        ).json()
        assert counted["tokens"] == tokenizer.encode(text, add_special_tokens=special) == tokenizer.encode(text)
        assert counted["count"] == len(counted["tokens"]) and counted["max_model_len"] == 2048
        back = httpx.post(
            server + "/detokenize", headers=headers, timeout=30, json={"model": "tiny", "tokens": counted["tokens"]}
        ).json()
        assert back["prompt"] == text


def test_ids_past_the_tokenizer_read_the_same_everywhere(client, llm):
    """The model's vocabulary (151,936 rows) is larger than its tokenizer's (151,665 ids): ids past the tokenizer
    (which random weights can pick; logit_bias forces them here, beside ordinary ones) give no text, and the rest
    read the same in the server (whole and streamed) as offline and as the tokenizer's decode of the whole."""
    tokenizer = llm.get_tokenizer()
    past = [len(tokenizer) + 5, llm.engine.config.model.text.vocab_size - 1]
    bias = {past[0]: 30, past[1]: 30, 1879: 30, 3579: 30, 198: 30}  # two past the tokenizer, " world", " boat", "\n"
    params = greedy(llm, 12).clone(logit_bias=bias)
    expected = llm.generate(["The harbour at dawn"], params, use_tqdm=False)[0].outputs[0]
    assert set(expected.token_ids) & set(past) and set(expected.token_ids) - set(past)  # both kinds were drawn
    assert expected.text == tokenizer.decode([t for t in expected.token_ids if t < len(tokenizer)])
    kwargs = dict(
        model="tiny",
        prompt="The harbour at dawn",
        temperature=0,
        max_tokens=12,
        logit_bias={str(k): v for k, v in bias.items()},
    )
    assert client.completions.create(**kwargs).choices[0].text == expected.text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == expected.text


def test_fields_that_ask_nothing_of_this_model_are_accepted(client):
    """reasoning_effort and its kin ask nothing of a model that neither reasons nor searches: vLLM accepts them,
    and so the answer is the one without them."""
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Name a boat."}], temperature=0, max_tokens=6)
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    extra = (
        client.chat.completions.create(
            **kwargs,
            reasoning_effort="high",
            extra_body={"include_reasoning": True, "web_search_options": {}, "verbosity": "low"},
        )
        .choices[0]
        .message.content
    )
    assert extra == plain


def test_prompt_logprobs_as_vllm_gives_them(server, llm):
    """vLLM's prompt_logprobs in completions (per choice) and chat (on the response): per prompt token, None for
    the first, then its own log-probability and the k best, by token id, as the offline engine scores them; with
    a stream a 400, as in vLLM. It was dropped with a log line."""
    import math

    prompt = "The harbour at dawn"
    offline = llm.generate(prompt, greedy(llm, 2).clone(prompt_logprobs=2), use_tqdm=False)[0]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    choice = httpx.post(server + "/v1/completions", headers=AUTH, json=body, timeout=60).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(offline.prompt_token_ids) and entries[0] is None
    for token, entry, expected in zip(offline.prompt_token_ids[1:], entries[1:], offline.prompt_logprobs[1:]):
        assert str(token) in entry and 2 <= len(entry) <= 3
        assert {int(t) for t in entry} == set(expected) and entry[str(token)]["rank"] == expected[token].rank
        assert math.isclose(entry[str(token)]["logprob"], expected[token].logprob, abs_tol=1e-4)
        assert entry[str(token)]["decoded_token"] == expected[token].decoded_token
    chat = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "prompt_logprobs": 0}
    reply = httpx.post(server + "/v1/chat/completions", headers=AUTH, json=chat, timeout=60).json()
    assert reply["prompt_logprobs"][0] is None and all(len(e) == 1 for e in reply["prompt_logprobs"][1:])
    plain = httpx.post(server + "/v1/completions", headers=AUTH, json={**body, "prompt_logprobs": None}).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    streamed = httpx.post(server + "/v1/completions", headers=AUTH, json={**body, "stream": True})
    assert streamed.status_code == 400 and "not available when stream" in streamed.json()["error"]["message"]


def test_truncate_prompt_tokens_keeps_the_last_tokens_of_a_prompt_too_long_for_the_model(server, tiny_dirs):
    """vLLM's truncate_prompt_tokens: a completion over max_model_len (2048 here) keeps the last k of
    transformers' tokens of its text, so does a chat of its rendered prompt, and the usage counts k; k above
    max_model_len, or 0, is a 400 naming the field."""
    text = "Sailors watched the grey horizon while gulls circled the masts. " * 300
    whole = hf_tokenizer(tiny_dirs["tiny-3b"]).encode(text)
    assert len(whole) > 2048
    body = {"model": "tiny", "prompt": text, "temperature": 0, "max_tokens": 3, "return_token_ids": True}
    too_long = httpx.post(server + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert too_long.status_code == 400 and "maximum model length" in too_long.json()["error"]["message"]
    reply = httpx.post(
        server + "/v1/completions", json={**body, "truncate_prompt_tokens": 64}, headers=AUTH, timeout=60
    ).json()
    assert reply["choices"][0]["prompt_token_ids"] == whole[-64:] and reply["usage"]["prompt_tokens"] == 64
    chat = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 3, "return_token_ids": True}
    chat_reply = httpx.post(
        server + "/v1/chat/completions", json={**chat, "truncate_prompt_tokens": 32}, headers=AUTH, timeout=60
    ).json()
    assert (
        chat_reply["prompt_token_ids"][-5:]
        == hf_tokenizer(tiny_dirs["tiny-3b"]).encode("<|im_end|>\n<|im_start|>assistant\n")
        and len(chat_reply["prompt_token_ids"]) == 32 == chat_reply["usage"]["prompt_tokens"]
    )
    for k, words in ((4096, "truncate_prompt_tokens (4096) is more than max_model_len (2048)"), (0, "must be -1")):
        refused = httpx.post(server + "/v1/completions", json={**body, "truncate_prompt_tokens": k}, headers=AUTH)
        assert refused.status_code == 400 and words in refused.json()["error"]["message"], refused.text


def test_bad_words_are_taken_and_bounded(server, llm):
    """vLLM's bad_words through the API: the offline engine's tokens for the same words; more than 128 words,
    one of over 200 characters, or a blank one is a 400 naming the field."""
    body = {"model": "tiny", "prompt": "The harbour at dawn", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    free = llm.generate(["The harbour at dawn"], greedy(llm, 8).clone(ignore_eos=True), use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    reads = {t: tokenizer.decode([t]) for t in free.outputs[0].token_ids}  # a word that starts with no blank
    words = [
        next(w for t, w in reads.items() if w == w.lstrip() and tokenizer.encode(w, add_special_tokens=False) == [t])
    ]
    offline = llm.generate(
        ["The harbour at dawn"], greedy(llm, 8).clone(ignore_eos=True, bad_words=words), use_tqdm=False
    )
    reply = httpx.post(
        server + "/v1/completions", json={**body, "bad_words": words, "return_token_ids": True}, headers=AUTH
    )
    assert (
        reply.json()["choices"][0]["token_ids"]
        == list(offline[0].outputs[0].token_ids)
        != list(free.outputs[0].token_ids)
    )
    for bad, words in (
        (["w"] * 129, "bad_words has 129 entries; at most 128"),
        (["w" * 201], "bad_words may have at most 200 characters"),
        ([" "], "bad_words must be non-blank strings"),
    ):
        refused = httpx.post(server + "/v1/completions", json={**body, "bad_words": bad}, headers=AUTH)
        assert refused.status_code == 400 and words in refused.json()["error"]["message"], refused.text


def test_beam_search_answers_the_offline_beams_whole_and_streamed(server, llm, media_dir):
    """use_beam_search with n beams: the offline engine's beams (an image chat, and completions of two prompts),
    best first, with their tokens and logprobs; streamed, the same texts. Settings a beam search cannot apply and
    more beams than max_logprobs allows are 400s naming them."""
    messages = image_message(data_url(media_dir / "boat.jpg"))
    params = SamplingParams(n=3, use_beam_search=True, max_tokens=5, temperature=0)
    expected = llm.chat(messages, params, use_tqdm=False)[0].outputs
    body = {"model": "tiny", "messages": messages, "use_beam_search": True, "n": 3, "max_tokens": 5, "temperature": 0}
    whole = httpx.post(server + "/v1/chat/completions", json={**body, "return_token_ids": True}, headers=AUTH).json()
    assert [c["token_ids"] for c in whole["choices"]] == [o.token_ids for o in expected]
    assert [c["message"]["content"] for c in whole["choices"]] == [o.text for o in expected]
    assert len({o.text for o in expected}) == 3
    streamed = ["", "", ""]
    with httpx.stream("POST", server + "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed[choice["index"]] += choice["delta"].get("content") or ""
    assert streamed == [o.text for o in expected]
    prompts = ["The harbour at dawn", "Three ships"]
    offline = llm.generate(prompts, params.clone(n=2, max_tokens=4, logprobs=2), use_tqdm=False)
    reply = httpx.post(
        server + "/v1/completions",
        json={"model": "tiny", "prompt": prompts, "use_beam_search": True, "n": 2, "max_tokens": 4, "logprobs": 2,
              "temperature": 0},
        headers=AUTH,
    ).json()  # fmt: skip
    choices = [(c["text"], c["logprobs"]["token_logprobs"]) for c in reply["choices"]]
    want = [(o.text, [e[t].logprob for e, t in zip(o.logprobs, o.token_ids)]) for out in offline for o in out.outputs]
    assert [text for text, _ in choices] == [text for text, _ in want]
    assert all(got == pytest.approx(w, abs=1e-5) for (_, got), (_, w) in zip(choices, want))
    for extra, words in (
        ({"stop": ["x"]}, "stop cannot be used with beam search"),
        ({"response_format": {"type": "json_object"}}, "structured_outputs cannot be used with beam search"),
        ({"n": 11}, "needs 22 logprobs a step, more than max_logprobs=20"),
    ):
        refused = httpx.post(server + "/v1/chat/completions", json={**body, **extra}, headers=AUTH)
        assert refused.status_code == 400 and words in refused.json()["error"]["message"], refused.text


def test_text_chunks_from_the_template_are_the_chunks_sse_makes():
    """A stream's commonest chunk (a choice's new text alone) is written from a template; it is the same string,
    byte for byte, that serializing the whole chunk gives, for any text (quotes, escapes, non-ASCII, control
    characters) and model name."""
    from fovea.server.openai_serving import TextChunks, sse

    for kind, field in (("chat.completion.chunk", "delta"), ("text_completion", "text")):
        for text in ("", " word", 'a "quoted" \\ back\nslash\t', "é 日本 😀 \x00\x1f\u2028"):
            template = TextChunks("chatcmpl-1-x", kind, 1700000000, 'the "model"/é')
            content = {"delta": {"content": text}} if field == "delta" else {"text": text}
            choice = {"index": 7, **content, "logprobs": None, "finish_reason": None, "stop_reason": None}
            body = {"id": "chatcmpl-1-x", "object": kind, "created": 1700000000, "model": 'the "model"/é'}
            assert template(7, text) == sse({**body, "choices": [choice]}), (kind, text)
