"""Prompt processing (chat template, placeholders, tokenizer ids) and M-RoPE positions."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from conftest import jpeg_bytes, our_model, random_image

from fovea.models.mrope_positions import VisionSpan, decode_positions, mrope_positions
from fovea.testing.tiny import SPECIAL_TOKENS

IMG, VID = 151655, 151656


def test_special_token_ids_agree_between_tokenizer_and_config(tiny_dirs):
    for model_dir in tiny_dirs.values():
        _, processor = our_model(model_dir)
        tok, cfg = processor.tokenizer, processor.config
        for text, token_id in SPECIAL_TOKENS.items():
            assert tok.convert_tokens_to_ids(text) == token_id
            assert tok.encode(text, add_special_tokens=False) == [token_id]
        assert (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == (
            tok.convert_tokens_to_ids("<|image_pad|>"),
            tok.convert_tokens_to_ids("<|video_pad|>"),
            tok.convert_tokens_to_ids("<|vision_start|>"),
            tok.convert_tokens_to_ids("<|vision_end|>"),
        )
        assert tok.eos_token == "<|im_end|>" and cfg.eos_token_ids == (151645,)
        assert tok.convert_tokens_to_ids("<think>") != 151667  # Qwen3-only additions are not in this vocabulary


def test_checkpoint_files_have_the_published_keys(tiny_dirs):
    d = tiny_dirs["tiny-7b"]
    cfg = json.loads((d / "config.json").read_text())
    published_keys = {
        "architectures",
        "attention_dropout",
        "bos_token_id",
        "eos_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "vision_token_id",
        "image_token_id",
        "video_token_id",
        "hidden_act",
        "hidden_size",
        "initializer_range",
        "intermediate_size",
        "max_position_embeddings",
        "max_window_layers",
        "model_type",
        "num_attention_heads",
        "num_hidden_layers",
        "num_key_value_heads",
        "rms_norm_eps",
        "rope_theta",
        "sliding_window",
        "tie_word_embeddings",
        "torch_dtype",
        "transformers_version",
        "use_cache",
        "use_sliding_window",
        "vision_config",
        "rope_scaling",
        "vocab_size",
    }
    assert set(cfg) == published_keys
    assert set(cfg["vision_config"]) >= {
        "depth",
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "in_chans",
        "out_hidden_size",
        "patch_size",
        "spatial_merge_size",
        "window_size",
        "fullatt_block_indexes",
        "tokens_per_second",
        "temporal_patch_size",
    }
    assert cfg["rope_scaling"]["type"] == "mrope"
    assert cfg["vision_config"]["depth"] >= 2 and cfg["vision_config"]["fullatt_block_indexes"]
    pre = json.loads((d / "preprocessor_config.json").read_text())
    assert (pre["min_pixels"], pre["max_pixels"], pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"]) == (
        3136,
        12845056,
        14,
        2,
        2,
    )
    assert pre["image_mean"] == [0.48145466, 0.4578275, 0.40821073]
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == [151645, 151643]
    assert (
        "<|vision_start|><|image_pad|><|vision_end|>"
        in json.loads((d / "tokenizer_config.json").read_text())["chat_template"]
    )


def test_chat_with_every_image_source(tiny_dirs, tmp_path):
    _, processor = our_model(tiny_dirs["tiny-3b"])
    image = random_image(100, 80, 1)
    data = jpeg_bytes(image)
    path = tmp_path / "a.jpg"
    path.write_bytes(data)
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    content = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "x"},
        {"type": "image_url", "image_url": f"file://{path}"},
        {"type": "image_pil", "image_pil": image},
    ]
    prompt = processor.process_chat([{"role": "user", "content": content}])
    assert len(prompt.images) == 3
    assert prompt.token_ids.count(IMG) == sum(im.num_tokens for im in prompt.images)
    assert prompt.token_ids.count(151652) == 3 and prompt.token_ids.count(151653) == 3
    text = processor.tokenizer.decode(prompt.token_ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith(
        "x<|vision_start|>"
        + "<|image_pad|>" * prompt.images[1].num_tokens
        + "<|vision_end|><|vision_start|>"
        + "<|image_pad|>" * prompt.images[2].num_tokens
        + "<|vision_end|><|im_end|>\n<|im_start|>assistant\n"
    )


def test_text_prompt_with_placeholders_and_token_id_prompts(tiny_dirs):
    _, processor = our_model(tiny_dirs["tiny-3b"])
    image = random_image(56, 56)
    text = "<|vision_start|><|image_pad|><|vision_end|>hello"
    prompt = processor.process(text, [image])
    assert prompt.token_ids[:6] == [151652, IMG, IMG, IMG, IMG, 151653]
    ids = processor.tokenizer.encode(text)
    assert processor.process(ids, [image]).token_ids == prompt.token_ids
    with pytest.raises(ValueError, match="1 image placeholders .* but 2 images"):
        processor.process(text, [image, image])
    with pytest.raises(ValueError, match="0 image placeholders"):
        processor.process("no placeholder", [image])


@pytest.mark.parametrize(
    "messages,match",
    [
        ([{"content": "hi"}], "needs a 'role'"),
        ([{"role": "user", "content": [{"type": "audio_url", "audio_url": "x"}]}], "unsupported content part"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "has no 'image_url'"),
        ([{"role": "user", "content": 42}], "must be a string or a list"),
    ],
)
def test_bad_chat_messages(tiny_dirs, messages, match):
    _, processor = our_model(tiny_dirs["tiny-3b"])
    with pytest.raises(ValueError, match=match):
        processor.process_chat(messages)


def test_positions_follow_the_facts_sheet():
    # 3 text tokens, an image with merged grid 2x3 (patch grid 4x6), 2 text tokens
    ids = [1, 2, 3] + [IMG] * 6 + [4, 5]
    pos, delta = mrope_positions(ids, [VisionSpan(IMG, (1, 4, 6))], spatial_merge_size=2)
    assert pos[:, :3].tolist() == [[0, 1, 2]] * 3
    assert pos[0, 3:9].tolist() == [3] * 6
    assert pos[1, 3:9].tolist() == [3, 3, 3, 4, 4, 4]
    assert pos[2, 3:9].tolist() == [3, 4, 5, 3, 4, 5]
    assert pos[:, 9:].tolist() == [[6, 7]] * 3  # one past the image's largest position
    assert delta == 8 - len(ids)
    assert decode_positions(len(ids), 2, delta).tolist() == [[8, 9]] * 3


def test_video_time_axis_is_scaled_by_seconds():
    # 4 temporal patches at 1 s per grid step, 2 tokens per second -> t index step 2
    ids = [7] + [VID] * (4 * 2 * 2) + [8]
    pos, delta = mrope_positions(ids, [VisionSpan(VID, (4, 4, 4), second_per_grid_t=1.0)], 2, tokens_per_second=2)
    assert sorted(set(pos[0, 1:17].tolist())) == [1, 3, 5, 7]
    assert pos[:, 17].tolist() == [8, 8, 8]
    assert delta == 9 - len(ids)
    half, _ = mrope_positions(ids, [VisionSpan(VID, (4, 4, 4), second_per_grid_t=0.25)], 2, tokens_per_second=2)
    assert sorted(set(half[0, 1:17].tolist())) == [1, 2]  # 0.5 per step, truncated


def test_positions_equal_transformers_get_rope_index(tiny_dirs):
    from conftest import hf_model

    hf = hf_model(tiny_dirs["tiny-7b"])
    grids = [(1, 4, 6), (1, 8, 2), (1, 2, 2)]
    ids = [5, 6] + [IMG] * 6 + [9] * 7 + [IMG] * 4 + [151653, 151652] + [IMG] * 1 + [3]
    spans = [VisionSpan(IMG, g) for g in grids]
    ours, delta = mrope_positions(ids, spans, 2)
    t = torch.tensor([ids])
    ref, ref_delta = hf.model.get_rope_index(t, mm_token_type_ids=(t == IMG).long(), image_grid_thw=torch.tensor(grids))
    assert np.array_equal(ours, ref[:, 0].numpy()) and delta == int(ref_delta)


def test_placeholder_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="needs 6 consecutive placeholder"):
        mrope_positions([1] + [IMG] * 5 + [2], [VisionSpan(IMG, (1, 4, 6))], 2)
    with pytest.raises(ValueError, match="fewer placeholder tokens"):
        mrope_positions([1, 2], [VisionSpan(IMG, (1, 2, 2))], 2)


def test_embedding_count_mismatch_is_an_error(tiny_dirs):
    model, _ = our_model(tiny_dirs["tiny-3b"])
    with pytest.raises(ValueError, match="4 image/video placeholder tokens but 0 vision embeddings"):
        model.embed(torch.tensor([1, IMG, IMG, IMG, IMG]))
