"""Tiny random-weight LLaVA-1.5 checkpoints in the llava-hf layout (tests, and the 7B shapes for GPU benchmarks).

Every file llava-hf/llava-1.5-7b-hf has is here, with its keys: config.json (sparse, as published: the rest are
LlamaConfig / CLIPVisionConfig defaults written out only where the tiny shapes differ), model.safetensors in the
published names (`language_model.model.*`, `vision_tower.vision_model.*`, `multi_modal_projector.*`) or the
transformers-5 ones, preprocessor_config.json (CLIPImageProcessor: shortest side 336, centre crop 336), tokenizer
files and generation_config.json.

Vocabulary: Llama's SentencePiece vocabulary ships in no package available offline, so the tokenizer is a small
byte-level BPE trained here, deterministically, on a fixed English text, with Llama's special tokens at Llama's
ids (<unk> 0, <s> 1, </s> 2), a BOS added to plain prompts as Llama's tokenizer does, and LLaVA's <image> and
<pad> after the learned tokens; config.json's image_token_index names that <image> id. Any text encodes (bytes
are the fallback), the ids just differ from the real vocabulary's.
"""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

import torch

from fovea.config.image import CLIP_MEAN, CLIP_STD
from fovea.testing.tiny import random_weights, save_weights

# name -> text (hidden, intermediate, layers, heads, kv heads, vocab) and vision (hidden, intermediate, layers, heads)
BPE_TOKENS = 600  # learned vocabulary, specials included; <image> and <pad> follow
IMAGE_TOKEN, PAD_TOKEN = BPE_TOKENS, BPE_TOKENS + 1
# fmt: off
LLAVA_SHAPES = {
    # the vocabulary exactly the tokenizer's: padded rows (llava-hf has 32064 for 32002 tokens) are ids no
    # tokenizer can decode, which random weights would pick
    "tiny-llava": dict(hidden=64, inter=128, layers=2, heads=4, kv=2, vocab=BPE_TOKENS + 2, v_hidden=32,
                       v_inter=64, v_layers=3, v_heads=2),
    # llava-hf/llava-1.5-7b-hf's shapes (Vicuna-7B + CLIP ViT-L/14-336), random weights
    "llava-1.5-7b": dict(hidden=4096, inter=11008, layers=32, heads=32, kv=32, vocab=32064, v_hidden=1024,
                         v_inter=4096, v_layers=24, v_heads=16),
}
# fmt: on
WORDS = (
    "the a an and or but of to in on at by with from for is are was were be this that these those what which "
    "who how why where when image picture photo painting colour colours red green blue yellow white black grey "
    "cat dog bird horse boat ship sea sky sun tree house street car people person man woman child table chair "
    "describe count name compare look see show tell find say answer question first second third last more "
    "less bright dark large small big little many few one two three four five left right top bottom middle "
    "sailors watched horizon gulls circled masts cook argued carpenter price nails harbour museum assistant "
    "write haiku limerick summarise please thank you hello hi yes no"
).split()


def corpus() -> list[str]:
    """A fixed English text: sentences drawn from WORDS with a seeded generator (the same on every machine)."""
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + ".\n" for _ in range(2000)]


def llava_config(name: str = "tiny-llava", dtype: str = "float32") -> dict:
    s = LLAVA_SHAPES[name]
    text = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "torch_dtype": dtype,
        "vocab_size": s["vocab"],
    }
    if name != "llava-1.5-7b":  # the published file leaves Llama-7B's shapes to LlamaConfig's defaults
        text.update(
            hidden_size=s["hidden"],
            intermediate_size=s["inter"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            num_key_value_heads=s["kv"],
        )
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "ignore_index": -100,
        "image_token_index": IMAGE_TOKEN,
        "model_type": "llava",
        "pad_token_id": PAD_TOKEN,
        "projector_hidden_act": "gelu",
        "text_config": text,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "transformers_version": "4.36.0.dev0",
        "vision_config": {
            "hidden_size": s["v_hidden"],
            "image_size": 336,
            "intermediate_size": s["v_inter"],
            "model_type": "clip_vision_model",
            "num_attention_heads": s["v_heads"],
            "num_hidden_layers": s["v_layers"],
            "patch_size": 14,
            "projection_dim": 768,
            "vocab_size": 32000,
        },
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": s["vocab"],
    }


def weight_shapes(name: str) -> dict[str, tuple[int, ...]]:
    s = LLAVA_SHAPES[name]
    h, i, v, hd = s["hidden"], s["inter"], s["vocab"], s["hidden"] // s["heads"]
    shapes = {
        "language_model.model.embed_tokens.weight": (v, h),
        "language_model.model.norm.weight": (h,),
        "language_model.lm_head.weight": (v, h),
    }
    for n in range(s["layers"]):
        p = f"language_model.model.layers.{n}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (s["heads"] * hd, h),
                p + "self_attn.k_proj.weight": (s["kv"] * hd, h),
                p + "self_attn.v_proj.weight": (s["kv"] * hd, h),
                p + "self_attn.o_proj.weight": (h, s["heads"] * hd),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    e, vi = s["v_hidden"], s["v_inter"]
    p = "vision_tower.vision_model."
    shapes.update(
        {
            p + "embeddings.class_embedding": (e,),
            p + "embeddings.patch_embedding.weight": (e, 3, 14, 14),
            p + "embeddings.position_embedding.weight": (577, e),
        }
    )
    for norm in ("pre_layrnorm", "post_layernorm"):
        shapes.update({p + f"{norm}.weight": (e,), p + f"{norm}.bias": (e,)})
    for n in range(s["v_layers"]):
        q = f"{p}encoder.layers.{n}."
        for part, shape in (
            ("self_attn.q_proj", (e, e)),
            ("self_attn.k_proj", (e, e)),
            ("self_attn.v_proj", (e, e)),
            ("self_attn.out_proj", (e, e)),
            ("mlp.fc1", (vi, e)),
            ("mlp.fc2", (e, vi)),
            ("layer_norm1", (e,)),
            ("layer_norm2", (e,)),
        ):
            shapes.update({q + part + ".weight": shape, q + part + ".bias": shape[:1]})
    shapes.update(
        {
            "multi_modal_projector.linear_1.weight": (h, e),
            "multi_modal_projector.linear_1.bias": (h,),
            "multi_modal_projector.linear_2.weight": (h, h),
            "multi_modal_projector.linear_2.bias": (h,),
        }
    )
    return shapes


def to_transformers5_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    def rename(name: str) -> str:
        if name.startswith("language_model.lm_head."):
            return name.removeprefix("language_model.")
        if name.startswith("language_model.model."):
            return "model.language_model." + name.removeprefix("language_model.model.")
        return "model." + name

    return {rename(k): v for k, v in weights.items()}


def byte_bpe(size: int, trained: list[str], added: list[str]):
    """A byte-level BPE of `size` tokens trained on corpus() with the `trained` special tokens first, then the
    `added` special tokens after the learned ones (the tiny checkpoints' vocabularies)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=trained,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    assert tok.get_vocab_size() == size, tok.get_vocab_size()
    tok.add_special_tokens(added)
    return tok


def added_tokens_decoder(specials: dict[int, str]) -> dict:
    """tokenizer_config.json's entries for special tokens by id."""
    entry = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    return {str(i): {"content": token, **entry} for i, token in specials.items()}


def write_tokenizer(out: Path, chat_template: bool) -> None:
    from tokenizers import processors

    tok = byte_bpe(BPE_TOKENS, ["<unk>", "<s>", "</s>"], ["<image>", "<pad>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.save(str(out / "tokenizer.json"))
    specials = {0: "<unk>", 1: "<s>", 2: "</s>", IMAGE_TOKEN: "<image>", PAD_TOKEN: "<pad>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added_tokens_decoder(specials),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if chat_template:
        template = (resources.files("fovea.models") / "llava_chat_template.jinja").read_text()
        (out / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2))


def write_llava_checkpoint(
    out_dir: str | Path,
    name: str = "tiny-llava",
    *,
    seed: int = 0,
    dtype: str = "float32",
    layout: str = "published",
    device: str = "cpu",
    shards: int = 1,
    chat_template: bool = True,
) -> Path:
    """A complete random-weight LLaVA-1.5 checkpoint; `chat_template=False` leaves the template out (as older
    llava-hf uploads do: the server then needs --chat-template)."""
    if layout not in ("published", "transformers5"):
        raise ValueError(f"layout must be 'published' or 'transformers5', got {layout!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(llava_config(name, dtype), indent=2))
    weights = random_weights(weight_shapes(name), seed, getattr(torch, dtype), device)
    save_weights(weights if layout == "published" else to_transformers5_names(weights), out, shards)
    write_tokenizer(out, chat_template)
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "crop_size": {"height": 336, "width": 336},
                "do_center_crop": True,
                "do_convert_rgb": True,
                "do_normalize": True,
                "do_rescale": True,
                "do_resize": True,
                "image_mean": list(CLIP_MEAN),
                "image_processor_type": "CLIPImageProcessor",
                "image_std": list(CLIP_STD),
                "processor_class": "LlavaProcessor",
                "resample": 3,
                "rescale_factor": 1 / 255,
                "size": {"shortest_edge": 336},
            },
            indent=2,
        )
    )
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": PAD_TOKEN}, indent=2)
    )
    (out / "README.md").write_text(
        f"# fovea {name} (RANDOM WEIGHTS)\n\nWritten by `fovea.testing.tiny_llava.write_llava_checkpoint` with seed "
        f"{seed}. Its outputs are meaningless. Vocabulary: a byte-level BPE trained at build time (see the module "
        "docstring), not Llama's.\n"
    )
    return out
