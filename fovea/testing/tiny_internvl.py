"""Tiny random-weight InternVL checkpoints for tests: the weights and config.json as transformers writes them (its
own random model, saved), the processor's files (GotOcr2ImageProcessor's preprocessor_config.json, InternVLProcessor's
processor_config.json), a tokenizer with InternVL's special tokens, and the chat template transformers' conversion
gives the "-hf" checkpoints (fovea/models/internvl_chat_template.jinja).

Vocabulary: a small byte-level BPE trained here (tiny_llava's corpus), then Qwen's and InternVL's special tokens:
<|endoftext|> 0 (trained), and after the learned tokens <|im_start|>, <|im_end|>, <img>, </img>, <IMG_CONTEXT>,
<video>, named to the processor as its start, end and context image tokens.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

from fovea.testing.tiny_llava import added_tokens_decoder, byte_bpe

BPE_TOKENS = 290
IM_START, IM_END, IMG_START, IMG_END, IMG_CONTEXT, VIDEO = range(BPE_TOKENS, BPE_TOKENS + 6)
VOCAB = BPE_TOKENS + 6
ADDED = {
    IM_START: "<|im_start|>",
    IM_END: "<|im_end|>",
    IMG_START: "<img>",
    IMG_END: "</img>",
    IMG_CONTEXT: "<IMG_CONTEXT>",
    VIDEO: "<video>",
}
# the towers the tests vary: InternViT-300M's (LayerNorm, q/k/v biases, mean-pooled: no last norm) and
# InternViT-6B's (RMSNorm, no biases, q and k RMS-normed over all heads), and one whose last norm is used
TOWERS = {
    "300m": dict(norm_type="layer_norm", attention_bias=True, use_qk_norm=False, use_mean_pooling=True),
    "6b": dict(norm_type="rms_norm", attention_bias=False, use_qk_norm=True, use_mean_pooling=True),
    "post-norm": dict(norm_type="layer_norm", attention_bias=True, use_qk_norm=False, use_mean_pooling=False),
}
DECODERS = {
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "qwen2": dict(model_type="qwen2"),
    # InternVL3.5-30B-A3B's kind: experts in the first layer's MLP, the second dense
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        mlp_only_layers=[1],
    ),
    # InternVL3.5-GPT-OSS-20B-A4B's: experts with biases in every layer (their width `intermediate_size`), the first
    # layer sliding over 8 keys, sinks, yarn RoPE (GptOssConfig's default); a low clamp, so that it clamps
    "gpt_oss": dict(
        model_type="gpt_oss",
        head_dim=16,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        swiglu_limit=0.5,
        rope_theta=None,
    ),
}


def write_tokenizer(out: Path) -> None:
    byte_bpe(BPE_TOKENS, ["<|endoftext|>"], list(ADDED.values())).save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
        "extra_special_tokens": {
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
        "added_tokens_decoder": added_tokens_decoder({0: "<|endoftext|>", **ADDED}),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_internvl_checkpoint(
    out_dir: str | Path,
    name: str = "tiny-internvl",
    *,
    seed: int = 0,
    tower: str = "300m",
    decoder: str = "qwen3",
    max_patches: int = 6,
    tie_word_embeddings: bool = False,
    vision_feature_layer: int = -1,
    layout: str = "published",
    shards: int = 1,
    dtype: str = "float32",
    device: str = "cpu",
) -> Path:
    """Two decoder layers of width 64 (Qwen3's, or `decoder`'s), a two-layer InternViT of width 32 over 56 px tiles in
    14 px patches (4 x 4 patches, pixel-shuffled into 4 tokens a tile), images cut into up to `max_patches`
    tiles. The layer scales, class token and positions (constants or zeros at initialisation) get random values
    too, so that they matter. Written as transformers writes it (the "-hf" names; `fovea tiny`'s layout, shards
    and device do not apply), in fp32 or `dtype`."""
    if name != "tiny-internvl":
        raise ValueError(f"unknown InternVL configuration {name!r}: tiny-internvl")
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        eos_token_id=IM_END,
        tie_word_embeddings=tie_word_embeddings,
    )
    text = {key: value for key, value in {**text, **DECODERS[decoder]}.items() if value is not None}
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=56,
        patch_size=14,
        **TOWERS[tower],
    )
    config = InternVLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMG_CONTEXT,
        image_seq_length=4,
        vision_feature_layer=vision_feature_layer,
        tie_word_embeddings=tie_word_embeddings,
    )
    model = InternVLForConditionalGeneration(config).to(getattr(torch, dtype))
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lambda" in param_name or "cls_token" in param_name or "position_embeddings" in param_name:
                param.normal_(0, 0.5)
            elif "norm" in param_name and param_name.endswith("weight"):
                param.normal_(1, 0.3)
            elif param_name.endswith("sinks"):  # large enough to take a share of the weights
                param.normal_(1, 1)
            elif "experts" in param_name and param_name.endswith("bias"):  # transformers starts them at 0
                param.normal_(0, 0.3)
    model.save_pretrained(out)
    write_tokenizer(out)
    # InternVLProcessor cannot be built here (its video processor needs torchvision): its files as it saves them
    GotOcr2ImageProcessorPil(
        size={"height": 56, "width": 56},
        max_patches=max_patches,
        crop_to_patches=False,  # as released: InternVLProcessor turns it on
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    ).save_pretrained(out)
    processor = {"processor_class": "InternVLProcessor", "image_seq_length": 4}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))
    template = (resources.files("fovea.models") / "internvl_chat_template.jinja").read_text()
    (out / "chat_template.jinja").write_text(template)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": IM_END}, indent=2))
    return out
