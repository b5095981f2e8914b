"""The Responses API through the official openai SDK against a real `fovea serve`: text and image input, the typed
stream, json_schema, a function-call round trip, previous_response_id with the stored conversation, GET and
DELETE, and bad input as the SDK's error types. Every answer is checked against the chat completion of the same
conversation (greedy): the Responses API is a translation of it."""

from __future__ import annotations

import base64
import json

import openai
import pytest
from conftest import jpeg_bytes, random_image
from serving import running_server

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    # an enum: a random model's free strings run on past any max_output_tokens
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]},
}
GREEDY = {"temperature": 0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def client(tiny_dirs):
    flags = ["--dtype", "float32", "--max-model-len", "1024", "--mm-processor-workers", "0"]
    flags += ["--served-model-name", "tiny", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with running_server(tiny_dirs["tiny-3b"], *flags, env={"FOVEA_BACKGROUND_RESPONSES": "2"}) as (base, _):
        yield openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)


def chat_text(client, messages, **extra) -> tuple[str, object]:
    reply = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12, **extra)
    return reply.choices[0].message.content or "", reply


def test_text_and_image_input_answer_as_the_chat_does(client):
    image = "data:image/jpeg;base64," + base64.b64encode(jpeg_bytes(random_image(160, 120, seed=3))).decode()
    response = client.responses.create(
        model="tiny", input="Say something about boats.", instructions="Be brief.", **GREEDY
    )
    expected, reply = chat_text(
        client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something about boats."}]
    )
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "tiny"
    assert response.output_text == expected and response.output[0].type == "message"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        reply.usage.prompt_tokens,
        reply.usage.completion_tokens,
    )
    content = [{"type": "input_image", "image_url": image}, {"type": "input_text", "text": "What is it?"}]
    with_image = client.responses.create(model="tiny", input=[{"role": "user", "content": content}], **GREEDY)
    expected, reply = chat_text(
        client,
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image}},
                    {"type": "text", "text": "What is it?"},
                ],
            }
        ],
    )
    assert with_image.output_text == expected and with_image.usage.input_tokens == reply.usage.prompt_tokens


def test_the_stream_is_the_sdks_typed_events(client):
    events = list(client.responses.create(model="tiny", input="Tell me a story.", stream=True, **GREEDY))
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert kinds.count("response.output_text.delta") > 1
    final = events[-1].response
    assert final.output_text == deltas == chat_text(client, [{"role": "user", "content": "Tell me a story."}])[0]
    assert final.usage.output_tokens == 12
    with client.responses.stream(model="tiny", input="Tell me a story.", **GREEDY) as stream:  # the SDK's helper
        assert stream.get_final_response().output_text == deltas


def test_json_schema_output_follows_the_schema(client):
    city = {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}  # a random model's free strings run on
    schema = {"type": "object", "properties": {"city": city}, "required": ["city"], "additionalProperties": False}
    response = client.responses.create(
        model="tiny",
        input="Name a city.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
        temperature=0,
        max_output_tokens=40,
    )
    value = json.loads(response.output_text)
    assert set(value) == {"city"} and value["city"] in city["enum"]
    assert response.text.format.type == "json_schema"


def test_a_function_call_round_trip_and_previous_response_id(client):
    first = client.responses.create(
        model="tiny",
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_output_tokens=60,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    streamed = list(
        client.responses.create(
            model="tiny", input="Weather in Paris?", tools=[WEATHER], tool_choice="required", temperature=0,
            max_output_tokens=60, stream=True,
        )
    )  # fmt: skip
    arguments = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    final_calls = [item for item in streamed[-1].response.output if item.type == "function_call"]
    assert arguments == final_calls[0].arguments == calls[0].arguments and final_calls[0].name == "get_weather"
    assert "response.function_call_arguments.done" in [e.type for e in streamed]
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature": 21}'}
    # the stored conversation and the result, by previous_response_id ...
    follow = client.responses.create(
        model="tiny", previous_response_id=first.id, input=[result], tools=[WEATHER], **GREEDY
    )
    # ... or the whole conversation sent again, as input items: the same prompt and answer
    again = client.responses.create(
        model="tiny",
        input=[{"role": "user", "content": "Weather in Paris?"}, calls[0].model_dump(), result],
        tools=[WEATHER],
        **GREEDY,
    )
    assert follow.usage.input_tokens == again.usage.input_tokens and follow.output_text == again.output_text
    assert follow.previous_response_id == first.id
    assert client.responses.retrieve(follow.id).output_text == follow.output_text
    client.responses.delete(follow.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(follow.id)
    unstored = client.responses.create(model="tiny", input="hi", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def settled(client, response_id: str, timeout_s: float = 60):
    import time

    deadline = time.time() + timeout_s
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.time() < deadline, response
        time.sleep(0.1)
    return response


def test_background_responses_run_on_and_are_read_cancelled_or_failed_later(client):
    """background=true answers at once with a queued response, in_progress once it goes to the engine; GET later
    gives what the same request gives in the foreground; cancel aborts one still running (its request leaves the engine); one whose request fails is stored
    as failed with the reason."""
    import time

    import httpx

    queued = client.responses.create(model="tiny", input="Say something about boats.", background=True, **GREEDY)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    foreground = client.responses.create(model="tiny", input="Say something about boats.", **GREEDY)
    done = settled(client, queued.id)
    assert (done.status, done.output_text, done.background) == ("incomplete", foreground.output_text, True)
    with pytest.raises(openai.BadRequestError, match="this one is incomplete"):
        client.responses.cancel(queued.id)

    endless = dict(
        model="tiny", input="Go on.", background=True, max_output_tokens=900, extra_body={"ignore_eos": True}
    )
    long, other = client.responses.create(**endless), client.responses.create(**endless)
    deadline = time.time() + 60
    while (status := client.responses.retrieve(long.id).status) == "queued" and time.time() < deadline:
        time.sleep(0.01)
    assert status == "in_progress"  # it went to the engine; its 900 tokens are far off
    with pytest.raises(openai.RateLimitError, match="2 background responses are running"):
        client.responses.create(**endless)  # (FOVEA_BACKGROUND_RESPONSES=2 on this server)
    client.responses.cancel(other.id)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    base = str(client.base_url).removesuffix("/v1/")
    for _ in range(100):  # (the gauge comes with the engine's next stats)
        running = [v for v in httpx.get(base + "/metrics").text.splitlines() if v.startswith("fovea:num_requests_run")]
        if float(running[0].rsplit(" ", 1)[1]) == 0:
            break
        time.sleep(0.1)
    assert float(running[0].rsplit(" ", 1)[1]) == 0, running

    unreachable = [{"role": "user", "content": [{"type": "input_image", "image_url": "file:///etc/passwd"}]}]
    failed = settled(client, client.responses.create(model="tiny", input=unreachable, background=True).id)
    assert failed.status == "failed" and failed.error.code == "invalid_prompt" and "file" in failed.error.message
    deleted = client.responses.create(model="tiny", input="Go on.", background=True, max_output_tokens=900)
    client.responses.delete(deleted.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(deleted.id)


def test_tool_choice_auto_without_tools_is_the_default(client):
    """ "auto" is the Responses API's default tool_choice, so it stands without tools (it was a 400); "required"
    without tools is still one."""
    plain = client.responses.create(model="tiny", input="Hi", **GREEDY)
    auto = client.responses.create(model="tiny", input="Hi", tool_choice="auto", **GREEDY)
    assert auto.output_text == plain.output_text and auto.tool_choice == "auto" and auto.output_text
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        client.responses.create(model="tiny", input="Hi", tool_choice="required", **GREEDY)


@pytest.mark.parametrize(
    "fields, error, words",
    [
        ({"input": "x", "previous_response_id": "resp_nope"}, openai.NotFoundError, "resp_nope"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, openai.BadRequestError, "item_reference"),
        ({"input": [{"type": "function_call", "name": "f"}]}, openai.BadRequestError, "needs call_id, arguments"),
        ({"input": ["text"]}, openai.BadRequestError, "input"),
        ({"input": "x", "text": {"format": "json"}}, openai.BadRequestError, "text.format must be an object"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            openai.BadRequestError,
            "input_file",
        ),
        ({"input": "x", "tools": [{"type": "web_search"}]}, openai.BadRequestError, "web_search"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, openai.BadRequestError, "yaml"),
        ({"input": "x", "background": True, "store": False}, openai.BadRequestError, "background responses need"),
        ({"input": "x", "background": True, "stream": True}, openai.BadRequestError, "are not streamed"),
        ({"input": "x", "max_output_tokens": 0}, openai.BadRequestError, "max_tokens"),
    ],
)
def test_bad_input_is_the_sdks_error(client, fields, error, words):
    with pytest.raises(error, match=words):
        client.responses.create(model="tiny", **fields)


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "messages is not a Responses API field; it is input here"),
        ({"max_tokens": 5, "max_output_tokens": 4}, "max_tokens is not a Responses API field; it is max_output_tokens"),
        ({"top_k": "many"}, "top_k: Input should be a valid integer"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": [1]}}},
            "must be a JSON schema (an object)",
        ),
    ],
)
def test_chat_fields_and_their_bad_values_are_400s_in_the_servers_own_words(client, extra, words):
    """Once a TypeError (500) for a field given twice, and pydantic's report (input values, its site's links)."""
    import httpx

    reply = httpx.post(str(client.base_url) + "responses", json={"model": "tiny", "input": "hi", **extra}, timeout=60)
    error = reply.json()["error"]
    assert reply.status_code == 400 and words in error["message"], reply.text
    assert "pydantic" not in error["message"] and "input_value" not in error["message"], error


def test_the_store_holds_no_more_memory_than_its_size_says():
    """The cap counted JSON length while the store kept Python objects, ~7x larger (1.8 GB under 256 MB)."""
    import tracemalloc

    from fovea.server.responses import ResponseStore

    turn = [{"role": "user", "content": [{"type": "text", "text": f"word {i}"} for i in range(2000)]}]
    tracemalloc.start()
    store = ResponseStore(max_count=1000, max_bytes=4 << 20)
    before = tracemalloc.get_traced_memory()[0]
    for i in range(100):  # each its own objects, as each request's are
        store.put({"id": f"resp_{i}", "output": []}, json.loads(json.dumps(turn)))
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert store.size <= 4 << 20 and held < 1.3 * (4 << 20), (store.size, held)
    assert store.get("resp_99") == ({"id": "resp_99", "output": []}, turn) and len(store.entries) < 100
