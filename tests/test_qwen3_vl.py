"""Qwen3-VL (dense) pieces against transformers on a tiny checkpoint that transformers itself wrote
(fovea/testing/tiny_qwen3_vl.py): the config as fovea reads it, interleaved M-RoPE and the image patches. Logits
and the engine's greedy tokens (learned positions resampled to each grid, DeepStack, q/k norms) are checked with
the other families in test_families.py; videos in test_qwen3_vl_video.py."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernel case runs under the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
from conftest import hf_inputs, random_image

from fovea.config.model import ModelConfig
from fovea.layers.rotary import mrope
from fovea.multimodal.patchify import patchify
from fovea.multimodal.prompt import PromptProcessor
from fovea.testing.tiny_qwen3_vl import write_qwen3_vl_checkpoint


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return write_qwen3_vl_checkpoint(tmp_path_factory.mktemp("qwen3-vl"), seed=7)


def test_config_as_fovea_reads_it(qwen3_dir):
    config = ModelConfig.from_dir(qwen3_dir)
    assert config.architecture == "Qwen3VLForConditionalGeneration"
    assert config.text.qk_norm and config.text.mrope_interleaved and not config.text.attention_bias
    assert config.text.mrope_section == (2, 3, 3) and config.text.rope_theta == 5000000.0
    assert config.vision.deepstack_indexes == (0, 2) and config.vision.output_width == 3 * 64
    assert config.vision.patch_bias and config.vision.num_position_embeddings == 64
    assert config.image.patch_size == 16 and config.image.image_mean == (0.5, 0.5, 0.5)
    assert config.video_token_id == 151656 and config.video.timestamps  # video_preprocessor_config.json's rule
    assert (config.video.shortest_edge, config.video.longest_edge) == (4096, 25165824)


def test_interleaved_mrope_matches_transformers(qwen3_dir):
    """Each frequency reads the axis transformers' rotary embedding gives it: positions differing per axis."""
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    text = Qwen3VLConfig.from_pretrained(str(qwen3_dir)).text_config
    positions = torch.stack([torch.arange(10), 100 + torch.arange(10) * 3, 1000 + torch.arange(10) * 7])
    ref_cos, ref_sin = Qwen3VLTextRotaryEmbedding(text)(torch.zeros(1, dtype=torch.float32), positions[:, None])
    cos, sin = mrope(16, 5000000.0, (2, 3, 3), interleaved=True).cos_sin(positions)
    assert torch.allclose(cos, ref_cos[0], atol=1e-6) and torch.allclose(sin, ref_sin[0], atol=1e-6)
    plain_cos, _ = mrope(16, 5000000.0, (2, 3, 3)).cos_sin(positions)
    assert not torch.allclose(plain_cos, ref_cos[0], atol=1e-3)  # the chunked rule differs: the test can fail


@pytest.mark.parametrize("size", [(500, 375), (200, 333), (97, 1000)])
def test_pixels_equal_transformers(qwen3_dir, size):
    """16-pixel patches, mean and std 0.5: our patches are transformers' first frame (a still image is sent once
    and meets the conv's two temporal halves summed)."""
    config = ModelConfig.from_dir(qwen3_dir)
    image = random_image(*size, seed=sum(size))
    processed = PromptProcessor(qwen3_dir, config).image_processor(image)
    ours = patchify(torch.from_numpy(processed.pixels), config.image)
    reference = hf_inputs(qwen3_dir, [{"role": "user", "content": [{"type": "image"}]}], [image])
    assert list(reference["image_grid_thw"][0]) == list(processed.grid_thw)
    first_frame = reference["pixel_values"].view(-1, 3, 2, 16 * 16)[:, :, 0]
    assert torch.allclose(ours.view(-1, 3, 16 * 16), first_frame, atol=1e-6)


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "triton"])
def test_padded_bucket_gives_the_unpadded_embeddings(qwen3_dir, kernel):
    """Fillers in an encoder bucket get learned positions of their own grid and their own attention segment: the
    real images' embeddings and DeepStack features do not change."""
    from fovea.models.base import ModelOptions
    from fovea.models.loader import load_model
    from fovea.runner.encoder_buckets import EncoderBuckets

    device = torch.device("cuda" if kernel and torch.cuda.is_available() else "cpu")
    model, _ = load_model(qwen3_dir, dtype="float32", device=device, options=ModelOptions(vision_kernel=kernel))
    processor = PromptProcessor(qwen3_dir, model.config).image_processor
    images = [processor(random_image(w, h, seed=i)) for i, (w, h) in enumerate([(96, 64), (128, 96), (64, 64)])]
    pixels = torch.cat([patchify(torch.from_numpy(im.pixels), model.config.image) for im in images]).to(device)
    grids = [im.grid_thw for im in images]
    expected = model.visual(pixels, grids)
    assert expected.shape == (pixels.shape[0] // 4, 3 * 64)
    buckets = EncoderBuckets(model.visual, [256], torch.float32, device, capture=False)
    torch.testing.assert_close(buckets.encode(pixels, grids, 256), expected, rtol=1e-4, atol=1e-5)


def test_moe_config_and_the_released_expert_layout(tmp_path):
    """Experts in every layer but mlp_only_layers; the released checkpoints (transformers 4) store the experts'
    matrices transposed against what transformers 5 writes: both load to the same weights."""
    from safetensors.torch import load_file, save_file

    from fovea.models.loader import load_model

    saved = write_qwen3_vl_checkpoint(tmp_path / "t5", "tiny-qwen3-vl-moe", seed=3)
    moe = ModelConfig.from_dir(saved).text.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.sparse_layers) == (6, 2, 24, (0, 2))
    assert not moe.hub_layout
    hub = tmp_path / "hub"
    hub.mkdir()
    for file in saved.iterdir():
        if file.name == "model.safetensors":
            weights = load_file(file)
            save_file({k: v.transpose(1, 2).contiguous() if ".experts." in k else v for k, v in weights.items()},
                      hub / file.name, metadata={"format": "pt"})  # fmt: skip
        elif file.name == "config.json":
            config = json.loads(file.read_text())
            (hub / file.name).write_text(json.dumps({**config, "transformers_version": "4.57.0.dev0"}))
        else:
            (hub / file.name).write_bytes(file.read_bytes())
    assert ModelConfig.from_dir(hub).text.moe.hub_layout
    ours, theirs = load_model(saved, dtype="float32")[0], load_model(hub, dtype="float32")[0]
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
    assert ours.model.layers[0].mlp.experts.gate_up_proj.shape == (6, 48, 64)


MOE_CASES = [("cpu", torch.float32, 1e-5), ("cpu", torch.bfloat16, 2e-2)]
if torch.cuda.is_available():  # the native grouped kernel
    MOE_CASES.append(("cuda", torch.bfloat16, 2e-2))


@pytest.mark.parametrize("gpt_oss", [False, True], ids=["qwen", "gpt-oss"])
@pytest.mark.parametrize("device, dtype, tolerance", MOE_CASES)
def test_grouped_experts_give_the_loops_outputs_without_reading_the_device(
    device, dtype, tolerance, gpt_oss, monkeypatch
):
    """The experts as two grouped products equal the loop over the chosen experts (transformers' order) for
    batches where some experts get no token, one token or all of them; and they never read the device: on a GPU
    a read would make the host wait for each MoE layer and stop a CUDA graph from recording the step. GPT-OSS's
    experts: with biases and a clamped SwiGLU."""
    from fovea.config.model import MoEConfig
    from fovea.layers import moe

    cfg = MoEConfig(num_experts=8, top_k=2, intermediate_size=48, sparse_layers=(0,))
    if gpt_oss:
        cfg = dataclasses.replace(cfg, router_bias=True, expert_bias=True, interleaved=True, swiglu=(1.702, 0.3))
    layer = moe.SparseMoE(64, cfg)
    assert layer.experts.grouped  # the installed torch has it: the grouped path is what runs here
    assert not moe.SparseMoE(64, dataclasses.replace(cfg, intermediate_size=50)).experts.grouped  # rows unaligned
    generator = torch.Generator().manual_seed(0)
    for param in layer.parameters():
        param.data = torch.randn(param.shape, generator=generator) * 0.2
    layer = layer.to(device, dtype)
    for num_tokens in (1, 2, 5, 40):
        x = torch.randn(num_tokens, 64, generator=generator).to(device, dtype)
        weights, chosen = torch.softmax(layer.gate(x), dim=-1, dtype=torch.float).topk(cfg.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
        expected = layer.experts.per_expert(x, chosen, weights)
        with monkeypatch.context() as patched:
            if device == "cpu":
                for name in ("tolist", "item", "nonzero", "unique", "__bool__", "__int__"):
                    patched.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(f"{_n}: a device read"))
            else:
                torch.cuda.set_sync_debug_mode("error")
            try:
                got = layer.experts(x, chosen, weights)
            finally:
                if device != "cpu":
                    torch.cuda.set_sync_debug_mode("default")
        torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TOOLS_TURN = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    'signatures within <tools></tools> XML tags:\n<tools>\n{"type": "function", "function": {"name": "get_weather", '
    '"parameters": {"type": "object"}}}\n</tools>\n\nFor each function call, return a json object with function name '
    'and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
)


@pytest.mark.parametrize(
    "messages, kwargs, expected",
    [
        (  # no default system turn (Qwen2.5-VL's template adds one)
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
            {},
            "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
            "<|im_start|>assistant\n",
        ),
        (  # the system text first in the tools turn; a call after the answer's text; results in one user turn
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "Checking.",
                    "tool_calls": [
                        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                    ],
                },
                {"role": "tool", "content": "21 C"},
                {"role": "tool", "content": [{"type": "text", "text": "map: "}, {"type": "image"}]},
            ],
            {"tools": [WEATHER]},
            "<|im_start|>system\nBe brief.\n\n" + TOOLS_TURN + "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
            '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\nmap: "
            "<|vision_start|><|image_pad|><|vision_end|>\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Same?"}]}],
            {"add_vision_id": True, "add_generation_prompt": False},
            "<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>Video 1: <|vision_start|>"
            "<|video_pad|><|vision_end|>Same?<|im_end|>\n",
        ),
    ],
)
def test_the_tiny_checkpoint_carries_qwen3_vls_chat_format(qwen3_dir, messages, kwargs, expected):
    """The tokenizer's template renders the released Qwen3-VL-8B-Instruct template's text (the expected strings
    are that template's renderings of these conversations)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_dir))
    kwargs = {"add_generation_prompt": True, **kwargs}
    assert tokenizer.apply_chat_template(messages, tokenize=False, **kwargs) == expected
