"""Gemma 3's model against transformers' (fp32, tiny random checkpoints written by transformers itself): the same
logits over text longer than the sliding window, one image and two images, with images whose tokens outnumber
the window (a sliding layer's image token then sees its image's later tokens, not its earliest ones). The engine
refuses Gemma 3 until it gives images their two-way attention."""

from __future__ import annotations

import pytest
import torch

from fovea.attention.layer import AttentionMetadata
from fovea.config.engine import EngineConfig
from fovea.models.loader import load_model

VOCAB, BOI, EOI, IMAGE = 300, 297, 298, 299
WINDOW = 8


def write_checkpoint(path, seed: int, image_size: int, tokens_per_image: int, rope_scaling: dict | None):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        sliding_window_pattern=2,  # sliding, global, sliding, global
        query_pre_attn_scalar=24,  # not head_dim: the scale is its own setting
        max_position_embeddings=2048,
        rope_scaling=rope_scaling,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=14,
        vision_use_head=False,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=tokens_per_image,
        image_token_index=IMAGE,
        boi_token_index=BOI,
        eoi_token_index=EOI,
    )
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # transformers starts Gemma's norms at 0 (a factor of 1): make them matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    return {  # 4 x 4 patches pooled 2 x 2: 4 tokens an image; 8 x 8 patches pooled 2 x 2: 16, twice the window
        "small": write_checkpoint(root / "small", 1, 56, 4, {"rope_type": "linear", "factor": 8.0}),
        "large_images": write_checkpoint(root / "large", 2, 112, 16, None),
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


def patches(pixel_values: torch.Tensor, patch: int = 14) -> torch.Tensor:
    """(images, 3, side, side) -> (images x patches, 3 x patch x patch), patches row by row: the patch
    embedding's matmul input."""
    images, channels, side, _ = pixel_values.shape
    grid = pixel_values.view(images, channels, side // patch, patch, side // patch, patch)
    return grid.permute(0, 2, 4, 1, 3, 5).reshape(-1, channels * patch * patch)


def logits_pair(model_dir, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import Gemma3ForConditionalGeneration

    reference = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    side, per_image = reference.config.vision_config.image_size, reference.config.mm_tokens_per_image
    ids = prompt(kind, per_image)
    count = len(image_spans(ids))
    pixel_values = torch.rand(count, 3, side, side, generator=torch.Generator().manual_seed(5)) * 2 - 1
    inputs = {"input_ids": torch.tensor([ids]), "token_type_ids": torch.tensor([[int(t == IMAGE) for t in ids]])}
    if count:
        inputs["pixel_values"] = pixel_values
    with torch.no_grad():
        theirs = reference(**inputs).logits[0]
    ours_model, _ = load_model(model_dir, dtype="float32")
    grid = (1, side // 14, side // 14)
    with torch.no_grad():
        mm = ours_model.encode_images(patches(pixel_values), [grid] * count) if count else None
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


def test_the_engine_refuses_gemma3_until_it_serves_it(checkpoints):
    with pytest.raises(ValueError, match="Gemma 3 is not served yet"):
        EngineConfig.from_args(str(checkpoints["small"]), dtype="float32")


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
    assert (text.rope_theta, text.rope_factor, text.local_rope_theta) == (
        full["rope_theta"],
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
