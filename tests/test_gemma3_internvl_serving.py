"""Gemma 3 and InternVL through the product: `fovea tiny` writes them, `fovea serve` answers a chat with an image (and
InternVL's with a video) as the offline LLM does and keeps to a JSON schema, `fovea bench serve` random-mm runs
against it, and `fovea plan` counts their images' tokens."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
from conftest import random_image, video_file
from serving import bench_random_mm, running_server
from test_llava_serving import data_url

from fovea import LLM, SamplingParams
from fovea.cli import build_parser

# per family: what `fovea tiny` writes, and a 200 x 90 image's tokens (Gemma 3: one fixed size, 4 tokens;
# InternVL: two tiles side by side and a thumbnail, 4 tokens each)
FAMILIES = {"gemma3": ("tiny-gemma3", 4), "internvl": ("tiny-internvl", 12)}


@pytest.mark.parametrize("family", FAMILIES)
def test_served_as_offline_with_schema_bench_and_plan(family, tmp_path, capsys):
    config, image_tokens = FAMILIES[family]
    model_dir = tmp_path / family
    args = build_parser().parse_args(["tiny", str(model_dir), "--config", config])
    args.func(args)
    image = random_image(200, 90, seed=3)
    content = [{"type": "text", "text": "What is in this picture?"}]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=1024)
    expected = llm.chat(
        [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, *content]}], greedy, use_tqdm=False
    )[0]
    image_token = llm.engine.config.model.image_token_id
    assert expected.prompt_token_ids.count(image_token) == image_tokens
    clip = np.stack([np.asarray(random_image(80, 60, seed=i)) for i in range(5)])
    video_chat = [{"role": "user", "content": [{"type": "video", "video": clip}, *content]}]
    expected_video = llm.chat(video_chat, greedy, use_tqdm=False)[0] if family == "internvl" else None
    del llm

    with running_server(model_dir, "--dtype", "float32", "--max-model-len", "1024", "--served-model-name", "m") as (
        base,
        _,
    ):
        messages = [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}}, *content]}
        ]
        body = {"model": "m", "temperature": 0, "max_tokens": 6, "ignore_eos": True, "messages": messages}
        reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()
        assert reply["choices"][0]["message"]["content"] == expected.outputs[0].text
        assert reply["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
        if expected_video is not None:  # InternVL: a video's frames decoded in the workers, each an image
            url = "data:video/x-matroska;base64," + base64.b64encode(video_file(clip, 6)).decode()
            video = {"type": "video_url", "video_url": {"url": url}}
            for _ in range(2):  # the second from the processor's and the prefix caches
                reply = httpx.post(
                    base + "/v1/chat/completions",
                    json={**body, "messages": [{"role": "user", "content": [video, *content]}]},
                    timeout=120,
                ).json()
                assert reply["choices"][0]["message"]["content"] == expected_video.outputs[0].text
                assert reply["usage"]["prompt_tokens"] == len(expected_video.prompt_token_ids)
        schema = {
            "type": "object",
            "properties": {"n": {"type": "integer"}},
            "required": ["n"],
            "additionalProperties": False,
        }
        structured = {
            **body,
            "max_tokens": 40,
            "ignore_eos": False,
            "response_format": {"type": "json_schema", "json_schema": {"name": "count", "schema": schema}},
        }
        reply = httpx.post(base + "/v1/chat/completions", json=structured, timeout=120).json()
        answer = reply["choices"][0]
        if answer["finish_reason"] == "stop":  # random weights may run out of tokens inside the number
            assert set(json.loads(answer["message"]["content"])) == {"n"}
        assert answer["message"]["content"].startswith('{"n":') or answer["message"]["content"].startswith('{ "n"')
        result = bench_random_mm(base, model_dir, "m", 200, 90)
    assert result["completed"] == 4 and result["failed"] == 0 and result["total_output_tokens"] == 16
    assert result["total_input_tokens"] >= 4 * (image_tokens + 16)
    capsys.readouterr()
    args = build_parser().parse_args(["plan", str(model_dir), "--gpu-memory", "80"])
    args.func(args)
    rows = {line.split()[0]: int(line.split()[1]) for line in capsys.readouterr().out.splitlines() if "x" in line[:5]}
    largest = {"gemma3": 4, "internvl": 20}[family]  # 448 x 448: InternVL's 2 x 2 tiles and the thumbnail
    assert rows["448x448"] == largest and rows["1280x720"] == (4 if family == "gemma3" else 12)
