"""Gemma 3's model against transformers' (fp32, tiny random checkpoints written by transformers itself): the same
logits over text longer than the sliding window, one image and two images, with images whose tokens outnumber
the window (a sliding layer's image token then sees its image's later tokens, not its earliest ones). The engine
serves it: a chat's prompt ids are transformers' processor's, and its greedy tokens transformers' while chunks
stop before images, prefixes come from the cache and sequences are preempted."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_greedy_is_the_references, assert_same_tokens_and_logprobs, random_image

from fovea.attention.layer import AttentionMetadata
from fovea.config.engine import EngineConfig
from fovea.config.model import ModelConfig
from fovea.models.loader import load_model
from fovea.multimodal.patchify import patchify
from fovea.testing.tiny_gemma3 import BOI, EOI, IMAGE, write_gemma3_checkpoint

WINDOW = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    return {  # 4 x 4 patches pooled 2 x 2: 4 tokens an image; 8 x 8 patches pooled 2 x 2: 16, twice the window
        "small": write_gemma3_checkpoint(root / "small", seed=1, rope_scaling={"rope_type": "linear", "factor": 8.0}),
        "large_images": write_gemma3_checkpoint(root / "large", seed=2, image_size=112, tokens_per_image=16),
    }


def prompt(kind: str, tokens_per_image: int) -> list[int]:
    text = [2] + [(7 * i + 3) % 290 + 5 for i in range(23)]  # <bos> and 23 words: three windows of text
    image = [BOI] + [IMAGE] * tokens_per_image + [EOI]
    images = {"text": 0, "one_image": 1, "two_images": 2}[kind]
    ids = text[:12] + image + text[12:] if images else text
    return ids + (image + [11, 12, 13] if images == 2 else [])


def image_spans(ids: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for position, token in enumerate(ids + [-1]):
        if token == IMAGE and start is None:
            start = position
        elif token != IMAGE and start is not None:
            spans.append((start, position))
            start = None
    return spans


def logits_pair(model_dir, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import Gemma3ForConditionalGeneration

    reference = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    side, per_image = reference.config.vision_config.image_size, reference.config.mm_tokens_per_image
    ids = prompt(kind, per_image)
    count = len(image_spans(ids))
    pixels = torch.randint(
        0, 256, (count, side, side, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)
    )
    inputs = {"input_ids": torch.tensor([ids]), "token_type_ids": torch.tensor([[int(t == IMAGE) for t in ids]])}
    if count:  # rescaled and normalised as Gemma3ImageProcessor does (mean and std 0.5)
        inputs["pixel_values"] = ((pixels.float() / 255 - 0.5) / 0.5).permute(0, 3, 1, 2)
    with torch.no_grad():
        theirs = reference(**inputs).logits[0]
    ours_model, _ = load_model(model_dir, dtype="float32")
    image = ours_model.config.image
    grid = (1, side // 14, side // 14)
    with torch.no_grad():
        mm = [ours_model.encode_images(patchify(p, image), [grid])[0] for p in pixels]
        meta = AttentionMetadata.from_lengths([len(ids)], bidirectional_spans={0: image_spans(ids)})
        positions = torch.arange(len(ids)).expand(3, -1)
        hidden = ours_model(torch.tensor(ids), positions, meta, torch.cat(mm) if mm else None)
        ours = ours_model.compute_logits(hidden)
    return ours, theirs


@pytest.mark.parametrize(
    "checkpoint, kind",
    [("small", "text"), ("small", "one_image"), ("small", "two_images"), ("large_images", "two_images")],
)
def test_logits_match_transformers(checkpoints, checkpoint, kind):
    ours, theirs = logits_pair(checkpoints[checkpoint], kind)
    assert (ours - theirs).abs().max().item() <= 1e-4 and torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_both_checkpoint_layouts_load_the_same_model(checkpoints, tmp_path):
    """What transformers writes (`language_model.model.*`, `vision_tower.*`), the published files' tower names
    (`vision_tower.vision_model.*`) and transformers 5's module names (`model.language_model.*`, ...)."""
    import shutil

    from safetensors.torch import load_file, save_file

    source = checkpoints["small"]
    weights = load_file(str(source / "model.safetensors"))
    modules = {  # transformers 5's module names
        "language_model.model.": "model.language_model.",
        "vision_tower.": "model.vision_tower.",
        "multi_modal_projector.": "model.multi_modal_projector.",
    }

    def module_name(name: str) -> str:
        prefix = next(p for p in modules if name.startswith(p))
        return modules[prefix] + name.removeprefix(prefix)

    renamings = {
        "published": lambda name: name.replace("vision_tower.", "vision_tower.vision_model.", 1),
        "modules": module_name,
    }
    expected, _ = load_model(source, dtype="float32")
    for layout, rename in renamings.items():
        target = tmp_path / layout
        shutil.copytree(source, target)
        save_file({rename(name): tensor for name, tensor in weights.items()}, str(target / "model.safetensors"))
        model, _ = load_model(target, dtype="float32")
        mine, theirs = model.state_dict(), expected.state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), layout


def test_config_read_as_transformers_reads_it():
    """A published-style sparse config.json (the rest left to transformers' defaults) read by both."""
    from transformers import Gemma3Config

    from fovea.config.model import ModelConfig

    raw = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "eos_token_id": [1, 106],
        "mm_tokens_per_image": 256,
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {
            "hidden_size": 1152,
            "image_size": 896,
            "intermediate_size": 4304,
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "patch_size": 14,
            "vision_use_head": False,
        },
    }
    ours, theirs = ModelConfig.from_dict(raw), Gemma3Config(**raw)
    text, reference = ours.text, theirs.text_config
    sliding = tuple(i for i, kind in enumerate(reference.layer_types) if kind == "sliding_attention")
    assert text.sliding_layers == sliding and len(sliding) == 34 - 5  # every sixth layer sees everything
    assert (text.num_layers, text.hidden_size, text.num_heads, text.num_kv_heads, text.head_dim) == (
        reference.num_hidden_layers,
        reference.hidden_size,
        reference.num_attention_heads,
        reference.num_key_value_heads,
        reference.head_dim,
    )
    full, local = reference.rope_parameters["full_attention"], reference.rope_parameters["sliding_attention"]
    assert (text.rope_theta, text.rope_scaling.kind, text.rope_scaling.factor, text.local_rope_theta) == (
        full["rope_theta"],
        full["rope_type"],
        full["factor"],
        local["rope_theta"],
    )
    assert text.sliding_window == reference.sliding_window and text.vocab_size == reference.vocab_size
    assert text.attention_scale == reference.query_pre_attn_scalar**-0.5 and text.hidden_act == "gelu_pytorch_tanh"
    assert ours.image_token_id == theirs.image_token_id and ours.eos_token_ids == (1, 106)
    vision = ours.vision
    side = theirs.vision_config.image_size // theirs.vision_config.patch_size
    assert side**2 // vision.spatial_merge_size**2 == theirs.mm_tokens_per_image == 256
    assert (vision.depth, vision.hidden_size, vision.num_heads) == (27, 1152, 16)


@pytest.mark.parametrize("size", [(640, 480), (333, 517), (112, 112), (90, 200)])
def test_pixels_equal_gemma3_image_processor(checkpoints, size):
    """Every image stretched to the tower's size (bilinear on uint8), rescaled and normalised: bit for bit."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from fovea.config.model import ModelConfig
    from fovea.multimodal.image import ImageProcessor

    model_dir = checkpoints["large_images"]
    config = ModelConfig.from_dir(model_dir).image
    image = random_image(*size, seed=sum(size))
    processed = ImageProcessor(config)(image)
    assert processed.grid_thw == (1, 8, 8) and processed.num_tokens == 16
    ours = patchify(torch.from_numpy(processed.pixels), config)  # each 2 x 2 patches of a token together
    ref = Gemma3ImageProcessorPil.from_pretrained(str(model_dir))(images=[image], return_tensors="pt")["pixel_values"]
    ref = ref[0].reshape(3, 4, 2, 14, 4, 2, 14).permute(1, 4, 2, 5, 0, 3, 6).reshape(64, -1)
    assert torch.equal(ours, ref)


def chat(kind: str):
    text = {"type": "text", "text": "What is in the picture? Name each colour."}
    if kind == "text":
        return [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Describe a harbour."},
        ], []
    count = {"one_image": 1, "two_images": 2}[kind]
    images = [random_image(120 + 37 * i, 90 + 11 * i, seed=i) for i in range(count)]
    content = [{"type": "image"} for _ in images] + [text]
    return [{"role": "user", "content": content}], images


def hf_inputs(model_dir, messages, images):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(model_dir))
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return processor(text=text, images=images or None, return_tensors="pt", add_special_tokens=False)


def with_pil(messages, images):
    it = iter(images)
    return [
        {
            **m,
            "content": [
                {"type": "image_pil", "image_pil": next(it)} if p["type"] == "image" else p for p in m["content"]
            ],
        }
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]


@pytest.mark.parametrize("kind", ["text", "one_image", "two_images"])
def test_chat_prompt_ids_are_the_processors(checkpoints, kind):
    from fovea.multimodal.prompt import PromptProcessor

    model_dir = checkpoints["large_images"]
    messages, images = chat(kind)
    ours = PromptProcessor(model_dir, ModelConfig.from_dir(model_dir)).process_chat(with_pil(messages, images))
    theirs = hf_inputs(model_dir, messages, images)
    assert ours.token_ids == theirs["input_ids"][0].tolist()
    assert [t == IMAGE for t in ours.token_ids] == theirs["token_type_ids"][0].bool().tolist()


def test_engine_greedy_matches_transformers(checkpoints):
    """Greedy tokens and their log-probabilities (within 1e-4) against transformers' generate. A budget of 24
    tokens with the images encoded: without the rule that a chunk holds an image whole, two chunks of these
    prompts end inside an image (its first tokens then miss the rest: log-probabilities off by 1e-3); prompts
    repeated (prefix cache); 12 blocks of 16 for six prompts (preemption)."""
    from transformers import Gemma3ForConditionalGeneration

    from fovea import LLM, SamplingParams

    model_dir = checkpoints["large_images"]
    cases = [chat(kind) for kind in ("two_images", "one_image", "text", "two_images", "one_image", "text")]
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_num_batched_tokens=24,
        block_size=16,
        num_gpu_blocks_override=12,
        max_model_len=160,
        max_num_seqs=4,
        max_num_encoder_input_tokens=256,
        encoder_cache_size=512,
    )
    # the images encoded first (behind another prompt: no prefix in common), so that where chunks end does not
    # depend on how fast the encoder's thread keeps up
    warm_up = [([{"role": "system", "content": "Warm up."}, *m], i) for m, i in cases[:2]]
    llm.chat([with_pil(m, i) for m, i in warm_up], SamplingParams(max_tokens=1), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outputs = llm.chat([with_pil(m, i) for m, i in cases], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0 and sum(o.num_cached_tokens > 0 for o in outputs) >= 2
    reference = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert_greedy_is_the_references(reference, outputs, [hf_inputs(model_dir, m, i) for m, i in cases])


def test_a_budget_smaller_than_an_image_is_refused(checkpoints):
    with pytest.raises(ValueError, match="must hold one image's 16 tokens"):
        EngineConfig.from_args(str(checkpoints["large_images"]), dtype="float32", max_num_batched_tokens=8)


def test_auto_attention_is_the_kernels_that_have_its_features(checkpoints):
    """Gemma 3 needs sliding windows and two-way image spans: `auto` picks our Triton kernels on a GPU (they have
    both), the reference elsewhere."""
    import dataclasses

    from fovea.attention import features_needed, make_backend
    from fovea.attention.triton_paged import TritonAttention

    config = EngineConfig.from_args(str(checkpoints["small"]), dtype="float32", device="cpu")
    assert config.resolved_attention_backend == "torch"
    assert dataclasses.replace(config, device=torch.device("cuda")).resolved_attention_backend == "triton"
    model, _ = load_model(checkpoints["small"], dtype="float32")
    assert features_needed(model) == ("sliding_window", "bidirectional_spans")
    assert isinstance(make_backend("triton", 2, False, torch.device("cpu"), features_needed(model)), TritonAttention)


def test_engine_on_the_triton_kernels_gives_the_references_tokens(checkpoints):
    """The whole engine on our Triton kernels (under Triton's interpreter here): chunks stop before images whose
    tokens outnumber the sliding window, prefixes come from the cache, sequences are preempted, and decode steps
    see only their window: the reference backend's greedy tokens, log-probabilities within 1e-4."""
    from fovea import LLM, SamplingParams

    model_dir = checkpoints["large_images"]
    cases = [chat(kind) for kind in ("two_images", "one_image", "text", "two_images")]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(model_dir),
            dtype="float32",
            attention_backend=backend,
            max_num_batched_tokens=24,
            block_size=16,
            num_gpu_blocks_override=12,
            max_model_len=160,
            max_num_seqs=3,
        )
        outputs = llm.chat([with_pil(m, i) for m, i in cases], params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0 and sum(o.num_cached_tokens > 0 for o in outputs) >= 1
        runs[backend] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    assert_same_tokens_and_logprobs(runs["torch"], runs["triton"])


def test_tensor_parallel_gives_the_same_tokens(checkpoints):
    """Two ranks on the CPU (gloo): the decoder's 4 query and 2 KV heads and the tower's 2 heads split, the
    projector and the norms replicated: the single process's greedy tokens, log-probabilities within 1e-4."""
    from fovea import LLM, SamplingParams

    model_dir = checkpoints["large_images"]
    cases = [chat(kind) for kind in ("two_images", "one_image", "text")]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)

    def run(**engine_args):
        llm = LLM(
            str(model_dir), dtype="float32", device="cpu", max_num_batched_tokens=24, max_model_len=160, **engine_args
        )
        try:
            outputs = llm.chat([with_pil(m, i) for m, i in cases], params, use_tqdm=False)
            ranks = llm.engine.runner.parallel.size if llm.engine.runner.parallel else 1
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], ranks
        finally:
            llm.close()

    (expected, one), (got, two) = run(), run(tensor_parallel_size=2)
    assert (one, two) == (1, 2)
    assert_same_tokens_and_logprobs(expected, got)


PAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 40, "pan_and_scan_max_num_crops": 3}


@pytest.mark.parametrize("size", [(640, 480), (300, 90), (90, 300), (200, 150), (121, 100), (1000, 30), (81, 80)])
@pytest.mark.parametrize("settings", [(256, 4, 1.2), (40, 3, 1.2), (30, 8, 2.0)])
def test_pan_and_scan_crops_are_the_processors(size, settings):
    import numpy as np
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from fovea.config.image import ImageProcessorConfig

    width, height = size
    min_crop, max_crops, ratio = settings
    config = ImageProcessorConfig.fixed_size({}, 14, 56, 2).with_overrides(
        {
            "do_pan_and_scan": True,
            "pan_and_scan_min_crop_size": min_crop,
            "pan_and_scan_max_num_crops": max_crops,
            "pan_and_scan_min_ratio_to_activate": ratio,
        }  # fmt: skip
    )
    pixels = np.arange(height * width).reshape(1, height, width)  # each value names its place
    theirs = Gemma3ImageProcessorPil().pan_and_scan(pixels, min_crop, max_crops, ratio)
    ours = [pixels[:, top:bottom, left:right] for left, top, right, bottom in config.pan_crops(height, width)]
    assert len(ours) == len(theirs) and all(np.array_equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("kwargs", [PAN, {**PAN, "pan_and_scan_max_num_crops": 2}, {"do_pan_and_scan": False}])
def test_pan_and_scan_prompt_and_pixels_are_the_processors(checkpoints, kwargs):
    """A wide and a tall image with pan-and-scan asked for per request: the processor's words around the crops,
    its prompt ids, and each crop's pixels bit for bit."""
    from transformers import AutoProcessor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from fovea.multimodal.prompt import PromptProcessor

    model_dir = checkpoints["small"]
    images = [random_image(300, 90, seed=1), random_image(70, 200, seed=2)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Both?"}]}]
    prompts = PromptProcessor(model_dir, ModelConfig.from_dir(model_dir))
    text = prompts.render_chat(with_pil(messages, images))[0]
    ours = prompts.process(text, images, kwargs)
    # the PIL image processor: where torchvision is installed, AutoProcessor picks its resize, which rounds
    # differently from PIL (one level in 255 on some pixels)
    pil = Gemma3ImageProcessorPil.from_pretrained(str(model_dir))
    processor = AutoProcessor.from_pretrained(str(model_dir), image_processor=pil)
    theirs = processor(text=text, images=images, return_tensors="pt", add_special_tokens=False, **kwargs)
    assert ours.token_ids == theirs["input_ids"][0].tolist()
    crops = theirs["pixel_values"].shape[0] - 2  # the images, then each one's crops
    assert len(ours.images) == 2 + crops and (crops > 0) == kwargs["do_pan_and_scan"]
    patches = torch.stack(
        [patchify(torch.from_numpy(image.pixels), ModelConfig.from_dir(model_dir).image) for image in ours.images]
    )
    reference = theirs["pixel_values"].reshape(-1, 3, 2, 2, 14, 2, 2, 14).permute(0, 2, 5, 3, 6, 1, 4, 7)
    assert torch.equal(patches, reference.reshape(patches.shape))


def test_engine_with_pan_and_scan_matches_transformers(checkpoints):
    """The server's setting (mm_processor_kwargs at start): every image's crops are images of their own, each
    seeing itself both ways; greedy tokens and log-probabilities against transformers' generate."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    from fovea import LLM, SamplingParams

    model_dir = checkpoints["small"]
    images = [random_image(300, 90, seed=1), random_image(70, 200, seed=2)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    llm = LLM(str(model_dir), dtype="float32", max_model_len=400, max_num_batched_tokens=32, mm_processor_kwargs=PAN)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outputs = llm.chat([with_pil(messages, images)], params, use_tqdm=False)
    processor = AutoProcessor.from_pretrained(str(model_dir))
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=text, images=images, return_tensors="pt", add_special_tokens=False, **PAN)
    assert inputs["pixel_values"].shape[0] >= 6  # two images, four crops or more
    reference = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert_greedy_is_the_references(reference, outputs, [dict(inputs)])
