"""Tiny random-weight Gemma 3 checkpoints for tests: the weights and config.json as transformers writes them (its
own random model, saved), the image processor's preprocessor_config.json and processor_config.json, a tokenizer
with Gemma's special tokens, and the released chat template (fovea/models/gemma3_chat_template.jinja).

Vocabulary: Gemma's SentencePiece vocabulary ships in no package available offline, so the tokenizer is a small
byte-level BPE trained here (tiny_llava's corpus) with Gemma's special tokens: <pad> 0, <eos> 1, <bos> 2 (added
to plain prompts, as Gemma's tokenizer does), <unk> 3, and after the learned tokens <start_of_turn>,
<end_of_turn>, <start_of_image>, <end_of_image>, <image_soft_token>.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

from fovea.testing.tiny_llava import added_tokens_decoder, byte_bpe

BPE_TOKENS = 295
TURN_START, TURN_END, BOI, EOI, IMAGE = range(BPE_TOKENS, BPE_TOKENS + 5)
VOCAB = BPE_TOKENS + 5
SPECIALS = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>"}
ADDED = {TURN_START: "<start_of_turn>", TURN_END: "<end_of_turn>", BOI: "<start_of_image>", EOI: "<end_of_image>"}
ADDED[IMAGE] = "<image_soft_token>"


def write_tokenizer(out: Path) -> None:
    from tokenizers import processors

    tok = byte_bpe(BPE_TOKENS, list(SPECIALS.values()), list(ADDED.values()))
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)]
    )
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "extra_special_tokens": {"boi_token": ADDED[BOI], "eoi_token": ADDED[EOI], "image_token": ADDED[IMAGE]},
        "added_tokens_decoder": added_tokens_decoder({**SPECIALS, **ADDED}),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_gemma3_checkpoint(
    out_dir: str | Path,
    name: str = "tiny-gemma3",
    *,
    seed: int = 0,
    image_size: int = 56,
    tokens_per_image: int = 4,
    sliding_window: int = 8,
    rope_scaling: dict | None = None,
    layout: str = "published",
    shards: int = 1,
    dtype: str = "float32",
    device: str = "cpu",
) -> Path:
    """Four decoder layers (sliding, global, sliding, global) of width 64, a two-layer SigLIP of width 32; 14 px
    patches, pooled to `tokens_per_image`. Gemma's norms (a factor of 1 + weight, 0 at initialisation) get random
    weights too, so that they matter. Written as transformers writes it (the published names; `fovea tiny`'s
    layout, shards and device do not apply), in fp32 or `dtype`."""
    if name != "tiny-gemma3":
        raise ValueError(f"unknown Gemma 3 configuration {name!r}: tiny-gemma3")
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=sliding_window,
        sliding_window_pattern=2,
        query_pre_attn_scalar=24,  # not head_dim: the scale is its own setting
        max_position_embeddings=2048,
        rope_scaling=rope_scaling,
        eos_token_id=[1, TURN_END],
        bos_token_id=2,
        pad_token_id=0,
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
        eos_token_id=[1, TURN_END],
    )
    model = Gemma3ForConditionalGeneration(config).to(getattr(torch, dtype))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(out)
    write_tokenizer(out)
    from transformers import AutoTokenizer

    template = (resources.files("fovea.models") / "gemma3_chat_template.jinja").read_text()
    processor = Gemma3Processor(
        Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}),
        AutoTokenizer.from_pretrained(str(out)),
        chat_template=template,
        image_seq_length=tokens_per_image,
    )
    processor.save_pretrained(out)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 2, "eos_token_id": [1, TURN_END], "pad_token_id": 0}, indent=2)
    )
    return out
