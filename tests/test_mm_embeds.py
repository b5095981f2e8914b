"""Images given as the vision tower's output (--enable-mm-embeds, vLLM's image_embeds): the engine skips the tower,
and embeddings from our own tower give the image's tokens; shapes that do not fit the model are refused by name."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from conftest import our_model, random_image

from fovea import LLM, SamplingParams
from fovea.multimodal.patchify import patchify
from fovea.multimodal.prompt import PromptProcessor

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def tower_output(model_dir, image):
    """Our own tower's embeddings of `image` (DeepStack features included) and its grid."""
    model, prompts = our_model(model_dir)
    processed = prompts.process(IMAGE + "x", [image]).images[0]
    patches = patchify(torch.from_numpy(processed.pixels), model.config.image)
    with torch.inference_mode():
        embeds = model.encode_images(patches, [processed.grid_thw])[0]
    return embeds, list(processed.grid_thw)


def b64(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from fovea.testing.tiny_qwen3_vl import write_qwen3_vl_checkpoint

    return write_qwen3_vl_checkpoint(tmp_path_factory.mktemp("qwen3-embeds"), seed=3)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_embeddings_from_our_tower_give_the_images_tokens(tiny_dirs, qwen3_dir, family):
    model_dir = tiny_dirs["tiny-3b"] if family == "qwen2.5-vl" else qwen3_dir
    image = random_image(224, 168, seed=9)
    embeds, grid = tower_output(model_dir, image)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=512, enable_mm_embeds=True)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    prompt = IMAGE + "Describe it."
    as_image = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, params, use_tqdm=False)[0]
    towers = []  # the vision tower's runs from here on
    encode = llm.engine.runner.model.encode_images
    llm.engine.runner.model.encode_images = lambda pixels, grids: towers.append(grids) or encode(pixels, grids)
    given = {"image_embeds": embeds, "image_grid_thw": grid}
    as_embeds = llm.generate({"prompt": prompt, "multi_modal_data": {"image": given}}, params, use_tqdm=False)[0]
    assert towers == []  # the embeddings went to the encoder cache as they were
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "image_embeds", "image_embeds": {"image_embeds": b64(embeds), "image_grid_thw": grid}},
                {"type": "text", "text": "Describe it."},
            ],
        }
    ]
    as_part = llm.chat(chat, params, use_tqdm=False)[0]
    image_chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, chat[0]["content"][1]]}]
    as_image_chat = llm.chat(image_chat, params, use_tqdm=False)[0]
    assert as_embeds.prompt_token_ids == as_image.prompt_token_ids
    assert as_embeds.outputs[0].token_ids == as_image.outputs[0].token_ids
    assert as_part.outputs[0].token_ids == as_image_chat.outputs[0].token_ids
    for a, b in zip(as_embeds.outputs[0].logprobs, as_image.outputs[0].logprobs, strict=True):
        assert abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob) < 1e-4


def test_shapes_that_do_not_fit_and_a_closed_door_are_named(tiny_dirs):
    model_dir = tiny_dirs["tiny-3b"]
    embeds, grid = tower_output(model_dir, random_image(112, 112, seed=2))  # 4 x 4 merged tokens of 64 values
    config = our_model(model_dir)[0].config
    prompts = PromptProcessor(model_dir, config, accept_embeds=True)
    for given, words in [
        ({"image_embeds": embeds[:-1], "image_grid_thw": grid}, r"shape \(15, 64\) do not fit .* 16 tokens of 64"),
        ({"image_embeds": embeds[:, :32], "image_grid_thw": grid}, r"shape \(16, 32\)"),
        ({"image_embeds": embeds, "image_grid_thw": [2, 8, 8]}, r"must be \(1, h, w\)"),
        ({"image_embeds": embeds, "image_grid_thw": [1, 7, 8]}, "multiples of 2"),
        ({"image_embeds": embeds}, "need an image_grid_thw"),
        ({"image_embeds": "not base64!", "image_grid_thw": grid}, "not a base64 torch.save of a tensor"),
        ({"image_embeds": b64(torch.zeros(2)) + "=", "image_grid_thw": grid}, "not a base64 torch.save"),
        ({"image_embeds": embeds * float("nan"), "image_grid_thw": grid}, "not finite"),
        ({"image_embeds": embeds, "image_grid_thw": grid, "pixels": 1}, "not \\['pixels'\\]"),
    ]:
        with pytest.raises(ValueError, match=words):
            prompts.process(IMAGE + "x", [given])
    closed = PromptProcessor(model_dir, config)
    with pytest.raises(ValueError, match="--enable-mm-embeds"):
        closed.process(IMAGE + "x", [{"image_embeds": embeds, "image_grid_thw": grid}])


def test_tensors_that_claim_more_than_they_hold_are_refused_before_they_cost_memory(tiny_dirs):
    """A 2 KB torch.save of an expanded (stride 0) tensor on a grid of 8 million patches, a 16384 x 16384 int8
    tensor, a zero-stride grid of a billion entries, sparse and meta tensors: each is a short ValueError, and none
    makes the process allocate what it claims (its peak resident memory grows by less than 100 MB)."""
    import resource

    model_dir = tiny_dirs["tiny-3b"]
    config = our_model(model_dir)[0].config
    prompts = PromptProcessor(model_dir, config, accept_embeds=True)
    width = config.vision.output_width
    huge_grid = [1, 2, 8388608]
    expanded = torch.zeros(1, width).expand(huge_grid[1] * huge_grid[2] // 4, width)
    cases = [
        ({"image_embeds": b64(expanded), "image_grid_thw": huge_grid}, "dense tensor"),
        ({"image_embeds": b64(torch.zeros(16384, 16384, dtype=torch.int8)), "image_grid_thw": [1, 8, 8]}, "must hold"),
        (
            {
                "image_embeds": b64(torch.zeros(16, width)),
                "image_grid_thw": b64(torch.ones(1, dtype=torch.long).expand(10**9)),
            },
            "three",
        ),
        ({"image_embeds": b64(torch.zeros(16, width).to_sparse()), "image_grid_thw": [1, 8, 8]}, "dense tensor"),
        ({"image_embeds": b64(torch.zeros(16, width, device="meta")), "image_grid_thw": [1, 8, 8]}, "dense tensor"),
        ({"image_embeds": b64(torch.zeros(16, width)), "image_grid_thw": [1, 8, 8.5]}, "three integers"),
    ]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for given, words in cases:
        with pytest.raises(ValueError, match=words) as refused:
            prompts.process(IMAGE + "x", [given])
        assert len(str(refused.value)) < 200
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000 + 16384 * 16384 // 1024  # kB


def test_the_same_values_on_two_grids_are_two_inputs(tiny_dirs):
    """The encoder and prefix caches name embeddings by their values, grid and shape: the same 16 rows given as a
    4 x 4 and as a 2 x 8 grid of merged patches place their tokens differently (M-RoPE), so they share nothing."""
    model_dir = tiny_dirs["tiny-3b"]
    config = our_model(model_dir)[0].config
    prompts = PromptProcessor(model_dir, config, accept_embeds=True)
    rows = torch.randn(16, config.vision.output_width)
    square, wide = (
        prompts.process(IMAGE + "x", [{"image_embeds": rows, "image_grid_thw": grid}]).images[0]
        for grid in ([1, 8, 8], [1, 4, 16])
    )
    assert square.content_hash != wide.content_hash
