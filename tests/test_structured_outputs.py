"""Structured outputs on the random-weight tiny model, whose free text is never JSON: every output that ends with
`stop` matches its schema, regex or choice; schemas that bound every string end with `stop` (almost) always; the
request forms of OpenAI and vLLM reach the engine; a grammar that does not compile is a 400 with the reason."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import psutil
import pytest
from pydantic import BaseModel, Field
from serving import running_server

from fovea import LLM, SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "role", "tags", "address"],
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "zip"],
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
        },
    },
}
BOX = {
    "type": "object",
    "additionalProperties": False,
    "required": ["label", "box"],
    "properties": {
        "label": {"enum": ["cat", "dog", "boat"]},
        "box": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 1000},
            "minItems": 4,
            "maxItems": 4,
        },
    },
}
REGEX = r"([0-9]{3})-[A-Z]{2,4}"  # not \d: Unicode versions disagree on which digits that takes
CHOICES = ["yes", "no", "maybe not"]


# a flat schema whose $ref chain is 2,500 long: llguidance's conversion overflows its stack on it (2,000 passes)
REF_CHAIN = {
    "$defs": {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(2500)} | {"a2500": {"type": "string"}},
    "$ref": "#/$defs/a0",
}


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
    specs = [
        StructuredOutputsParams(json=PERSON),
        StructuredOutputsParams(json=BOX),
        StructuredOutputsParams(regex=REGEX),
        StructuredOutputsParams(choice=CHOICES),
    ]
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


def test_constraints_hold_through_chunked_prefill_preemption_prefix_cache_and_stop_strings(tiny_dirs):
    """16 samples of 104-token prompts sharing 64 tokens, prefilled 48 tokens a step, in 40 KV blocks (a sample
    may need 11): sequences are preempted and recomputed, prefixes come from the cache, and every output that
    stopped still validates (a recomputed sequence's matcher is not advanced twice)."""
    llm = LLM(
        str(tiny_dirs["tiny-3b"]),
        max_model_len=512,
        max_num_seqs=16,
        max_num_batched_tokens=48,
        block_size=16,
        num_gpu_blocks_override=40,
    )
    shared = [(13 * j) % 5000 + 200 for j in range(64)]
    prompts = [{"prompt_token_ids": shared + [(7 * i + j) % 5000 + 300 for j in range(40)]} for i in range(8)]
    spec = StructuredOutputsParams(json=BOX)
    outputs = llm.generate(
        prompts, SamplingParams(temperature=1.0, n=2, seed=1, max_tokens=60, structured_outputs=spec), use_tqdm=False
    )
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.prefix_cache_hits >= 7 * 64
    stopped = sum(check(s.text, s.finish_reason, spec) for o in outputs for s in o.outputs)
    assert stopped >= 15
    cut = llm.generate(
        prompts[:4],
        SamplingParams(
            temperature=1.0, seed=2, max_tokens=20, stop=["-"], structured_outputs=StructuredOutputsParams(regex=REGEX)
        ),
        use_tqdm=False,
    )
    for output in cut:  # a stop string ends a constrained answer where it appears, as in free text
        sample = output.outputs[0]
        assert (sample.finish_reason, sample.stop_reason) == ("stop", "-") and re.fullmatch("[0-9]{3}", sample.text)


class Detection(BaseModel):
    label: Literal["cat", "dog", "boat"]
    confidence: int = Field(ge=0, le=100)


@pytest.fixture(scope="module")
def client(tiny_dirs):
    with running_server(
        tiny_dirs["tiny-3b"],
        "--max-model-len",
        "1024",
        "--mm-processor-workers",
        "0",
        "--served-model-name",
        "tiny",
        "--enable-log-requests",
    ) as (base, proc):
        yield openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    # the grammar engine (its vocabulary table, its compiled masking step) started before any request came
    ready = proc.output.index("structured outputs: grammar engine ready in")
    assert (
        proc.output.index("structured outputs: starting the grammar engine") < ready < proc.output.index("request c")
    )  # the first request logged (--enable-log-requests), chat or completion
    assert all(len(line) < 1300 for line in proc.output.splitlines())  # 100,000 choices are not logged whole


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
        (
            dict(
                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
            ),
            StructuredOutputsParams(json=PERSON),
        ),
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
        reply = client.chat.completions.parse(
            model="tiny",
            messages=[{"role": "user", "content": "What is it?"}],
            response_format=Detection,
            temperature=1.0,
            seed=seed,
            max_tokens=60,
        )
        parsed = reply.choices[0].message.parsed
        assert isinstance(parsed, Detection) and 0 <= parsed.confidence <= 100


@pytest.mark.parametrize(
    "body, words",
    [
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}),
            "Invalid type: objectx",
        ),
        (dict(extra_body={"guided_grammar": "start: (("}), "does not compile"),
        (dict(extra_body={"guided_regex": "a", "guided_choice": ["b"]}), "exactly one of"),
        (
            dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}),
            "not response_format and guided_regex",
        ),
        (
            dict(extra_body={"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " "}}),
            "['whitespace_pattern'] not supported",
        ),
        (dict(response_format={"type": "xml"}), "response_format type must be"),
        (dict(extra_body={"structured_outputs": {"json": [{"type": "object"}]}}), "must be a JSON schema (an object)"),
        (dict(extra_body={"guided_json": REF_CHAIN}), "nests deeper than 64 levels"),
    ],
)
def test_bad_constraints_get_400_with_the_reason(client, body, words):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, **body)
    assert words in str(error.value)


@pytest.mark.parametrize(
    "extra, refused",
    [
        ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
        ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
        ({"best_of": 2}, "best_of"),
        ({"priority": 0, "best_of": 1, "parallel_tool_calls": False, "store": False}, None),  # values asking nothing
        ({"not_a_field_of_any_api": 1}, None),  # outside both protocols: logged and ignored, as vLLM does
    ],
)
def test_protocol_fields_fovea_lacks_are_refused_by_name(client, extra, refused):
    if refused is None:
        assert chat(client, extra_body=extra, max_tokens=2)[0][1] in ("stop", "length")
        return
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, extra_body=extra, max_tokens=2)
    assert f"{refused} is not supported by fovea yet" in str(error.value)


GBNF = """root ::= greeting " " name "!"
greeting ::= "hello" | "hi"
name ::= [A-C] ("ann" | "ob")
"""


@pytest.mark.parametrize("stream", [False, True])
def test_gbnf_grammars_as_vllm_users_write_them(client, stream):
    """vLLM's docs and its xgrammar backend take grammars in GBNF (`root ::= ...`): converted to Lark (in the
    grammar-check child, whose time is bounded), they constrain as Lark does. Before, a 400 (Lark only)."""
    for body in ({"guided_grammar": GBNF}, {"structured_outputs": {"grammar": GBNF}}):
        for text, finish in chat(client, stream, extra_body={**body, "temperature": 1.0, "seed": 3}, n=3):
            assert finish == "stop" and re.fullmatch(r"(hello|hi) [A-C](ann|ob)!", text), text


@pytest.mark.parametrize(
    "grammar, words",
    [
        (
            "root ::= r0\n" + "".join(f'r{i} ::= "x" r{i + 1} | "y"\n' for i in range(1000)) + 'r1000 ::= "z"\n',
            "1002 GBNF rules; at most 1000",
        ),
        ("root ::= " + "(" * 3000 + '"a"' + ")" * 3000, "nests too deep to convert from GBNF"),
        ("root ::= (", "neither Lark (no start: rule) nor GBNF"),
    ],
)
def test_gbnf_grammars_past_the_converters_bounds_get_400(client, grammar, words):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, extra_body={"guided_grammar": grammar}, max_tokens=4)
    assert words in str(error.value)


@pytest.mark.parametrize(
    "body, rival",
    [
        # ids 0-29 are punctuation and digits in the tiny vocabulary: none starts "yes" or "no"
        ({"structured_outputs": {"choice": ["yes", "no"]}, "allowed_token_ids": list(range(30))}, "allowed_token_ids"),
        ({"structured_outputs": {"regex": "[a-c]{1,3}"}, "min_tokens": 6, "temperature": 0}, "min_tokens"),
    ],
)
def test_settings_that_leave_the_grammar_no_token_are_a_400_naming_them(client, body, rival):
    """A grammar and the request's own token bans (allowed_token_ids; min_tokens, which bans the end the grammar
    demands) can leave no token to sample: the request is refused with a 400 that names them, streamed or not,
    one prompt or several, and the server goes on. Before, a 500 "the engine failed" (and with several prompts
    "aclose(): asynchronous generator is already running")."""
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, extra_body=body, max_tokens=12)
    assert f"{rival} allow after" in str(error.value) and "contradict" in str(error.value)
    with pytest.raises(openai.BadRequestError, match=rival):
        client.completions.create(model="tiny", prompt=["Say", "Tell"], max_tokens=12, extra_body=body)
    with pytest.raises(openai.APIError, match=rival):  # a 400, or an error event if the stream had begun
        for _ in client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], stream=True, max_tokens=12, extra_body=body
        ):
            pass
    assert chat(client, max_tokens=3, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})[0][0] in (
        "yes",
        "no",
    )


def test_grammars_that_crash_or_outnest_the_compiler_cost_only_their_request(client):
    """A chain of 5,000 Lark rules is a segmentation fault in llguidance: compiled in a child process, it is a
    400 and a new child, the server and engine go on. Bodies that nest 10,000 deep (a schema through properties,
    items or anyOf; tool parameters) are 400s, not Python's RecursionError."""
    import httpx

    base = str(client.base_url).removesuffix("/v1/")
    chain = "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(5000)) + '\nr5000: "a"'
    with pytest.raises(openai.BadRequestError, match="crashed the grammar compiler"):
        chat(client, extra_body={"guided_grammar": chain})
    message = '"messages": [{"role": "user", "content": "hi"}]'
    deep = {
        "properties": '{"type": "object", "properties": {"x": ' * 10000 + "{}" + "}}" * 10000,
        "items": '{"type": "array", "items": ' * 10000 + "{}" + "}" * 10000,
        "anyOf": '{"anyOf": [' * 10000 + "{}" + "]}" * 10000,
    }
    for kind, schema in deep.items():
        for body in (
            f'{{{message}, "guided_json": {schema}}}',
            f'{{{message}, "tools": [{{"type": "function", "function": {{"name": "f", "parameters": {schema}}}}}]}}',
        ):
            reply = httpx.post(
                base + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
            )
            assert reply.status_code == 400 and "nest" in reply.json()["error"]["message"], (kind, reply.text[:300])
    shallow = {"type": "object", "properties": {"x": {"type": "object", "properties": {"y": {"type": "integer"}}}}}
    nested = '{"type": "object", "properties": {"x": ' * 30 + '{"type": "integer"}' + "}}" * 30
    assert chat(client, extra_body={"guided_json": json.loads(nested)}, max_tokens=2)[0][1] in ("stop", "length")
    text, finish = chat(client, extra_body={"guided_json": shallow}, max_tokens=40)[0]
    assert finish == "length" or json.loads(text)
    assert httpx.get(base + "/health").status_code == 200


def test_a_grammar_past_its_time_kills_its_child_and_is_refused_at_once_after(tiny_dirs, monkeypatch):
    import fovea.engine.structured_outputs as so
    from fovea.config.model import ModelConfig
    from fovea.frontend.grammar_checks import GrammarChecks
    from fovea.multimodal.prompt import load_tokenizer

    model = ModelConfig.from_dir(tiny_dirs["tiny-3b"])
    before = {child.pid for child in psutil.Process().children()}

    def grammar_children() -> list:
        return [c for c in psutil.Process().children() if c.pid not in before and "grammar_checks" in c.cmdline()[-1]]

    checks = GrammarChecks(load_tokenizer(tiny_dirs["tiny-3b"]), model.text.vocab_size, model.eos_token_ids)
    try:
        assert grammar_children() == []  # none until a grammar comes: a server that never sees one has none
        checks.check(StructuredOutputsParams(choice=["warm"]))  # the child has read the vocabulary
        assert len(grammar_children()) == 1
        # ~0.16 s to compile here (40 properties took 14 ms, close enough to the 5 ms limit to pass it under load)
        wide = StructuredOutputsParams(json={"type": "object", "properties": {f"p{i}": PERSON for i in range(400)}})
        monkeypatch.setattr(so, "COMPILE_TIMEOUT_S", 0.005)
        with pytest.raises(ValueError, match="did not compile within"):
            checks.check(wide)
        asked = []
        ask = checks._ask
        monkeypatch.setattr(checks, "_ask", lambda child, params: asked.append(params) or ask(child, params))
        with pytest.raises(ValueError, match="did not compile within"):
            checks.check(wide)  # known to be too slow: no child is asked (a timed bound flaked under load)
        assert asked == []
        monkeypatch.setattr(so, "COMPILE_TIMEOUT_S", 10.0)
        checks.check(StructuredOutputsParams(regex="[a-z]{3}"))  # a new child answers
        with pytest.raises(ValueError, match="does not compile"):
            checks.check(StructuredOutputsParams(regex="(a"))
        # a GBNF grammar comes back as the child converted it (the engine compiles Lark), once
        converted = checks.check(StructuredOutputsParams(grammar=GBNF))
        assert converted.grammar.startswith("%llguidance") and "start:" in converted.grammar
        assert checks.check(StructuredOutputsParams(grammar=GBNF)) == converted and len(asked) == 3
    finally:
        checks.close()


def test_a_grammar_child_that_dies_as_it_starts_fails_that_check_only(tiny_dirs, monkeypatch):
    """A child that exits before reading the vocabulary (here: a command that ends at once) is the server's failure,
    named as such, not the grammar's; it is reaped, and the next check starts a child that works."""
    import sys

    from fovea.config.model import ModelConfig
    from fovea.frontend.grammar_checks import GrammarChecks
    from fovea.multimodal.prompt import load_tokenizer

    model = ModelConfig.from_dir(tiny_dirs["tiny-3b"])
    checks = GrammarChecks(load_tokenizer(tiny_dirs["tiny-3b"]), model.text.vocab_size, model.eos_token_ids)
    try:
        with monkeypatch.context() as patched:
            patched.setattr(sys, "executable", "/bin/true")
            with pytest.raises(RuntimeError, match="a grammar-check process died as it started"):
                checks.check(StructuredOutputsParams(regex="[a-z]{2}"))
        assert not [c for c in psutil.Process().children() if c.status() == psutil.STATUS_ZOMBIE]
        checks.check(StructuredOutputsParams(regex="[a-z]{2}"))
        with pytest.raises(ValueError, match="does not compile"):
            checks.check(StructuredOutputsParams(regex="(a"))
    finally:
        checks.close()


def test_the_engine_keeps_few_compiled_grammars_and_the_ones_in_use(tiny_dirs, monkeypatch):
    """The engine kept up to 1,024 compiled grammars, each ~130 KB for a small schema: ever-new schemas grew it
    for an hour (the soak). It keeps COMPILED_KEPT now, the least recently used going first, so a schema in steady
    use among ever-new ones is compiled once."""
    import fovea.engine.structured_outputs as so
    from fovea.config.model import ModelConfig
    from fovea.engine.tokenizer import load_engine_tokenizer

    model = ModelConfig.from_dir(tiny_dirs["tiny-3b"])
    compiler = so.GrammarCompiler(
        load_engine_tokenizer(tiny_dirs["tiny-3b"]), model.text.vocab_size, list(model.eos_token_ids)
    )
    compiled, compile_matcher = [], so.compile_matcher
    monkeypatch.setattr(so, "compile_matcher", lambda *args: compiled.append(args[1].key()) or compile_matcher(*args))
    steady = StructuredOutputsParams(json=BOX)
    fresh = [
        StructuredOutputsParams(json={"type": "object", "properties": {f"f{i}": {"type": "integer"}}})
        for i in range(3 * so.COMPILED_KEPT)
    ]
    for params in fresh:
        compiler.matcher(params)
        compiler.matcher(steady)
    assert compiled.count(steady.key()) == 1 and len(compiled) == len(fresh) + 1
    assert len(compiler._compiled) == so.COMPILED_KEPT
    compiler.matcher(fresh[-2])  # among the last used: kept
    compiler.matcher(fresh[0])  # long unused: compiled again
    assert compiled[len(fresh) + 1 :] == [fresh[0].key()]


def test_an_offline_engine_says_when_it_starts_the_grammar_engine(tiny_dirs, fovea_log):
    llm = LLM(str(tiny_dirs["tiny-3b"]), max_model_len=256)
    assert "grammar engine" not in fovea_log.text  # offline, it starts with the first structured request
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert llm.generate("Well?", params, use_tqdm=False)[0].outputs[0].text in ("yes", "no")
    assert "structured outputs: starting the grammar engine (once; can take seconds)" in fovea_log.text
    assert "structured outputs: grammar engine ready in" in fovea_log.text


def test_large_grammars_compile_off_the_event_loop(client):
    """Six requests with 100,000-entry choice lists at once: their grammars compile in the preparation pool (one
    compiler for the whole front end), so /health answers promptly meanwhile (4.4 s at its worst before, 0.25-0.4 s
    after on the 2-core CI machine; 1.04 s once while the bodies were parsed, with the whole suite running beside
    it: the bound leaves room for that; 2.77 s once on a slower machine, when each poll made a new client and its
    TLS set-up was counted too)."""
    import threading
    import time

    import httpx

    base = str(client.base_url).removesuffix("/").removesuffix("/v1")
    choices = [f"option-{i:06d}" for i in range(100_000)]
    bodies = [
        json.dumps(
            {
                "model": "tiny",
                "prompt": f"pick {k}",
                "max_tokens": 3,
                "guided_choice": [choice + str(k) for choice in choices],
            }
        ).encode()
        for k in range(6)
    ]
    answers = []

    def send(body):
        answers.append(
            httpx.post(
                base + "/v1/completions", content=body, timeout=300, headers={"content-type": "application/json"}
            )
        )

    threads = [threading.Thread(target=send, args=(body,)) for body in bodies]
    for thread in threads:
        thread.start()
    waits = []
    with httpx.Client(timeout=60) as poll:  # one client: a new one's TLS set-up alone took 0.1-0.3 s under load
        while any(thread.is_alive() for thread in threads):
            start = time.monotonic()
            assert poll.get(base + "/health").status_code == 200
            waits.append(time.monotonic() - start)
            time.sleep(0.05)
    assert len(answers) == 6 and all(answer.status_code == 200 for answer in answers)
    assert all(answer.json()["choices"][0]["text"].startswith("option-") for answer in answers)
    assert len(waits) >= 5 and max(waits) < 2.0, waits


def test_slow_grammars_cost_their_own_request_only(tiny_dirs, monkeypatch):
    """A grammar that takes long to build (a crafted schema; here a build made slow on purpose): the check gives
    up after FOVEA_GRAMMAR_TIMEOUT of building and refuses the same grammar at once afterwards (time queued behind
    other builds does not count); in the engine the build runs
    beside the steps, so a plain request runs to its end meanwhile, and the structured one starts once built."""
    import threading
    import time

    import fovea.engine.structured_outputs as so
    from fovea.core.sampling_params import RequestOutputKind

    llm = LLM(str(tiny_dirs["tiny-3b"]), max_model_len=256)
    compiler = llm.engine.grammars.compiler
    slow = StructuredOutputsParams(choice=["slow", "down"])
    fresh = compiler._fresh

    def slowed(params):
        if params.key() == slow.key():
            time.sleep(1.0)
        return fresh(params)

    monkeypatch.setattr(compiler, "_fresh", slowed)
    monkeypatch.setattr(so, "COMPILE_TIMEOUT_S", 0.3)
    start = time.monotonic()
    with pytest.raises(ValueError, match="did not compile within 0.3 s"):
        compiler.check(slow)
    with pytest.raises(ValueError, match="did not compile within"):  # known to be slow: refused at once
        compiler.check(slow)
    assert time.monotonic() - start < 0.9
    for _ in range(2):  # both builder threads busy for a second: a quick grammar queued behind them still passes
        compiler.build(slow)
    start = time.monotonic()
    compiler.check(StructuredOutputsParams(choice=["quick", "queued"]))
    assert time.monotonic() - start > 0.6  # it waited past its 0.3 s limit, none of it building

    monkeypatch.setattr(so, "COMPILE_TIMEOUT_S", 10.0)
    engine = llm.engine
    inputs = llm.inputs
    plain = inputs.make_request(
        "plain",
        inputs.process("Tell me"),
        SamplingParams(max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY),
    )
    monkeypatch.setattr(inputs, "check_params", lambda params, grammar=True: None)  # the front end let it through
    structured = inputs.make_request(
        "structured",
        inputs.process("Pick"),
        SamplingParams(max_tokens=4, structured_outputs=slow, output_kind=RequestOutputKind.FINAL_ONLY),
    )
    released = threading.Event()
    build = compiler.build

    def held_build(params, copies=1):  # the engine's build, started at once, finishes only when the test says so
        held = so.GrammarBuild()
        held.start()

        def finish():
            released.wait(30)
            held.future.set_result(build(params, copies).future.result())

        threading.Thread(target=finish, daemon=True).start()
        return held

    monkeypatch.setattr(compiler, "build", held_build)
    engine.add_request(structured)
    engine.add_request(plain)
    finished = {}
    while "plain" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "structured" not in finished and len(finished["plain"].outputs[0].token_ids) == 12
    released.set()
    while "structured" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["structured"].outputs[0].text in ("slow", "down")

    monkeypatch.setattr(so, "COMPILE_TIMEOUT_S", 0.2)  # a build past the engine's limit fails alone
    released.clear()
    engine.add_request(
        inputs.make_request(
            "late",
            inputs.process("Pick"),
            SamplingParams(max_tokens=4, structured_outputs=slow, output_kind=RequestOutputKind.FINAL_ONLY),
        )
    )
    time.sleep(0.3)
    with pytest.raises(Exception, match="did not compile within 0.2 s") as failure:
        engine.step()
    assert failure.value.request_ids == ["late"] and not engine.has_unfinished_requests()
    released.set()


@pytest.mark.parametrize("family", ["tiny-3b", "llava"])
def test_special_tokens_text_in_a_constraint_is_followed_or_refused_never_violated(tiny_dirs, tmp_path, family):
    """Every added token of the tiny vocabularies inside a regex, a choice and a JSON schema's const: the output
    satisfies the constraint, or the request fails saying the output cannot follow the grammar. `<tool_call>abc`
    once came back as `<tool_call>` and EOS, finish reason stop: the grammar silently broken."""
    from conftest import hf_tokenizer

    from fovea.engine.engine import StepFailed

    if family == "llava":
        from fovea.testing.tiny_llava import write_llava_checkpoint

        model_dir = write_llava_checkpoint(tmp_path / "llava", seed=3)
    else:
        model_dir = tiny_dirs[family]
    specials = sorted(hf_tokenizer(model_dir).get_added_vocab())
    llm = LLM(str(model_dir), max_model_len=256, dtype="float32")
    refused = followed = 0
    for token in specials:
        for spec in (
            StructuredOutputsParams(regex=re.escape(token) + "abc"),
            StructuredOutputsParams(choice=[token + "yes"]),
            StructuredOutputsParams(json={"type": "object", "properties": {"a": {"const": token}}, "required": ["a"]}),
        ):
            params = SamplingParams(max_tokens=24, temperature=0, structured_outputs=spec, skip_special_tokens=False)
            try:
                output = llm.generate("Say", params, use_tqdm=False)[0].outputs[0]
            except StepFailed as failure:
                assert "cannot follow the grammar" in str(failure), (token, spec)
                refused += 1
                continue
            text = output.text.removesuffix(llm.get_tokenizer().eos_token or "")
            if output.finish_reason == "stop":
                assert (
                    re.fullmatch(spec.regex, text)
                    if spec.regex
                    else text in spec.choice
                    if spec.choice
                    else json.loads(text) == {"a": token}
                ), (token, spec, output.text)
                followed += 1
    assert refused + followed > len(specials)  # most cases end one way or the other within 24 tokens


def tagged_parts_hold(text: str, trigger: str, begin: str, schema: dict, end: str) -> int:
    """Checks that every `trigger` in `text` opens `begin`, then compact JSON valid under `schema`, then `end`
    (the last part may be cut by the length limit); the number of complete parts."""
    complete, at = 0, text.find(trigger)
    while at >= 0:
        rest = text[at:]
        if len(rest) < len(begin):
            assert begin.startswith(rest), rest
            return complete
        assert rest.startswith(begin), rest
        body = rest[len(begin) :]
        try:
            value, used = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError:
            return complete  # cut inside the JSON
        jsonschema.validate(value, schema)
        assert body[:used] == json.dumps(value, separators=(",", ":")), body[:used]  # compact, as the json form
        after = body[used:]
        assert after.startswith(end) or end.startswith(after), after
        complete += after.startswith(end)
        next_at = text.find(trigger, len(text) - len(after) + len(end))
        at = next_at if after.startswith(end) else -1
    return complete


def test_structural_tags_hold_the_parts_their_triggers_open(tiny_dirs, client):
    """vLLM's structural_tag (structures + triggers, llguidance's tags): text runs free until a trigger, which
    opens its structure's begin, JSON held to the schema and end; offline, as response_format and as the older
    request field, the same greedy text."""
    llm = LLM(str(tiny_dirs["tiny-3b"]), max_model_len=512)
    messages = [{"role": "user", "content": "Give me the answer."}]
    greedy = llm.get_default_sampling_params().clone(temperature=0, max_tokens=40)  # what the server's requests get
    free = llm.chat(messages, greedy, use_tqdm=False)[0].outputs[0]
    trigger = llm.get_tokenizer().decode(free.token_ids[:2])  # where the model goes on its own
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"enum": [1, 2, 3]}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    begin, end = trigger + "<call>", "</call>"
    tag = {
        "structures": [{"begin": begin, "schema": schema, "end": end}, {"begin": "@none", "schema": {}, "end": "."}],
        "triggers": [trigger, "@none"],
    }
    spec = StructuredOutputsParams(structural_tag=tag)
    tagged = llm.chat(messages, greedy.clone(structured_outputs=spec), use_tqdm=False)[0].outputs[0].text
    assert free.text.startswith(trigger) and not free.text.startswith(begin)
    assert tagged.startswith(begin) and tagged_parts_hold(tagged, trigger, begin, schema, end) >= 1, tagged
    served = [
        chat(client, temperature=0, max_tokens=40, response_format={"type": "structural_tag", **tag})[0][0],
        chat(client, temperature=0, max_tokens=40, extra_body={"structured_outputs": {"structural_tag": tag}})[0][0],
        chat(client, temperature=0, max_tokens=40, extra_body={"structural_tag": json.dumps(tag)})[0][0],
    ]
    assert served == [tagged] * 3
    for broken, words in (
        ({**tag, "triggers": ["<other>"]}, "starts with none of the triggers"),
        ({"format": {"type": "any_text"}}, "the format form is not supported"),
        ({**tag, "structures": [{"begin": begin, "schema": [1], "end": end}]}, "must be a JSON schema"),
    ):
        with pytest.raises(openai.BadRequestError, match=words):
            chat(client, response_format={"type": "structural_tag", **broken})
