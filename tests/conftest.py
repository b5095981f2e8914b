"""Shared fixtures: tiny checkpoints written once per session, HF transformers as the reference implementation."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

torch.set_num_threads(1)  # the CI machine has 2 shared cores; more threads thrash
warnings.filterwarnings("ignore", category=FutureWarning)

IMAGE_TOKEN_ID = 151655


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """{"tiny-3b": dir, "tiny-7b": dir}: the two tiny configs in the published layout, fp32 weights."""
    from fovea.models.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {name: write_tiny_checkpoint(root / name, name, seed=1 + i)
            for i, name in enumerate(["tiny-3b", "tiny-7b"])}


_HF_CACHE: dict = {}
_OURS_CACHE: dict = {}


def hf_model(model_dir):
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    key = str(model_dir)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            key, dtype=torch.float32, attn_implementation="eager").eval()
        # Plain greedy: otherwise generate() merges the checkpoint's generation_config.json (repetition
        # penalty 1.05, top_k...) into every call, even into an explicit greedy GenerationConfig.
        _HF_CACHE[key].generation_config = GenerationConfig(do_sample=False, eos_token_id=[151645, 151643],
                                                             pad_token_id=151643)
    return _HF_CACHE[key]


def our_model(model_dir):
    from fovea.models.loader import load_model
    from fovea.multimodal.prompt import PromptProcessor

    key = str(model_dir)
    if key not in _OURS_CACHE:
        model, _ = load_model(model_dir, dtype="float32")
        _OURS_CACHE[key] = (model, PromptProcessor(model_dir, model.config))
    return _OURS_CACHE[key]


def random_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """Smooth random structure plus noise, so that resizing matters and no two images are alike."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(2, height // 16), max(2, width // 16), 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(small).resize((width, height), Image.BILINEAR), dtype=np.int16)
    noisy = np.clip(base + rng.integers(-20, 21, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(noisy)
    return image if mode == "RGB" else image.convert(mode)


def jpeg_bytes(image: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def hf_inputs(model_dir, messages, images, max_pixels=None):
    """The reference inputs, built with transformers only: its tokenizer + chat template, its PIL image
    processor, and the string-level placeholder expansion its Qwen2.5-VL processor performs."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = {}
    if images:
        kwargs = {"max_pixels": max_pixels} if max_pixels else {}
        proc = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir), **kwargs)
        feats = proc(images=images, return_tensors="pt")
        pieces = text.split("<|image_pad|>")
        assert len(pieces) == len(images) + 1
        counts = (feats["image_grid_thw"].prod(-1) // 4).tolist()
        text = pieces[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, pieces[1:]))
        out.update(pixel_values=feats["pixel_values"], image_grid_thw=feats["image_grid_thw"])
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    out["input_ids"] = ids
    out["mm_token_type_ids"] = (ids == IMAGE_TOKEN_ID).long()
    return out
