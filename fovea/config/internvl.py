"""InternVL's config.json as a `ModelConfig` (its model: fovea/models/internvl.py): transformers' conversion
("-hf", InternVLForConditionalGeneration) and OpenGVLab's own uploads (InternVLChatModel)."""

from __future__ import annotations

import dataclasses

from fovea.config.hf_keys import (
    checkpoint_dtype,
    eos_ids,
    fixed_size_tower,
    gpt_oss_text,
    moe_config,
    parse_text,
    text_keys,
)
from fovea.config.image import ImageProcessorConfig
from fovea.config.model import ModelConfig
from fovea.config.video import TiledVideoOptions

INTERNVIT_DEFAULTS = dict(  # InternVLVisionConfig's defaults (InternViT-300M)
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_channels=3,
    image_size=448,
    patch_size=14,
    hidden_act="gelu",
    layer_norm_eps=1e-6,
    attention_bias=False,
    use_qk_norm=False,
    norm_type="layer_norm",
    use_mean_pooling=True,
)
# the language models InternVL checkpoints end in, by text_config's model_type: (q/k/v biases as parse_text
# takes them, q/k norms, the default max_window_layers where the decoder has Qwen2's sliding windows)
INTERNVL_DECODERS = {
    "qwen2": (True, False, 28),
    "qwen3": (None, True, 28),
    "qwen3_moe": (None, True, 0),  # InternVL3.5-30B-A3B and -241B-A28B: experts in its MLPs; windows in every layer
    "llama": (None, False, None),
    "gpt_oss": None,  # InternVL3.5-GPT-OSS-20B-A4B: its own decoder settings (hf_keys.gpt_oss_text)
}


def parse_internvl(raw: dict, preprocessor: dict) -> ModelConfig:
    """InternVL (2.5, 3, 3.5 as transformers converts them, "-hf"): an InternViT tower over 448 px tiles, each
    tile's 32 x 32 patch features pixel-shuffled 2 x 2 into 256 tokens through an MLP projector, and a Qwen2, Qwen3
    (dense or MoE), Llama or GPT-OSS decoder; 1-D RoPE. Each image's tokens sit between <img> and </img>, which the
    processor adds. A video is its frames, each one tile with its own tokens after "FrameN: " in the text."""
    text_raw = raw.get("text_config") or {}
    kind = text_raw.get("model_type", "qwen2")
    if kind not in INTERNVL_DECODERS:
        raise ValueError(
            f"InternVL with a {kind!r} language model is not supported; fovea runs {', '.join(INTERNVL_DECODERS)}"
        )
    keys = text_keys(raw)
    if kind == "gpt_oss":
        text = gpt_oss_text(keys)
    else:
        bias, qk_norm, window_layers = INTERNVL_DECODERS[kind]
        mlp_bias = kind == "llama" and bool(text_raw.get("mlp_bias", False))
        if kind == "qwen3_moe":  # transformers' Qwen3-MoE slides in every layer, whatever max_window_layers says
            keys = {key: value for key, value in keys.items() if key not in ("max_window_layers", "layer_types")}
        text = parse_text(keys, False, bias, qk_norm=qk_norm, window_layers=window_layers, mlp_bias=mlp_bias)
        if kind == "qwen3_moe":
            text = dataclasses.replace(text, moe=moe_config(keys, text.num_layers))
    vision = {**INTERNVIT_DEFAULTS, **(raw.get("vision_config") or {})}
    ratio, layer = raw.get("downsample_ratio", 0.5), raw.get("vision_feature_layer", -1)
    merge, side, patch = round(1 / ratio), vision["image_size"], vision["patch_size"]
    side, patch = (side[0], patch[0]) if isinstance(side, list) else (side, patch)
    if raw.get("projector_hidden_act", "gelu") != "gelu":
        raise ValueError(f"InternVL's projector with {raw['projector_hidden_act']!r} is not supported (gelu is)")
    if raw.get("vision_feature_select_strategy", "default") != "default" or not isinstance(layer, int):
        raise ValueError("InternVL: only one feature layer with the class token dropped ('default') is supported")
    layers = vision["num_hidden_layers"]
    used = layer if layer >= 0 else layers + 1 + layer
    if not 0 < used <= layers:
        raise ValueError(f"vision_feature_layer {layer} is outside the tower's {layers} layers")
    if merge * ratio != 1 or side % (patch * merge):
        raise ValueError(
            f"downsample_ratio {ratio} must be 1/n with the tile's {side // patch} patches a multiple of n"
        )
    if vision["norm_type"] not in ("layer_norm", "rms_norm") or not vision.get("use_absolute_position_embeddings", 1):
        raise ValueError("InternViT: layer_norm or rms_norm, with absolute position embeddings, is supported")
    return ModelConfig(
        architecture="InternVLForConditionalGeneration",
        text=text,
        vision=dataclasses.replace(
            fixed_size_tower({**vision, "image_size": side, "patch_size": patch}, used, text.hidden_size, merge),
            attention_bias=bool(vision["attention_bias"]),
            qk_norm=bool(vision["use_qk_norm"]),
            rms_norm=vision["norm_type"] == "rms_norm",
            post_norm=not vision["use_mean_pooling"] and layer == -1,  # the last hidden state's norm
        ),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),  # InternVLConfig's default
        torch_dtype=checkpoint_dtype(raw),
        image_token_id=raw.get("image_token_id", 151667),  # <IMG_CONTEXT>
        video_token_id=None,
        vision_start_token_id=None,
        vision_end_token_id=None,
        eos_token_ids=eos_ids(text_raw.get("eos_token_id", raw.get("eos_token_id"))),
        image=ImageProcessorConfig.tiled(preprocessor, patch, side, merge),
        mrope=False,
        image_wrap=("<img>", "</img>"),
        video=TiledVideoOptions(side=side),
        video_text="<video>",
    )


# InternVL's own uploads (remote code, `InternVLChatModel`): their config keys -> transformers' InternVLConfig's
INTERNVL_CHAT_DECODERS = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "GptOssForCausalLM": "gpt_oss",
}
INTERNVIT_KEYS = {"qkv_bias": "attention_bias", "qk_normalization": "use_qk_norm"}
IMAGENET = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}


def parse_internvl_chat(raw: dict, preprocessor: dict) -> ModelConfig:
    """InternVL as OpenGVLab uploads it (`OpenGVLab/InternVL3_5-8B`; vLLM serves it as InternVLChatModel): the same
    network as transformers' "-hf" conversion, its language model under `llm_config`, its tower's keys InternViT's
    own (RMSNorm unless named), its image settings in config.json (`max_dynamic_patch`, `use_thumbnail`, ...;
    ImageNet's mean and std, bicubic). The image token's id is the tokenizer's <IMG_CONTEXT> (parse_model_config)."""
    llm, vision = raw.get("llm_config") or {}, raw.get("vision_config") or {}
    kind = INTERNVL_CHAT_DECODERS.get((llm.get("architectures") or ["?"])[0])
    if kind is None:
        raise ValueError(
            f"InternVL with a {(llm.get('architectures') or ['?'])[0]} language model is not supported; fovea runs "
            f"{', '.join(INTERNVL_CHAT_DECODERS)}"
        )
    if raw.get("ps_version", "v1") != "v2":
        raise ValueError("InternVL's first pixel shuffle (ps_version v1) is not supported; the released 2.5-3.5 use v2")
    side = raw.get("force_image_size") or vision.get("image_size", 448)
    tower = {INTERNVIT_KEYS.get(key, key): value for key, value in vision.items() if value is not None}
    tower = {"norm_type": "rms_norm", "attention_bias": False, **tower, "image_size": side, "use_mean_pooling": True}
    most = raw.get("max_dynamic_patch", 6) if raw.get("dynamic_image_size") else 1
    tiles = {"max_patches": most, "min_patches": min(raw.get("min_dynamic_patch", 1), most)}
    converted = {
        "text_config": {**llm, "model_type": kind},
        "vision_config": tower,
        "downsample_ratio": raw.get("downsample_ratio", 0.5),
        "vision_feature_layer": raw.get("select_layer", -1),
        "tie_word_embeddings": llm.get("tie_word_embeddings", False),
        "torch_dtype": raw.get("torch_dtype") or llm.get("torch_dtype"),
    }
    config = parse_internvl(converted, {**IMAGENET, "size": {"height": side, "width": side}, **tiles})
    thumbnail = bool(raw.get("use_thumbnail")) and most > 1
    image = dataclasses.replace(config.image, thumbnail=thumbnail, max_pixels=side * side * (most + thumbnail))
    return dataclasses.replace(config, architecture="InternVLChatModel", image=image, image_text="<image>")
