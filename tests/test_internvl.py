"""InternVL against transformers (fp32, tiny random checkpoints written by transformers itself): the tiles and
their pixels equal GotOcr2ImageProcessor's, a chat's prompt ids InternVLProcessor's, the logits transformers' for
text, one image and two images of odd sizes (InternViT-300M's tower and InternViT-6B's, Qwen3, Qwen3-MoE and Qwen2
decoders),
and the engine's greedy tokens transformers' generate while chunks cut through images, prefixes come from the cache,
sequences are preempted, and over two tensor-parallel ranks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_greedy_is_the_references, assert_same_tokens_and_logprobs, internvl_processor, random_image
from conftest import internvl_inputs as hf_inputs
from test_families import with_pil

from fovea.config.image import tile_grid
from fovea.config.model import ModelConfig
from fovea.models.loader import load_model
from fovea.multimodal.patchify import patchify
from fovea.testing.tiny_internvl import IMG_END, IMG_START, write_internvl_checkpoint

SIZES = [(130, 50), (61, 97), (56, 56), (400, 30), (200, 150)]  # width, height


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("internvl")
    return {
        "300m": write_internvl_checkpoint(root / "300m", seed=1),
        # the 6B tower's norms, a Qwen2 decoder whose head is its embeddings, the features of the tower's
        # next-to-last layer
        "6b": write_internvl_checkpoint(
            root / "6b", seed=2, tower="6b", decoder="qwen2", tie_word_embeddings=True, vision_feature_layer=-2
        ),
        "post-norm": write_internvl_checkpoint(root / "post", seed=3, tower="post-norm", max_patches=4),
        # InternVL3.5's MoE decoders: Qwen3-MoE's, each expert's matrices stored apart
        "moe": write_internvl_checkpoint(root / "moe", seed=4, decoder="qwen3_moe"),
        # InternVL3.5-GPT-OSS's: sinks, biased experts, alternating sliding layers
        "gpt-oss": write_internvl_checkpoint(root / "gpt-oss", seed=5, decoder="gpt_oss"),
    }


def chat(kind: str):
    if kind == "text":
        return [{"role": "user", "content": "Describe a harbour at night."}], []
    count = {"one_image": 1, "two_images": 2}[kind]
    images = [random_image(*SIZES[i], seed=i) for i in range(count)]
    content = [{"type": "image"}, {"type": "text", "text": "What is in the picture? Name each colour."}]
    content += [{"type": "image"}, {"type": "text", "text": "And here?"}] if count == 2 else []
    return [{"role": "user", "content": content}], images


@pytest.mark.parametrize("size", SIZES + [(1000, 999), (999, 1000), (10, 1990)])
def test_tile_grid_is_the_processors(size):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    width, height = size
    for low, high in ((1, 12), (1, 6), (2, 4), (1, 1)):
        assert tile_grid(height, width, 448, low, high) == get_optimal_tiled_canvas(
            (height, width), (448, 448), low, high
        )


@pytest.mark.parametrize("size", SIZES)
def test_tiles_equal_got_ocr2_image_processor(checkpoints, size):
    """The tiles (row by row) and the thumbnail, resized bicubic on uint8, rescaled and normalised: bit for bit."""
    from fovea.multimodal.image import ImageProcessor

    model_dir = checkpoints["300m"]
    config = ModelConfig.from_dir(model_dir).image
    image = random_image(*size, seed=sum(size))
    processed = ImageProcessor(config)(image)
    ref = internvl_processor(model_dir).image_processor(images=[image], crop_to_patches=True, return_tensors="pt")
    tiles = int(ref["num_patches"][0])
    assert processed.grid_thw == (tiles, 4, 4) and processed.num_tokens == 4 * tiles
    ours = patchify(torch.from_numpy(processed.pixels), config)  # each 2 x 2 patches of a token together
    theirs = ref["pixel_values"].reshape(tiles, 3, 2, 2, 14, 2, 2, 14).permute(0, 2, 5, 3, 6, 1, 4, 7)
    assert torch.equal(ours, theirs.reshape(tiles * 16, -1))


@pytest.mark.parametrize("kind", ["text", "one_image", "two_images"])
def test_chat_prompt_ids_are_the_processors(checkpoints, kind):
    from fovea.multimodal.prompt import PromptProcessor

    model_dir = checkpoints["300m"]
    messages, images = chat(kind)
    ours = PromptProcessor(model_dir, ModelConfig.from_dir(model_dir)).process_chat(with_pil(messages, images))
    assert ours.token_ids == hf_inputs(model_dir, messages, images)["input_ids"][0].tolist()
    assert ours.token_ids.count(IMG_START) == ours.token_ids.count(IMG_END) == len(images)


def logits_pair(model_dir, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import InternVLForConditionalGeneration

    from fovea.multimodal.prompt import PromptProcessor

    messages, images = chat(kind)
    inputs = hf_inputs(model_dir, messages, images)
    reference = InternVLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(**inputs).logits[0]
    model, _ = load_model(model_dir, dtype="float32")
    prompt = PromptProcessor(model_dir, model.config).process_chat(with_pil(messages, images))
    from fovea.attention.layer import AttentionMetadata

    with torch.no_grad():
        patches = [patchify(torch.from_numpy(image.pixels), model.config.image) for image in prompt.images]
        mm = model.encode_images(torch.cat(patches), [i.grid_thw for i in prompt.images]) if patches else []
        ids = torch.tensor(prompt.token_ids)
        meta = AttentionMetadata.from_lengths([len(ids)])
        hidden = model(ids, torch.arange(len(ids)).expand(3, -1), meta, torch.cat(mm) if mm else None)
        return model.compute_logits(hidden), theirs


@pytest.mark.parametrize(
    "checkpoint, kind",
    [
        ("300m", "text"),
        ("300m", "one_image"),
        ("300m", "two_images"),
        ("6b", "two_images"),
        ("post-norm", "one_image"),
        ("moe", "text"),
        ("moe", "two_images"),
        ("gpt-oss", "text"),
        ("gpt-oss", "two_images"),
    ],
)
def test_logits_match_transformers(checkpoints, checkpoint, kind):
    ours, theirs = logits_pair(checkpoints[checkpoint], kind)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-4 and torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_both_checkpoint_layouts_load_the_same_model(checkpoints, tmp_path):
    """What transformers 5.24 writes (the "-hf" names: `vision_tower.*`, `multi_modal_projector.*`,
    `language_model.model.*`, `language_model.lm_head.*`) and transformers 5's module names (`model.vision_tower.*`,
    `model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.*`)."""
    import shutil

    from safetensors.torch import load_file, save_file

    source = checkpoints["300m"]
    weights = load_file(str(source / "model.safetensors"))
    assert any(name.startswith("language_model.model.") for name in weights)

    def module_name(name: str) -> str:
        for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head.")):
            if name.startswith(old):
                return new + name.removeprefix(old)
        return "model." + name

    target = tmp_path / "modules"
    shutil.copytree(source, target)
    save_file({module_name(name): tensor for name, tensor in weights.items()}, str(target / "model.safetensors"))
    expected, _ = load_model(source, dtype="float32")
    model, _ = load_model(target, dtype="float32")
    mine, theirs = model.state_dict(), expected.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_config_read_as_transformers_reads_it():
    """InternVL3.5-8B's shapes (a Qwen3-8B decoder, InternViT-300M) from a sparse config.json, against
    transformers' reading of it; the tile's 1,024 patches make 256 tokens."""
    from transformers import InternVLConfig

    raw = {
        "architectures": ["InternVLForConditionalGeneration"],
        "text_config": {
            "model_type": "qwen3",
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 40960,
            "eos_token_id": 151645,
        },
        "vision_config": {"attention_bias": True, "hidden_size": 1024, "num_hidden_layers": 24},
        "tie_word_embeddings": False,
    }
    ours, theirs = ModelConfig.from_dict(raw), InternVLConfig(**raw)
    text, reference = ours.text, theirs.text_config
    assert (text.num_layers, text.hidden_size, text.num_heads, text.num_kv_heads, text.head_dim) == (
        reference.num_hidden_layers,
        reference.hidden_size,
        reference.num_attention_heads,
        reference.num_key_value_heads,
        reference.head_dim,
    )
    assert text.qk_norm and not text.attention_bias and text.rope_theta == 1e6 and not ours.tie_word_embeddings
    vision, tower = ours.vision, theirs.vision_config
    assert (vision.depth, vision.hidden_size, vision.num_heads, vision.image_size, vision.patch_size) == (
        tower.num_hidden_layers,
        tower.hidden_size,
        tower.num_attention_heads,
        *tower.image_size[:1],
        *tower.patch_size[:1],
    )
    assert vision.attention_bias and not vision.qk_norm and not vision.post_norm
    assert ours.image_token_id == theirs.image_token_id == 151667 and ours.eos_token_ids == (151645,)
    assert ours.image.tokens_per_image == theirs.image_seq_length == 256
    assert ours.image.max_tiles == 12 and ours.image.image_mean == (0.48145466, 0.4578275, 0.40821073)


@pytest.mark.parametrize("checkpoint", ["300m", "moe", "gpt-oss"])
def test_engine_greedy_matches_transformers(checkpoints, checkpoint):
    """Greedy tokens and their log-probabilities (within 1e-4) against transformers' generate: a budget of 16
    tokens (chunks end inside images of 16-28 tokens), prompts repeated (prefix cache), 10 blocks of 16 for six
    prompts (preemption)."""
    from transformers import InternVLForConditionalGeneration

    from fovea import LLM, SamplingParams

    model_dir = checkpoints[checkpoint]
    cases = [chat(kind) for kind in ("two_images", "one_image", "text", "two_images", "one_image", "text")]
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_num_batched_tokens=16,
        block_size=16,
        num_gpu_blocks_override=10,
        max_model_len=160,
        max_num_seqs=4,
        max_num_encoder_input_tokens=64,
        encoder_cache_size=256,
    )
    # the images encoded first (behind another prompt: no prefix in common), so that where chunks end, and whether
    # sequences preempt, does not depend on how fast the encoder's thread keeps up on a loaded machine
    warm_up = [([{"role": "system", "content": "Warm up."}, *m], i) for m, i in cases[:2]]
    llm.chat([with_pil(m, i) for m, i in warm_up], SamplingParams(max_tokens=1), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outputs = llm.chat([with_pil(m, i) for m, i in cases], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0 and sum(o.num_cached_tokens > 0 for o in outputs) >= 2
    reference = InternVLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert_greedy_is_the_references(reference, outputs, [hf_inputs(model_dir, m, i) for m, i in cases])


def test_tensor_parallel_gives_the_same_tokens(checkpoints):
    """Two ranks on the CPU (gloo): the decoder's and the tower's heads split, the projector split too: the
    single process's greedy tokens, log-probabilities within 1e-4. InternViT-6B's q/k norm over all heads needs
    the whole tower on a rank: the engine runs it so (mm_encoder_tp_mode data) unasked, and its tokens are the
    single process's. GPT-OSS's decoder: each rank its heads' sinks and its share of every expert's biases
    (the down projection's on one rank only, as the ranks' outputs are summed)."""
    from fovea import LLM, SamplingParams

    cases = [chat(kind) for kind in ("two_images", "one_image", "text")]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)

    def run(model_dir, **engine_args):
        llm = LLM(
            str(model_dir), dtype="float32", device="cpu", max_num_batched_tokens=32, max_model_len=160, **engine_args
        )
        try:
            outputs = llm.chat([with_pil(m, i) for m, i in cases], params, use_tqdm=False)
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
        finally:
            llm.close()

    for checkpoint in ("300m", "6b", "gpt-oss"):
        expected, got = run(checkpoints[checkpoint]), run(checkpoints[checkpoint], tensor_parallel_size=2)
        assert_same_tokens_and_logprobs(expected, got)


def test_tile_counts_per_request_are_the_processors(checkpoints):
    """mm_processor_kwargs max_patches (vLLM's max_dynamic_patch too) and min_patches: the prompt ids and tiles of
    transformers' processor given the same; a request cannot ask for more tiles than the server's setting (6)."""
    from fovea.multimodal.prompt import PromptProcessor

    model_dir = checkpoints["300m"]
    prompts = PromptProcessor(model_dir, ModelConfig.from_dir(model_dir))
    messages, images = chat("two_images")
    text = prompts.render_chat(with_pil(messages, images))[0]
    processor = internvl_processor(model_dir)
    for kwargs, theirs in (
        ({"max_patches": 2}, {"max_patches": 2}),
        ({"max_dynamic_patch": 3, "min_dynamic_patch": 2}, {"max_patches": 3, "min_patches": 2}),
        ({"max_patches": 1}, {"max_patches": 1}),
        ({"max_patches": 50}, {"max_patches": 6}),  # capped at the server's
    ):
        ours = prompts.process(text, images, kwargs)
        reference = processor(text=text, images=images, return_tensors="pt", **theirs)
        assert ours.token_ids == reference["input_ids"][0].tolist(), kwargs
        assert sum(image.grid_thw[0] for image in ours.images) == reference["pixel_values"].shape[0]
    with pytest.raises(ValueError, match="must be a positive integer"):
        prompts.process(text, images, {"max_patches": 0})
    with pytest.raises(ValueError, match="at most 64 tiles an image"):  # a server's own setting is bounded too
        ModelConfig.from_dir(model_dir).image.with_overrides({"max_dynamic_patch": 65})
    from fovea.config.image import ImageProcessorConfig

    with pytest.raises(ValueError, match="apply to models whose images are cut into tiles"):
        ImageProcessorConfig().with_overrides({"max_patches": 2})  # Qwen's


def test_embeddings_of_a_tiled_image_give_its_tokens(checkpoints):
    """`image_embeds` of all of an image's tiles (grid (tiles, 4, 4)) in place of the image: the same tokens and
    log-probabilities, the tower not run."""
    from fovea import LLM, SamplingParams
    from fovea.multimodal.prompt import PromptProcessor

    model_dir = checkpoints["300m"]
    model, _ = load_model(model_dir, dtype="float32")
    image = random_image(200, 90, seed=4)
    prompt = "<|im_start|>user\n<IMG_CONTEXT>\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"
    processed = PromptProcessor(model_dir, model.config).process(prompt, [image]).images[0]
    assert processed.grid_thw == (3, 4, 4)  # two tiles side by side and the thumbnail
    with torch.inference_mode():
        embeds = model.encode_images(patchify(torch.from_numpy(processed.pixels), model.config.image), [(3, 4, 4)])[0]
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256, enable_mm_embeds=True)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)
    as_image = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, params, use_tqdm=False)[0]
    given = {"image_embeds": embeds, "image_grid_thw": [3, 4, 4]}
    as_embeds = llm.generate({"prompt": prompt, "multi_modal_data": {"image": given}}, params, use_tqdm=False)[0]
    assert as_embeds.prompt_token_ids == as_image.prompt_token_ids
    assert as_embeds.outputs[0].token_ids == as_image.outputs[0].token_ids
    for mine, theirs in zip(as_embeds.outputs[0].logprobs, as_image.outputs[0].logprobs, strict=True):
        assert abs(next(iter(mine.values())).logprob - next(iter(theirs.values())).logprob) <= 1e-4


CAUSAL_LMS = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def original_upload(hf_dir, out):
    """The checkpoint as OpenGVLab uploads InternVL (InternVLChatModel: `llm_config`, InternViT's keys, the image
    settings in config.json, qkv fused, `vision_model.*` and `mlp1.*`): transformers' conversion, undone."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(
        hf_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "config.json", "*processor_config.json")
    )
    hf = json.loads((hf_dir / "config.json").read_text())
    tower = hf["vision_config"]
    config = {
        "architectures": ["InternVLChatModel"],
        "model_type": "internvl_chat",
        "llm_config": {**hf["text_config"], "architectures": [CAUSAL_LMS[hf["text_config"]["model_type"]]]},
        "vision_config": {
            "hidden_size": tower["hidden_size"],
            "num_hidden_layers": tower["num_hidden_layers"],
            "num_attention_heads": tower["num_attention_heads"],
            "intermediate_size": tower["intermediate_size"],
            "qkv_bias": tower["attention_bias"],
            "qk_normalization": tower["use_qk_norm"],
            "norm_type": tower["norm_type"],
            "layer_norm_eps": tower["layer_norm_eps"],
            "image_size": 56,
            "patch_size": 14,
            "hidden_act": "gelu",
        },
        "downsample_ratio": 0.5,
        "select_layer": -1,
        "ps_version": "v2",
        "dynamic_image_size": True,
        "max_dynamic_patch": 6,
        "min_dynamic_patch": 1,
        "use_thumbnail": True,
        "force_image_size": 56,
        "template": "internvl2_5",
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config))
    weights = load_file(str(hf_dir / "model.safetensors"))
    original = {}
    for name, tensor in weights.items():
        if name.startswith("vision_tower."):
            for new, old in [
                ("vision_tower.embeddings.cls_token", "vision_model.embeddings.class_embedding"),
                ("vision_tower.embeddings.patch_embeddings.projection.", "vision_model.embeddings.patch_embedding."),
                ("vision_tower.embeddings.position_embeddings", "vision_model.embeddings.position_embedding"),
                ("vision_tower.encoder.layer.", "vision_model.encoder.layers."),
                (".attention.projection_layer.", ".attn.proj."),
                (".layernorm_before.", ".norm1."),
                (".layernorm_after.", ".norm2."),
                (".lambda_1", ".ls1"),
                (".lambda_2", ".ls2"),
            ]:
                name = name.replace(new, old)
        name = name.replace("multi_modal_projector.layer_norm.", "mlp1.0.").replace(
            "multi_modal_projector.linear_1.", "mlp1.1."
        )
        original[name.replace("multi_modal_projector.linear_2.", "mlp1.3.")] = tensor
    for name in [n for n in original if ".attention.q_proj." in n]:  # q, k and v fused, in that order
        parts = [original.pop(name.replace(".q_proj.", f".{x}_proj.")) for x in "qkv"]
        original[name.replace(".attention.q_proj.", ".attn.qkv.")] = torch.cat(parts)
    save_file(original, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("checkpoint", ["300m", "moe", "gpt-oss"])
def test_internvls_own_uploads_are_the_same_model(checkpoints, tmp_path, checkpoint):
    """InternVL as OpenGVLab uploads it (InternVLChatModel) loads to the model transformers' conversion gives (every
    tensor equal), reads its image settings from config.json, and takes "<image>" (and "<video>") in a text prompt
    as vLLM does: the same prompt ids and greedy tokens."""
    from fovea import LLM, SamplingParams
    from fovea.multimodal.prompt import PromptProcessor

    source = checkpoints[checkpoint]
    original = original_upload(source, tmp_path / "original")
    ours, _ = load_model(original, dtype="float32")
    theirs, _ = load_model(source, dtype="float32")
    assert (
        ours.config.architecture == "InternVLChatModel" and ours.config.image_token_id == theirs.config.image_token_id
    )
    mine, reference = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == reference.keys() and all(torch.equal(mine[k], reference[k]) for k in mine)
    assert ours.config.image == theirs.config.image
    images = [random_image(*SIZES[0], seed=0), random_image(*SIZES[1], seed=1)]
    videos = [random_video(2, 50, 40, seed=5)]
    text = "<|im_start|>user\n<image>\nWhat is it?<video>\n<image>\nAnd this?<|im_end|>\n<|im_start|>assistant\n"
    prompt = PromptProcessor(original, ours.config).process(text, images, videos=videos)
    hf_text = text.replace("<image>", "<IMG_CONTEXT>")
    expected = PromptProcessor(source, theirs.config).process(hf_text, images, videos=videos)
    assert prompt.token_ids == expected.token_ids and len(prompt.images) == 4
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = [
        LLM(str(model_dir), dtype="float32", max_model_len=256).generate(
            {"prompt": written, "multi_modal_data": {"image": images, "video": videos}}, params, use_tqdm=False
        )[0]
        for model_dir, written in ((original, text), (source, hf_text))
    ]
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_quantization_named_in_an_own_uploads_llm_config_is_read():
    """OpenGVLab's uploads keep the language model's settings under `llm_config`, its quantization_config too:
    GPT-OSS's MXFP4 experts (the format openai/gpt-oss-20b ships in) are refused by name, not read as some other
    checkpoint's tensors."""
    from fovea.config.model import ModelConfig

    llm = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 48,
           "num_local_experts": 4, "vocab_size": 296}  # fmt: skip
    tower = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
             "image_size": 56, "patch_size": 14, "hidden_act": "gelu"}  # fmt: skip
    raw = {"architectures": ["InternVLChatModel"], "llm_config": llm, "vision_config": tower, "ps_version": "v2"}
    assert ModelConfig.from_dict(raw).text.attention_sinks
    llm["quantization_config"] = {"quant_method": "mxfp4"}
    with pytest.raises(ValueError, match="quantization 'mxfp4' is not supported"):
        ModelConfig.from_dict(raw)


def random_video(frames: int, width: int, height: int, seed: int) -> np.ndarray:
    return np.stack([np.asarray(random_image(width, height, seed=seed + i)) for i in range(frames)])


def video_chat():
    """An image, then two videos of three frames (transformers' processor batches videos of one length only):
    (messages, images, videos)."""
    content = [
        {"type": "image"},
        {"type": "text", "text": "First this picture."},
        {"type": "video"},
        {"type": "text", "text": "What happens in the video?"},
        {"type": "video"},
        {"type": "text", "text": "And in this one?"},
    ]
    videos = [random_video(3, 90, 70, seed=10), random_video(3, 40, 120, seed=20)]
    return [{"role": "user", "content": content}], [random_image(*SIZES[0], seed=0)], videos


def with_media(messages, images, videos):
    """The chat as LLM.chat takes it: PIL images and (frames, height, width, 3) arrays in their parts."""
    it = iter(videos)
    return [
        {**m, "content": [{"type": "video", "video": next(it)} if p["type"] == "video" else p for p in m["content"]]}
        for m in with_pil(messages, images)
    ]


@pytest.mark.parametrize("checkpoint", ["300m", "gpt-oss"])
def test_videos_are_transformers_frames(checkpoints, checkpoint):
    """A video is its frames, each one tile: "Frame1: <img>...</img>\\nFrame2: ..." in place of the template's
    <video> (transformers' InternVLProcessor, frames resized as InternVL's published code does), among an image:
    the same prompt ids, greedy tokens and log-probabilities as transformers' generate. Each frame is an image
    of its own to the engine: chunks end inside frames (a budget of 16), a repeated prompt finds its frames in the
    prefix cache."""
    from transformers import InternVLForConditionalGeneration

    from fovea import LLM, SamplingParams

    model_dir = checkpoints[checkpoint]
    messages, images, videos = video_chat()
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=16, block_size=16, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    outputs = [llm.chat(with_media(messages, images, videos), params, use_tqdm=False)[0] for _ in range(2)]
    assert outputs[1].num_cached_tokens >= 64
    inputs = hf_inputs(model_dir, messages, images, videos)
    reference = InternVLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert_greedy_is_the_references(reference, outputs, [inputs, inputs])
    assert outputs[0].prompt_token_ids.count(IMG_START) == 7


def transformers_sample_frames():
    """transformers' InternVLVideoProcessor.sample_frames, read from its file: the module imports torchvision,
    which this machine lacks, and the method needs torch only."""
    import ast
    import inspect
    from types import SimpleNamespace

    import transformers

    path = Path(inspect.getfile(transformers)).parent / "models/internvl/video_processing_internvl.py"
    tree = ast.parse(path.read_text())
    method = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "sample_frames")
    method.decorator_list, method.args.args[1].annotation = [], None
    scope = {"torch": torch, "VideoMetadata": object}
    exec(compile(ast.Module([method], []), str(path), "exec"), scope)
    owner = SimpleNamespace(num_frames=None, initial_shift=True)

    def sample(total, fps, num_frames=None, target_fps=None):
        metadata = SimpleNamespace(total_num_frames=total, fps=fps)
        return scope["sample_frames"](owner, metadata, num_frames=num_frames, fps=target_fps).tolist()

    return sample


@pytest.mark.parametrize("total", [1, 2, 7, 31, 32, 33, 100, 257, 1000, 4801])
def test_frames_kept_from_a_file_are_transformers_sample_frames(total):
    from fovea.config.video import TiledVideoOptions

    sample = transformers_sample_frames()
    for count in (1, 2, 5, 8, 32, 64):
        if count <= total:
            assert TiledVideoOptions(max_frames=count).frame_indices(total, 30.0) == sample(total, 30.0, count)
    for fps, rate in ((30.0, 1.0), (24.0, 0.5), (2.0, 2.0)):
        if 1 <= int(total / fps * rate) <= 32:  # (transformers refuses more than there are; ours keep at most 32)
            assert TiledVideoOptions(fps=rate).frame_indices(total, fps) == sample(total, fps, target_fps=rate)
    assert len(TiledVideoOptions().frame_indices(total, 30.0)) == min(total, 32)


def test_a_video_file_gives_the_frames_it_keeps(checkpoints):
    """An encoded video (lossless, 40 frames): the 32 frames kept by the rule above, or max_frames per request,
    each one tile: the same pixels as those frames handed over in memory."""
    from conftest import video_file

    from fovea.multimodal.prompt import PromptProcessor

    model_dir = checkpoints["300m"]
    prompts = PromptProcessor(model_dir, ModelConfig.from_dir(model_dir))
    frames = random_video(40, 64, 48, seed=3)
    text = "<|im_start|>user\n<video>\nWhat happens?<|im_end|>\n<|im_start|>assistant\n"
    for kwargs, kept in ((None, 32), ({"max_frames": 5}, 5), ({"max_frames": 500}, 32), ({"fps": 2.0}, 8)):
        options = prompts.video_options.with_kwargs(kwargs, capped=True)
        indices = options.frame_indices(40, 10.0)
        assert len(indices) == kept
        from_file = prompts.process(text, videos=[video_file(frames, fps=10)], mm_processor_kwargs=kwargs)
        in_memory = prompts.process(text, videos=[frames[indices]])
        assert from_file.token_ids == in_memory.token_ids and len(from_file.images) == kept
        assert all(np.array_equal(a.pixels, b.pixels) for a, b in zip(from_file.images, in_memory.images))
        assert f"Frame{kept}: " in prompts.tokenizer.decode(from_file.token_ids)


def test_video_prompts_that_cannot_be_served_are_refused(checkpoints):
    from fovea.multimodal.image_workers import LocalDecoder
    from fovea.multimodal.prompt import PromptProcessor

    model_dir = checkpoints["300m"]
    prompts = PromptProcessor(model_dir, ModelConfig.from_dir(model_dir))
    video = random_video(2, 32, 32, seed=1)
    with pytest.raises(ValueError, match="prompt has 0 video placeholders"):
        prompts.process("<|im_start|>user\nNo video here.<|im_end|>\n", videos=[video])
    with pytest.raises(ValueError, match="prompt has 2 video placeholders .* but 1 videos"):
        prompts.process("<video>\n<video>\nBoth?", videos=[video])
    with pytest.raises(ValueError, match="takes videos in a text prompt only"):
        prompts.process([1, 2, 3], videos=[video])
    with pytest.raises(ValueError, match="max_frames"):
        prompts.process("<video>", videos=[video], mm_processor_kwargs={"max_frames": 0})
    for prompt, videos in (("<video>", [video]), ("No media.", [])):  # names are refused whatever is shown
        with pytest.raises(ValueError, match=r"unsupported mm_processor_kwargs \['num_frames'\]"):
            prompts.process(prompt, videos=videos, mm_processor_kwargs={"num_frames": 3})

    class NoDecoding(LocalDecoder):
        def process(self, planned):
            raise AssertionError("a prompt too long was decoded")

    refusing = PromptProcessor(model_dir, prompts.config, decoder=NoDecoding())
    with pytest.raises(ValueError, match=r"prompt \(length 502\) is longer than the maximum model length of 100"):
        refusing.process("<video>", videos=[random_video(40, 32, 32, seed=2)], max_tokens=100)  # 32 frames kept
