"""Tool calling: Qwen2.5's format in the chat template, calls found in answers (hermes parser), required and named
tool_choice constrained to calls whose arguments follow the tool's schema, OpenAI's response and stream shapes."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest
from serving import running_server
from transformers import AutoTokenizer

from fovea import LLM, SamplingParams
from fovea.multimodal.prompt import ChatOptions
from fovea.server.tool_calls import ToolCallStream, ToolUse

WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "days"],
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
}
BOX = {
    "type": "object",
    "additionalProperties": False,
    "required": ["label", "box"],
    "properties": {
        "label": {"enum": ["cat", "dog"]},
        "box": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": 4,
            "maxItems": 4,
        },
    },
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "find_box", "parameters": BOX}},
]
SCHEMAS = {"get_weather": WEATHER, "find_box": BOX}
ASK = [{"role": "user", "content": "What will the weather be in Paris?"}]
# Qwen2.5's function-calling prompt, as its published template writes it
SYSTEM_WITH_TOOLS = (
    "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to assist "
    "with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + "\n".join(json.dumps(tool) for tool in TOOLS)
    + "\n</tools>\n\nFor each function call, return a json object "
    'with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
PIXEL = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGNgYGAAAAAEAAH2FzhVAAAAAElF"
    "TkSuQmCC"
)  # a 1x1 PNG
ANSWER = (
    'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris", "days": 3}}\n'
    '</tool_call>\n<tool_call>\n{"arguments": {"label": "cat", "box": [1, 2, 3, 4]}, "name": "find_box"}\n'
    "</tool_call>"
)
ANSWER_CALLS = [("get_weather", '{"city": "Pa}ris", "days": 3}'), ("find_box", '{"label": "cat", "box": [1, 2, 3, 4]}')]


def collect(deltas: list[dict]) -> tuple[str, list[tuple[str, str]], list[list[str]]]:
    """Content, calls (name, arguments) and each call's argument pieces, from a chat stream's deltas."""
    content, calls, pieces = "", [], []
    for delta in deltas:
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            if call.get("id"):
                assert call["index"] == len(calls) and call["function"]["arguments"] == ""  # the name comes first
                calls.append([call["function"]["name"], ""])
                pieces.append([])
            elif call["function"]["arguments"]:
                calls[call["index"]][1] += call["function"]["arguments"]
                pieces[call["index"]].append(call["function"]["arguments"])
    return content, [tuple(call) for call in calls], pieces


def test_calls_found_in_text_whole_and_streamed():
    auto = ToolUse(TOOLS, "auto")
    assert auto.parse(ANSWER) == ("Let me look.", ANSWER_CALLS)
    for size in (1, 2, 5, 300):  # however the text arrives, the stream adds up to the same answer
        stream = ToolCallStream(auto)
        deltas = [
            d for i in range(0, len(ANSWER), size) for d in stream.feed(ANSWER[i : i + size], i + size >= len(ANSWER))
        ]
        content, calls, pieces = collect(deltas)
        assert (content, calls) == ("Let me look.", ANSWER_CALLS)
        if size == 1:  # name-first calls stream their arguments in pieces; the other order all at once
            assert len(pieces[0]) == len(ANSWER_CALLS[0][1]) and len(pieces[1]) == 1
    assert ToolUse(TOOLS, "auto", parallel=False).parse(ANSWER)[1] == ANSWER_CALLS[:1]
    assert auto.parse("no calls <tool_") == ("no calls <tool_", [])
    assert collect(ToolCallStream(auto).feed("a <tool_", False))[0] == "a "  # may be a tag: held back
    broken = '<tool_call>\n{"name": "f", "arguments": {}\n</tool_call>'  # a closed block that is not JSON
    assert auto.parse(broken) == (broken, [])
    cut = ANSWER[: ANSWER.rindex("</tool_call>") - 20]  # the last block cut by max_tokens before its name: left out
    assert auto.parse(cut) == ("Let me look.", ANSWER_CALLS[:1])
    # cut after its name: a call as far as written, whole as streamed (a stream has sent the name by then; the
    # served cross-talk fuzz found the whole answer leaving it out)
    for cut, written in (('{"city": "Pa}r', '{"city": "Pa}r'), ('"days": 3}}\n', '{"city": "Pa}ris", "days": 3}')):
        text = ANSWER[: ANSWER.index(cut) + len(cut)]
        stream = ToolCallStream(auto)
        deltas = [d for i, char in enumerate(text) for d in stream.feed(char, i == len(text) - 1)]
        assert collect(deltas)[:2] == auto.parse(text) == ("Let me look.", [("get_weather", written)])
    text = '<tool_call>\n{"name": "get", "arguments": {",,,,'
    assert auto.parse(text) == (None, [("get", '{",,,,')]) and collect(ToolCallStream(auto).feed(text, True))[1]
    assert ToolUse(TOOLS, "none").parse(ANSWER) == (ANSWER, [])
    # blocks no call came of: streamed, all of the text is content in the end, as whole (it was lost)
    for text in ('Hm <tool_call>\n{"name": "get_weather",', "<tool_call>\nnot a call\n</tool_call>"):
        stream = ToolCallStream(auto)
        deltas = [d for i, char in enumerate(text) for d in stream.feed(char, i == len(text) - 1)]
        assert collect(deltas)[:2] == auto.parse(text) == (text, []) and not stream.called


def test_tool_choice_is_checked():
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        ToolUse.from_request(TOOLS, "auto", None, None, True)
    with pytest.raises(ValueError, match="not among the tools"):
        ToolUse.from_request(TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "hermes", True)
    with pytest.raises(ValueError, match="tool_choice needs tools"):
        ToolUse.from_request(None, "required", None, None, True)
    assert ToolUse.from_request(TOOLS, None, None, "hermes", True).choice == "auto"  # OpenAI's default
    assert ToolUse.from_request(None, "none", None, None, True) is None


def test_template_renders_tools_results_and_kwargs(tiny_dirs):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["tiny-3b"])
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    ]
    llm = LLM(str(tiny_dirs["tiny-3b"]), max_model_len=1024)
    prompt = llm.inputs.process_chat(history, chat=ChatOptions(tools=TOOLS)).token_ids
    assert tokenizer.decode(prompt) == (
        SYSTEM_WITH_TOOLS + "<|im_start|>user\nWhat will the weather be in Paris?<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    with_image = [
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": PIXEL}}]}
    ]
    output = llm.chat(with_image, SamplingParams(max_tokens=1), chat_template_kwargs={"add_vision_id": True})[0]
    assert "xPicture 1: <|vision_start|>" in output.prompt
    with pytest.raises(ValueError, match="may not set"):
        llm.chat(ASK, chat_template_kwargs={"tools": []})


@pytest.fixture(scope="module")
def server(tiny_dirs):
    with running_server(
        tiny_dirs["tiny-3b"],
        "--max-model-len",
        "1024",
        "--mm-processor-workers",
        "0",
        "--served-model-name",
        "tiny",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ) as (base, _):
        yield base


def ask(base: str, stream: bool, **body) -> list[dict]:
    """Each choice as {"content", "calls", "pieces", "finish"}, through the openai SDK."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 200, **body}
    if not stream:
        reply = client.chat.completions.create(**body)
        return [
            {
                "content": c.message.content,
                "finish": c.finish_reason,
                "ids": [t.id for t in c.message.tool_calls or []],
                "calls": [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
            }
            for c in reply.choices
        ]
    deltas, finish = {}, {}
    for chunk in client.chat.completions.create(stream=True, **body):
        for c in chunk.choices:
            deltas.setdefault(c.index, []).append(c.delta.model_dump(exclude_none=True))
            finish[c.index] = c.finish_reason or finish.get(c.index)
    choices = []
    for index in sorted(deltas):
        content, calls, pieces = collect(deltas[index])
        choices.append({"content": content, "calls": calls, "pieces": pieces, "finish": finish[index]})
    return choices


def test_required_and_named_choices_always_call_with_valid_arguments(server):
    named = {"type": "function", "function": {"name": "find_box"}}
    streamed_pieces = 0
    for choice, parallel, finish in (("required", False, "tool_calls"), (named, None, "stop")):
        for stream in (False, True):
            for seed in range(4):
                for reply in ask(
                    server, stream, tool_choice=choice, parallel_tool_calls=parallel, n=2, temperature=1.0, seed=seed
                ):
                    assert reply["finish"] == finish and len(reply["calls"]) == 1, reply
                    assert not reply["content"]
                    name, arguments = reply["calls"][0]
                    assert choice == "required" or name == "find_box"
                    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
                    streamed_pieces += len(reply.get("pieces", [[]])[0]) > 1
                    assert stream or reply["ids"][0].startswith("chatcmpl-tool-")
    assert streamed_pieces == 16  # every streamed call sent its arguments in several pieces


def test_required_with_parallel_calls_cut_by_max_tokens_end_with_the_cut_call(server):
    """A call cut by max_tokens is returned as far as written, as a stream sends it and as OpenAI does (its
    finish_reason "length" says so); the calls before it are whole."""
    seen_cut = False
    for seed in range(3):
        for reply in ask(server, False, tool_choice="required", n=2, temperature=1.0, seed=seed, max_tokens=90):
            assert reply["calls"], reply
            assert reply["finish"] in ("tool_calls", "length")
            whole = reply["calls"] if reply["finish"] == "tool_calls" else reply["calls"][:-1]
            for name, arguments in whole:
                jsonschema.validate(json.loads(arguments), SCHEMAS[name])
            if reply["finish"] == "length":
                name, arguments = reply["calls"][-1]
                assert name in SCHEMAS and arguments[:1] in ("", "{"), reply
                seen_cut = True
    assert seen_cut  # the random model keeps calling until max_tokens cuts a call


def test_auto_choice_finds_the_call_in_the_answer(server):
    """The random model never writes a call unprompted, so a grammar makes it write text then one call; the
    auto parser must split them (the grammar is not a tool constraint: auto still parses free text)."""
    grammar = (
        'start: "Sure." <tool_call> "\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " %json '
        + json.dumps(
            {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}, **WEATHER}
        )
        + ' "}\\n" </tool_call>'
    )
    for stream in (False, True):
        replies = ask(server, stream, n=2, temperature=1.0, seed=5, extra_body={"guided_grammar": grammar})
        for reply in replies:
            assert reply["finish"] == "tool_calls" and reply["content"] == "Sure.", reply
            ((name, arguments),) = reply["calls"]
            assert name == "get_weather"
            jsonschema.validate(json.loads(arguments), WEATHER)
    plain = ask(server, False, max_tokens=8, temperature=1.0, seed=1)[0]  # no call: plain content
    assert plain["calls"] == [] and plain["content"] and plain["finish"] == "length"


@pytest.mark.parametrize(
    "body, words",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice needs tools"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
                "tool_choice": "required",
            },
            "Invalid type: objectx",
        ),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "constrains the output already"),
        ({"chat_template_kwargs": {"messages": []}}, "may not set ['messages']"),
    ],
)
def test_bad_tool_requests_get_400(server, body, words):
    reply = httpx.post(
        server + "/v1/chat/completions",
        json={"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 4, **body},
        timeout=30,
    )
    assert reply.status_code == 400 and words in reply.json()["error"]["message"], reply.text


def test_tool_results_and_template_kwargs_reach_the_template(server, tiny_dirs):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["tiny-3b"])
    messages = ASK + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "snow"},
    ]
    tokens = httpx.post(
        server + "/tokenize", json={"model": "tiny", "messages": messages, "tools": TOOLS}, timeout=30
    ).json()["tokens"]
    text = tokenizer.decode(tokens)
    assert text.startswith(SYSTEM_WITH_TOOLS) and "<tool_response>\nsnow\n</tool_response>" in text
    assert '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}' in text
    content = [{"type": "image_url", "image_url": {"url": PIXEL}}, {"type": "text", "text": "what?"}]
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "chat_template_kwargs": {"add_vision_id": True},
    }
    reply = httpx.post(server + "/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=30)
    assert reply.status_code == 200
    counted = httpx.post(server + "/tokenize", json=body, timeout=30)
    assert "Picture 1: <|vision_start|>" in tokenizer.decode(counted.json()["tokens"])
    assert reply.json()["usage"]["prompt_tokens"] == counted.json()["count"]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--enable-auto-tool-choice"], "requires --tool-call-parser"),
        (["--tool-call-parser", "mistral"], "'mistral' is not implemented"),
    ],
)
def test_tool_flags_are_checked_at_start(flags, words):
    done = subprocess.run(
        [sys.executable, "-m", "fovea.cli", "serve", "/nonexistent", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and words in done.stderr
