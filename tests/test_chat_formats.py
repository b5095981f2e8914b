"""Chat templates of either content shape (a string, or OpenAI's list of parts), as vLLM reads them; a
--chat-template that names no file and is no template stops the server."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import random_image
from serving import running_server

from fovea import LLM, SamplingParams
from fovea.multimodal.chat_format import detect_content_format

# vLLM's examples/template_llava.jinja style: content added to strings (written here, not copied)
STRING_LLAVA = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'USER: ' + message['content'] + '\\n' }}{% else %}{{ 'ASSISTANT: ' + message['content'] + "
    "eos_token + '\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}"
    "{% endif %}"
)


@pytest.mark.parametrize(
    "template, expected",
    [
        (STRING_LLAVA, "string"),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}", "openai"),
        ("{% for m in messages %}{% for part in m.content | list %}{{ part.type }}{% endfor %}{% endfor %}", "openai"),
        ("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p }}{% endfor %}{% endfor %}", "openai"),
        ("{% for m in messages %}{{ m['content'] ", "string"),  # does not parse: rendering says what is wrong
    ],
)
def test_content_format_is_read_off_the_template(template, expected):
    assert detect_content_format(template) == expected


def test_shipped_templates_iterate_over_parts(tiny_dirs):
    import fovea.models
    from fovea.multimodal.prompt import find_chat_template, load_tokenizer

    shipped = Path(fovea.models.__file__).parent / "llava_chat_template.jinja"
    assert detect_content_format(shipped.read_text()) == "openai"
    assert (
        detect_content_format(find_chat_template(tiny_dirs["tiny-3b"], load_tokenizer(tiny_dirs["tiny-3b"])))
        == "openai"
    )


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    from fovea.testing.tiny_llava import write_llava_checkpoint

    return write_llava_checkpoint(tmp_path_factory.mktemp("llava"), seed=5, chat_template=False)


def test_a_string_template_gets_placeholders_and_text(llava_dir, tmp_path):
    image = random_image(200, 150, seed=2)
    question = [
        {
            "role": "user",
            "content": [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "What is this?"}],
        }
    ]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(llava_dir), dtype="float32", max_model_len=2048)
    tokenizer = llm.get_tokenizer()
    out = llm.chat(question, greedy, use_tqdm=False, chat_template=STRING_LLAVA)[0]
    expected = tokenizer.encode("<s>USER: <image>\nWhat is this?\nASSISTANT:", add_special_tokens=False)
    image_id = llm.engine.config.model.image_token_id
    at = expected.index(image_id)
    assert out.prompt_token_ids == expected[:at] + [image_id] * 576 + expected[at + 1 :]
    with pytest.raises(ValueError, match="the chat template failed on these messages: TypeError"):
        llm.chat(question, greedy, use_tqdm=False, chat_template=STRING_LLAVA, chat_template_content_format="openai")
    del llm

    template_file = tmp_path / "template_llava.jinja"
    template_file.write_text(STRING_LLAVA)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = {
        "model": "llava",
        "temperature": 0,
        "max_tokens": 4,
        "ignore_eos": True,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
    }
    for content_format, status in (("auto", 200), ("openai", 400)):
        with running_server(
            llava_dir,
            "--dtype",
            "float32",
            "--max-model-len",
            "2048",
            "--served-model-name",
            "llava",
            "--chat-template",
            str(template_file),
            "--chat-template-content-format",
            content_format,
        ) as (base, _):
            reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
            assert reply.status_code == status, reply.text
            if status == 200:
                assert reply.json()["choices"][0]["message"]["content"] == out.outputs[0].text
                assert reply.json()["usage"]["prompt_tokens"] == len(out.prompt_token_ids)
            else:  # a template error is the request's: 400, and the server goes on
                assert "TypeError" in reply.json()["error"]["message"]
                assert (
                    httpx.post(
                        base + "/v1/completions", json={"model": "llava", "prompt": "hi", "max_tokens": 2}, timeout=60
                    ).status_code
                    == 200
                )


def test_a_chat_template_that_names_no_file_stops_the_server(llava_dir):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fovea.cli",
            "serve",
            str(llava_dir),
            "--port",
            "0",
            "--chat-template",
            "examples/template_llava.jinja",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "--chat-template 'examples/template_llava.jinja' names no file" in done.stderr


def test_the_content_format_cache_keeps_digests_not_templates():
    """Four 2 MB templates once kept 311 MB in an lru_cache keyed by the template itself."""
    from fovea.multimodal import chat_format

    for i in range(4):
        template = "{% for m in messages %}{{ m['content'] }}{% endfor %}" + " " * (2 << 20) + str(i)
        assert chat_format.detect_content_format(template) == "string"
    assert all(isinstance(key, bytes) and len(key) == 16 for key in chat_format._FORMATS)
    assert sum(len(value) for value in chat_format._FORMATS.values()) < 1000
