"""LLaVA-1.5 through the product: `fovea serve` with a --chat-template file and the seed's flags, `fovea bench
serve` random-mm with one 336x336 image per request, `fovea eval` in process, and the offline LLM."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from conftest import random_image
from serving import bench_random_mm, running_server
from test_eval import make_image_folder
from transformers import AutoTokenizer

from fovea import LLM, SamplingParams

TEMPLATE = "fovea/models/llava_chat_template.jinja"
SEED_FLAGS = ["--max-model-len", "4096", "--max-num-seqs", "32", "--max-num-batched-tokens", "1024"]


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    from fovea.testing.tiny_llava import write_llava_checkpoint

    # no template in the checkpoint, as in older llava-hf uploads: the server needs --chat-template
    return write_llava_checkpoint(tmp_path_factory.mktemp("llava"), seed=5, chat_template=False)


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_llava_serve_with_template_file_and_bench(llava_dir, tmp_path):
    image = random_image(400, 300, seed=8)
    question = [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "What is in this picture?"}]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(llava_dir), dtype="float32", max_model_len=2048)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": question}], greedy, use_tqdm=False)
    template = open(TEMPLATE).read()
    expected = llm.chat([{"role": "user", "content": question}], greedy, use_tqdm=False, chat_template=template)[0]
    assert expected.prompt_token_ids.count(llm.engine.config.model.image_token_id) == 576
    plain = llm.generate(["The cat sat on the"], greedy, use_tqdm=False)[0]
    tokenizer = AutoTokenizer.from_pretrained(str(llava_dir))
    assert plain.prompt_token_ids == tokenizer.encode("The cat sat on the") and plain.prompt_token_ids[0] == 1  # BOS
    del llm

    with running_server(
        llava_dir, "--dtype", "float32", "--chat-template", TEMPLATE, *SEED_FLAGS, "--served-model-name", "llava"
    ) as (base, _):
        body = {
            "model": "llava",
            "temperature": 0,
            "max_tokens": 6,
            "ignore_eos": True,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url(image)}},
                        {"type": "text", "text": "What is in this picture?"},
                    ],
                }
            ],
        }
        reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()
        assert reply["choices"][0]["message"]["content"] == expected.outputs[0].text
        assert reply["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
        video = {
            **body,
            "messages": [
                {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}
            ],
        }
        refused = httpx.post(base + "/v1/chat/completions", json=video, timeout=60)
        assert refused.status_code == 400 and "takes no videos" in refused.json()["error"]["message"]
        completion = httpx.post(
            base + "/v1/completions",
            json={
                "model": "llava",
                "prompt": "The cat sat on the",
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=60,
        ).json()
        assert completion["choices"][0]["text"] == plain.outputs[0].text
        assert completion["usage"]["prompt_tokens"] == len(plain.prompt_token_ids)
        for special in (True, False):  # /tokenize adds what the installed tokenizer adds (BOS); /detokenize undoes it
            counted = httpx.post(
                base + "/tokenize",
                json={"model": "llava", "prompt": "The cat sat on the", "add_special_tokens": special},
                timeout=30,
            ).json()
            assert counted["tokens"] == tokenizer.encode("The cat sat on the", add_special_tokens=special)
            assert counted["tokens"][0] == 1 if special else counted["tokens"][0] != 1
            text = httpx.post(
                base + "/detokenize", json={"model": "llava", "tokens": counted["tokens"]}, timeout=30
            ).json()["prompt"]
            assert text == tokenizer.decode(counted["tokens"]) and text.endswith("The cat sat on the")
        result = bench_random_mm(base, llava_dir, "llava", 336, 336)
    assert result["completed"] == 4 and result["failed"] == 0 and result["total_output_tokens"] == 16
    assert result["total_input_tokens"] >= 4 * (576 + 16)  # each prompt: its text, the template, 576 image tokens


def test_llava_eval_in_process(tmp_path):
    from fovea.eval.backends import InProcessBackend
    from fovea.eval.registry import MODELS, ModelEntry
    from fovea.eval.runner import evaluate
    from fovea.eval.tasks import Task
    from fovea.testing.tiny_llava import write_llava_checkpoint

    model_dir = write_llava_checkpoint(tmp_path / "llava", seed=6)  # with its template
    make_image_folder(tmp_path / "data", {"no": 2, "yes": 2})
    task = Task("t", {"type": "image_folder", "path": str(tmp_path / "data")}, "Is there a tumour?", ["no", "yes"])
    entry = ModelEntry("tiny-llava", str(model_dir), max_tokens=4)
    results = evaluate(InProcessBackend(entry, dtype="float32", max_model_len=2048), task, entry, tmp_path / "out")
    run = results["runs"][0]
    assert run["num_samples"] == 4 and sum(map(sum, run["confusion_matrix"])) + run["num_missing"] == 4
    assert (
        MODELS["llava-1.5-7b"].path == "llava-hf/llava-1.5-7b-hf"
        and "mm_processor_kwargs" not in MODELS["llava-1.5-7b"].llm_kwargs()
    )
