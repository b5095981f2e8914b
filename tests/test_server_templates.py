"""Chat templates sent by clients run only with --trust-request-chat-template, in worker processes bounded in
time, memory and output; the chat template options of a request are honoured."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from serving import running_server

HELLO = [{"role": "user", "content": "hello"}]
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
EATS_MEMORY = "{% set s = 'x' * 100000 %}{% for i in range(100000) %}{{ s }}{% endfor %}"  # 10 GB of output
WRITES_TOO_MUCH = "{{ 'x' * 5000000 }}"  # 5 MB: fits the memory cap, not 1024 tokens x 128 characters
PLAIN = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def server(tiny_dirs):
    with running_server(
        tiny_dirs["tiny-3b"],
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--num-gpu-blocks-override",
        "200",
        "--trust-request-chat-template",
        "--default-chat-template-kwargs",
        '{"greeting": "Ahoy "}',
        "--exclude-tools-when-tool-choice-none",
    ) as (base, proc):
        yield base
    assert proc.returncode == 0, proc.output


def chat(base: str, **fields) -> httpx.Response:
    return httpx.post(
        base + "/v1/chat/completions", timeout=60, json={"messages": HELLO, "max_tokens": 2, "temperature": 0, **fields}
    )


def test_client_templates_are_bounded(server, tiny_dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dirs["tiny-3b"]))
    cases = [
        ("{{ raise_exception('no system role here') }}", "no system role here"),
        (LOOPS, "did not finish within"),
        (EATS_MEMORY, "more memory than allowed"),
        (WRITES_TOO_MUCH, "more than the"),
    ]
    for template, message in cases:
        start = time.monotonic()
        reply = chat(server, chat_template=template)
        assert reply.status_code == 400 and message in reply.json()["error"]["message"], reply.text
        assert time.monotonic() - start < 10, template  # the worker's limit (2 s) bounds every case
    # reading a template's syntax is running it too: an expression 5,000 deep recurses past Python's stack in
    # the parser (in a worker: a 400, while the server answers others at once; 0.15 s here, where 30,000 deep took
    # 0.9 s and, on a loaded machine, past the worker's 2 s); 2 MB of it is refused unread
    deep, huge = "{{ " + "a+" * 5000 + "a }}", "{{ " + "a+" * 1000000 + "a }}"
    for template, message in ((deep, "RecursionError"), (huge, "at most 65536 characters")):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            sent = pool.submit(chat, server, chat_template=template)
            health = [httpx.get(server + "/health").elapsed.total_seconds() for _ in range(5)]
            reply = sent.result()
        assert reply.status_code == 400 and message in reply.json()["error"]["message"], reply.text[:300]
        assert max(health) < 0.5, health
    # the workers that overran are replaced; a plain template and the server's own still work
    deadline = time.monotonic() + 60
    while (reply := chat(server, chat_template=PLAIN)).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == len(tokenizer.encode("hello"))
    assert chat(server).status_code == 200


def test_add_generation_prompt_is_honoured(server, tiny_dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dirs["tiny-3b"]))
    for flag in (True, False):
        expected = tokenizer.apply_chat_template(HELLO, add_generation_prompt=flag, tokenize=False)
        reply = chat(server, add_generation_prompt=flag).json()
        assert reply["usage"]["prompt_tokens"] == len(tokenizer.encode(expected)), flag


def test_documents_reach_the_template_as_transformers_passes_them(server, tiny_dirs):
    """vLLM's `documents` (retrieval-augmented templates): the prompt is transformers' apply_chat_template with
    the same documents, in the sandboxed workers and with the model's own template (which ignores them)."""
    from conftest import hf_tokenizer

    tokenizer = hf_tokenizer(tiny_dirs["tiny-3b"])
    documents = [{"title": "Tides", "text": "High water at six."}, {"title": "Gulls", "text": "Loud at dawn."}]
    template = "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}" + PLAIN
    for given in (template, None):
        expected = tokenizer.apply_chat_template(
            HELLO, chat_template=given, documents=documents, tokenize=False, add_generation_prompt=True
        )
        fields = {"documents": documents, "return_token_ids": True} | ({"chat_template": given} if given else {})
        reply = chat(server, **fields)
        assert reply.status_code == 200, reply.text
        assert reply.json()["prompt_token_ids"] == tokenizer.encode(expected, add_special_tokens=False)
    assert "[Tides: High water at six.][Gulls: Loud at dawn.]hello" == tokenizer.apply_chat_template(
        HELLO, chat_template=template, documents=documents, tokenize=False
    )  # the check above sees the documents
    refused = chat(server, documents=[{"title": ["not text"]}])
    assert refused.status_code == 400 and "documents" in refused.json()["error"]["message"], refused.text


def test_server_template_variables_and_tools_under_tool_choice_none(server, tiny_dirs):
    """--default-chat-template-kwargs: every request's template sees them, under its own chat_template_kwargs;
    --exclude-tools-when-tool-choice-none: a request's tools reach the template unless tool_choice is "none"."""
    from conftest import hf_tokenizer

    tokenizer = hf_tokenizer(tiny_dirs["tiny-3b"])
    template = "{{ greeting | default('') }}{% if tools %}[tools]{% endif %}" + PLAIN
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

    def prompt(**fields) -> str:
        reply = chat(server, chat_template=template, return_token_ids=True, **fields)
        assert reply.status_code == 200, reply.text
        return tokenizer.decode(reply.json()["prompt_token_ids"])

    assert prompt() == "Ahoy hello"
    assert prompt(chat_template_kwargs={"greeting": "Hi "}) == "Hi hello"
    assert prompt(tools=tools, tool_choice="none") == "Ahoy hello"
    assert prompt(tools=tools, tool_choice="required") == "Ahoy [tools]hello"
