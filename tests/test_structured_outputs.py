"""Structured outputs on the random-weight tiny model, whose free text is never JSON: every output that ends with
`stop` matches its schema, regex or choice; schemas that bound every string end with `stop` (almost) always; the
request forms of OpenAI and vLLM reach the engine; a grammar that does not compile is a 400 with the reason."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from fovea import LLM, SamplingParams, StructuredOutputsParams
from serving import running_server

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "tags", "address"],
          "properties": {
              "name": {"type": "string", "maxLength": 12},
              "age": {"type": "integer", "minimum": 0, "maximum": 120},
              "role": {"enum": ["admin", "user", "guest"]},
              "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
              "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                          "properties": {"city": {"type": "string", "maxLength": 10},
                                         "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}}}}}
BOX = {"type": "object", "additionalProperties": False, "required": ["label", "box"],
       "properties": {"label": {"enum": ["cat", "dog", "boat"]},
                      "box": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1000},
                              "minItems": 4, "maxItems": 4}}}
REGEX = r"([0-9]{3})-[A-Z]{2,4}"  # not \d: Unicode versions disagree on which digits that takes
CHOICES = ["yes", "no", "maybe not"]


def check(text: str, finish: str, spec: StructuredOutputsParams) -> bool:
    """Whether `text` satisfies `spec` (for outputs that stopped); length-cut outputs are only counted."""
    if finish != "stop":
        return False
    if spec.json is not None:
        jsonschema.validate(json.loads(text), spec.json)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    else:
        assert text in spec.choice, text
    return True


def test_offline_outputs_match_their_constraints(tiny_dirs):
    llm = LLM(str(tiny_dirs["tiny-3b"]), max_model_len=512)
    prompts = [f"Describe person number {i}:" for i in range(6)]
    specs = [StructuredOutputsParams(json=PERSON), StructuredOutputsParams(json=BOX),
             StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=CHOICES)]
    stopped = total = 0
    for spec in specs:
        params = SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=120, structured_outputs=spec)
        for output in llm.generate(prompts, params, use_tqdm=False):
            for sample in output.outputs:
                stopped += check(sample.text, sample.finish_reason, spec)
                total += 1
    assert total == 48 and stopped >= 46  # every string is bounded: nearly all end on their own
    free = llm.generate(prompts[:2], SamplingParams(temperature=1.0, seed=3, max_tokens=40), use_tqdm=False)
    for output in free:  # the same model unconstrained: not JSON (the constraint above did the work)
        with pytest.raises(json.JSONDecodeError):
            json.loads(output.outputs[0].text)


class Detection(BaseModel):
    label: Literal["cat", "dog", "boat"]
    confidence: int = Field(ge=0, le=100)


@pytest.fixture(scope="module")
def client(tiny_dirs):
    with running_server(tiny_dirs["tiny-3b"], "--max-model-len", "1024", "--mm-processor-workers", "0",
                        "--served-model-name", "tiny") as (base, _):
        yield openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)


def chat(client, stream: bool = False, **body):
    messages = [{"role": "user", "content": "Give me the answer."}]
    body = {"max_tokens": 120, **body}
    if not stream:
        reply = client.chat.completions.create(model="tiny", messages=messages, **body)
        return [(c.message.content, c.finish_reason) for c in reply.choices]
    texts, reasons = {}, {}
    for chunk in client.chat.completions.create(model="tiny", messages=messages, stream=True, **body):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    return [(texts[i], reasons[i]) for i in sorted(texts)]


def test_server_request_forms(client):
    forms = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON,
                                                                      "strict": True}}),
         StructuredOutputsParams(json=PERSON)),
        (dict(extra_body={"structured_outputs": {"json": BOX}}), StructuredOutputsParams(json=BOX)),
        (dict(extra_body={"guided_regex": REGEX}), StructuredOutputsParams(regex=REGEX)),
        (dict(extra_body={"structured_outputs": {"choice": CHOICES}}), StructuredOutputsParams(choice=CHOICES)),
        (dict(extra_body={"guided_json": BOX}), StructuredOutputsParams(json=BOX)),
    ]
    stopped = total = 0
    for body, spec in forms:
        for stream in (False, True):
            for seed in range(5):
                for text, finish in chat(client, stream, n=2, temperature=1.0, seed=seed, **body):
                    stopped += check(text, finish, spec)
                    total += 1
    assert total == 100 and stopped >= 95
    anything = chat(client, response_format={"type": "json_object"}, max_tokens=60, temperature=0)
    assert anything[0][1] != "stop" or isinstance(json.loads(anything[0][0]), dict)


def test_openai_sdk_parse_with_a_pydantic_model(client):
    for seed in range(3):
        reply = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "What is it?"}],
                                              response_format=Detection, temperature=1.0, seed=seed, max_tokens=60)
        parsed = reply.choices[0].message.parsed
        assert isinstance(parsed, Detection) and 0 <= parsed.confidence <= 100


@pytest.mark.parametrize("body, words", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}),
     "Invalid type: objectx"),
    (dict(extra_body={"guided_grammar": "start: (("}), "does not compile"),
    (dict(extra_body={"guided_regex": "a", "guided_choice": ["b"]}), "exactly one of"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}),
     "not response_format and guided_regex"),
    (dict(extra_body={"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " "}}),
     "['whitespace_pattern'] not supported"),
    (dict(response_format={"type": "xml"}), "response_format type must be"),
])
def test_bad_constraints_get_400_with_the_reason(client, body, words):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, **body)
    assert words in str(error.value)


@pytest.mark.parametrize("extra, refused", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"priority": 5}, "priority"), ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
    ({"use_beam_search": True}, "use_beam_search"), ({"echo": True}, "echo"),
    ({"priority": 0, "best_of": 1, "parallel_tool_calls": False, "store": False}, None),  # values asking nothing
    ({"not_a_field_of_any_api": 1}, None),  # outside both protocols: logged and ignored, as vLLM does
])
def test_protocol_fields_fovea_lacks_are_refused_by_name(client, extra, refused):
    if refused is None:
        assert chat(client, extra_body=extra, max_tokens=2)[0][1] in ("stop", "length")
        return
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, extra_body=extra, max_tokens=2)
    assert f"{refused} is not supported by fovea yet" in str(error.value)
