"""`--reasoning-parser qwen3` (and deepseek_r1's rule): the <think> part of an answer in the message's `reasoning` / `reasoning_content`, the
rest in `content`, whole and streamed; structured outputs begin after the reasoning; tool calls are found after it;
`enable_thinking: false` reaches the template and leaves everything content. The random model (tiny Qwen3-VL, whose
vocabulary has <think> and </think>) never thinks on its own, so grammars and logit_bias write the answers."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from serving import running_server

from fovea.server.reasoning import Reasoning

# a thinking template: the generation prompt opens <think> (an empty, closed block when thinking is off)
TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}{% else %}{% for part in message.content %}"
    "{%- if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part.type == 'video' %}<|vision_start|><|video_pad|><|vision_end|>{% else %}{{ part.text }}{% endif %}"
    "{%- endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}\n<think>\n\n</think>\n\n{% else %}\n<think>\n{% endif %}"
    "{%- endif %}"
)
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
OFF = {"enable_thinking": False}
# a thought of ~70 tokens: long enough that its stream has several deltas even when a loaded machine's event loop
# falls behind the engine (the front end merges a request's outputs that wait for it: one delta of 15 tokens was seen)
THOUGHT = " ".join(["Two and two make four."] * 10)
# <think> and </think> are added tokens: a grammar names them as tokens (llguidance's <...> syntax)
THINK_THEN_ANSWER = {
    "guided_grammar": f'start: <think> "{THOUGHT}" </think> "\\n\\nFour."',
    "chat_template_kwargs": OFF,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
THINK_END_ID = 151668  # "</think>" in Qwen3's vocabulary
ANSWER = {"type": "object", "required": ["answer"], "additionalProperties": False,
          "properties": {"answer": {"enum": [3, 4, 5]}}}  # fmt: skip


@pytest.mark.parametrize(
    "prompt, text, expected",
    [
        ("assistant\n<think>\n", "Two and two.</think>\n\nFour.", ("Two and two.", "\n\nFour.")),
        ("assistant\n<think>\n", "<think>tag again</think>x", ("tag again", "x")),  # older models write it too
        ("assistant\n<think>\n", "cut off at max_tokens </thi", ("cut off at max_tokens </thi", None)),
        ("assistant\n", "<think>own tag</think>Four.", ("own tag", "Four.")),
        ("assistant\n", "Four. <think> is text here", (None, "Four. <think> is text here")),
        ("assistant\n<think>\n\n</think>\n\n", "Four.", (None, "Four.")),  # enable_thinking false
    ],
)
def test_split_whole_and_in_any_pieces(prompt, text, expected):
    split_in_pieces("qwen3", prompt, text, expected)


@pytest.mark.parametrize(
    "prompt, text, expected",
    [
        ("assistant\n", "Two and two.</think>\n\nFour.", ("Two and two.", "\n\nFour.")),  # no tag: open anyway
        ("assistant\n", "<think>own tag</think>Four.", ("own tag", "Four.")),
        ("assistant\n<think>\n", "Thinking.</think>Four.", ("Thinking.", "Four.")),
        ("assistant\n", "never closed", ("never closed", None)),
    ],
)
def test_deepseek_r1_reasons_from_the_first_token(prompt, text, expected):
    split_in_pieces("deepseek_r1", prompt, text, expected)


def test_reasoning_tokens_as_each_parser_opens_the_reasoning(family_dirs):
    """The Responses API's reasoning_tokens: deepseek_r1 counts from the first token (after a tag the output
    writes), qwen3 only where the prompt or the output opens the reasoning."""
    from conftest import hf_tokenizer

    from fovea.server.reasoning import reasoning_tokens

    tokenizer = hf_tokenizer(family_dirs["qwen3-vl"])
    plain, tagged = tokenizer.encode("ab</think>cd"), tokenizer.encode("<think>ab</think>cd")
    assert (
        reasoning_tokens("deepseek_r1", "assistant\n", tokenizer, plain),
        reasoning_tokens("qwen3", "assistant\n", tokenizer, plain),
    ) == (1, 0)
    assert reasoning_tokens("deepseek_r1", "assistant\n", tokenizer, tagged) == 1
    assert reasoning_tokens("qwen3", "assistant\n<think>\n", tokenizer, plain) == 1


def split_in_pieces(name: str, prompt: str, text: str, expected) -> None:
    assert Reasoning(name, prompt).split(text) == expected
    for size in range(1, len(text) + 1):  # however the text arrives, the pieces add up to the same split
        parser, thought, content = Reasoning(name, prompt), "", ""
        for i in range(0, len(text), size):
            a, b = parser.feed(text[i : i + size], i + size >= len(text))
            thought, content = thought + a, content + b
        assert (thought or None, content or None) == expected, size


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from fovea.testing.tiny_qwen3_vl import write_qwen3_vl_checkpoint

    model_dir = write_qwen3_vl_checkpoint(tmp_path_factory.mktemp("qwen3-vl"), seed=11)
    template = model_dir / "thinking.jinja"
    template.write_text(TEMPLATE)
    flags = ["--max-model-len", "1024", "--mm-processor-workers", "0", "--served-model-name", "tiny"]
    flags += ["--chat-template", str(template), "--reasoning-parser", "qwen3"]
    with running_server(model_dir, *flags, "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as (base, _):
        yield base


PIECES: list[int] = []  # reasoning deltas per stream, to see that reasoning does stream


def chat(base: str, stream: bool, **body) -> tuple[str | None, str | None, list, str]:
    """(reasoning, content, tool calls, finish_reason) of the first choice, as the raw JSON says them."""
    body = {"model": "tiny", "messages": ASK, "max_tokens": 200, "temperature": 0, **body}
    if not stream:
        reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()
        message = reply["choices"][0]["message"]
        assert message["reasoning"] == message["reasoning_content"]
        return (
            message["reasoning"],
            message["content"],
            message.get("tool_calls") or [],
            reply["choices"][0]["finish_reason"],
        )
    thought, content, calls, finish = "", "", [], None
    PIECES.append(0)
    with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                assert delta.get("reasoning") == delta.get("reasoning_content")
                thought += delta.get("reasoning") or ""
                PIECES[-1] += bool(delta.get("reasoning"))
                content += delta.get("content") or ""
                calls += delta.get("tool_calls") or []
                finish = choice["finish_reason"] or finish
    return thought or None, content or None, calls, finish


def test_reasoning_then_answer_whole_and_streamed(server):
    """A model that writes its own <think> (after a prompt that closed one): split whole and token by token."""
    for stream in (False, True):
        assert chat(server, stream, **THINK_THEN_ANSWER)[:2] == (THOUGHT, "\n\nFour."), stream
    assert PIECES[-1] > 3  # token by token, not in one piece at the end


def test_responses_api_gives_a_reasoning_item_then_the_message(server):
    """The Responses API: the <think> part as a reasoning item (reasoning_text deltas when streamed), the answer as
    the message after it (vLLM's sampling extras, here a grammar, pass through)."""
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)
    grammar = THINK_THEN_ANSWER
    whole = client.responses.create(model="tiny", input=ASK, max_output_tokens=200, extra_body=grammar)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == THOUGHT and whole.output_text == "\n\nFour."
    events = list(
        client.responses.create(model="tiny", input=ASK, max_output_tokens=200, stream=True, extra_body=grammar)
    )
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == THOUGHT and sum(e.type == "response.reasoning_text.delta" for e in events) > 3
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
    assert events[-1].response.output_text == "\n\nFour."
    # the reasoning's own tokens: those between <think> and </think> (each one token of the vocabulary)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(httpx.get(server + "/v1/models").json()["data"][0]["root"])
    thinking = len(tokenizer.encode(THOUGHT, add_special_tokens=False))
    for usage in (whole.usage, events[-1].response.usage):
        assert usage.output_tokens_details.reasoning_tokens == thinking, usage
        assert usage.output_tokens > thinking
    with pytest.raises(openai.BadRequestError, match="conversation is not supported"):
        client.responses.create(model="tiny", input=ASK, extra_body={"conversation": "conv_1"})


def test_structured_output_begins_after_the_reasoning(server):
    """The prompt opens <think>: the schema does not constrain the reasoning (here closed at once by logit_bias,
    which the schema would never allow), then the answer follows it."""
    for stream in (False, True):
        thought, content, _, finish = chat(
            server, stream, logit_bias={str(THINK_END_ID): 100}, response_format={
                "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
        )  # fmt: skip
        assert thought is None and finish == "stop", (stream, content)
        jsonschema.validate(json.loads(content), ANSWER)


def test_thinking_off_and_unclosed_reasoning(server):
    assert chat(server, False, chat_template_kwargs=OFF, guided_regex="Four\\.")[:2] == (None, "Four.")
    for stream in (False, True):  # the random model never closes its reasoning: all of it is reasoning
        thought, content, _, finish = chat(server, stream, max_tokens=8, temperature=1.0, seed=3)
        assert thought and content is None and finish == "length"


def test_tool_call_found_after_the_reasoning(server):
    grammar = (
        'start: <think> "I should look it up." </think> "\\n\\n" <tool_call> '
        '"\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Oslo\\"}}\\n" </tool_call>'
    )
    for stream in (False, True):
        thought, content, calls, finish = chat(
            server, stream, tools=[WEATHER], tool_choice="auto", guided_grammar=grammar, chat_template_kwargs=OFF
        )
        assert thought == "I should look it up." and finish == "tool_calls", (stream, content)
        assert calls and calls[0]["function"]["name"] == "get_weather"


def test_qwen3_vl_chat_with_an_image_and_a_video_over_http(server):
    """Qwen3-VL serves images like the other families: 16-pixel patches (32-pixel tokens) counted in the usage;
    and videos, their temporal patches between timestamps."""
    import base64
    import io

    import numpy as np
    from conftest import random_image, video_file

    buffer = io.BytesIO()
    random_image(320, 256, seed=4).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    with_image = httpx.post(server + "/v1/chat/completions", json=body, timeout=60).json()
    text_only = httpx.post(
        server + "/v1/chat/completions",
        json={**body, "messages": [{"role": "user", "content": content[1:]}]},
        timeout=60,
    ).json()
    image_tokens = with_image["usage"]["prompt_tokens"] - text_only["usage"]["prompt_tokens"]
    assert image_tokens == (320 // 32) * (256 // 32) + 2  # the tokens of a 320 x 256 image, and vision start / end
    assert with_image["choices"][0]["finish_reason"] == "length"

    # a video file: 8 frames at 4 fps, 4 kept (0, 2 | 5, 7), two temporal patches of 96 x 64 pixels, each after its
    # time as text (`<0.2 seconds>` and `<1.5 seconds>`: 6 tokens each)
    clip = np.stack([np.asarray(random_image(96, 64, seed=20 + i)) for i in range(8)])
    video = "data:video/x-matroska;base64," + base64.b64encode(video_file(clip, 4)).decode()
    body["messages"][0]["content"] = [{"type": "video_url", "video_url": {"url": video}}, content[1]]
    with_video = httpx.post(server + "/v1/chat/completions", json=body, timeout=60).json()
    video_tokens = with_video["usage"]["prompt_tokens"] - text_only["usage"]["prompt_tokens"]
    assert video_tokens == 2 * (6 + 1 + (96 // 32) * (64 // 32) + 1), with_video
    assert with_video["choices"][0]["finish_reason"] == "length"


def test_a_stream_of_whitespace_costs_each_delta_its_own_length():
    """48k whitespace tokens once cost 105 s of the event loop (each delta stripped the whole text held back) and
    the stream showed nothing until its end. Now whitespace past MAX_LEAD is taken as no tag and streams as it
    comes: 50,000 deltas in well under a second, the text out equal to the text in, and a tag after a little
    whitespace still opens the reasoning."""
    import time

    from fovea.server.reasoning import MAX_LEAD, Reasoning

    for opened, field in ((False, 1), (True, 0)):
        parser = Reasoning("qwen3", "<think>" if opened else "")
        start, out, late = time.monotonic(), [], 0
        for i in range(50_000):
            piece = parser.feed(" \n"[i % 2], False)[field]
            out.append(piece)
            late = late or (i > MAX_LEAD and piece == "")
        out.append(parser.feed("", True)[field])
        assert time.monotonic() - start < 2.0 and not late
        assert "".join(out) == " \n" * 25_000
    parser = Reasoning("qwen3", "")
    parts = [parser.feed(piece, False) for piece in [" "] * 100 + ["<thi", "nk>", "why", "</think>", "so"]]
    assert "".join(r for r, _ in parts) == "why" and "".join(c for _, c in parts) == "so"
