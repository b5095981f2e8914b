"""How each family's config.json (and preprocessor_config.json) becomes a `ModelConfig`: one parser per
architecture, as transformers keeps a configuration file beside each modeling file.

Checkpoints come in two on-disk forms: the flat one of the published Qwen checkpoints (`rope_scaling: {type: mrope,
mrope_section}`, `vision_config.in_chans`) and the nested one transformers 5 writes (`text_config`,
`rope_parameters`, `vision_config.in_channels`, `dtype`). Published llava-hf checkpoints leave most keys to the
defaults of transformers' LlamaConfig and CLIPVisionConfig, so those defaults are part of the format. Gemma 3's
and InternVL's parsers have modules of their own (gemma3.py, internvl.py), the helpers all share hf_keys.py. Adding
a model is a parser and its module under fovea/models/ (registry.py there names it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fovea.config.gemma3 import parse_gemma3
from fovea.config.hf_keys import (
    checkpoint_dtype,
    eos_from_files,
    eos_ids,
    fixed_size_tower,
    moe_config,
    parse_text,
    text_keys,
    token_id_in_files,
)
from fovea.config.image import ImageProcessorConfig
from fovea.config.internvl import parse_internvl, parse_internvl_chat
from fovea.config.model import ModelConfig, TextConfig, VisionConfig
from fovea.config.quant import parse_quant_config
from fovea.config.video import TimestampedVideoOptions

# config.json files without `architectures` are named by their model_type
MODEL_TYPES = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "internvl": "InternVLForConditionalGeneration",
    "internvl_chat": "InternVLChatModel",
}


def architecture_of(raw: dict) -> str:
    names = raw.get("architectures") or [MODEL_TYPES.get(raw.get("model_type"), str(raw.get("model_type")))]
    supported = [name for name in names if name in PARSERS]
    if not supported:
        raise ValueError(
            f"unsupported architecture {names[0]!r} (model_type {raw.get('model_type')!r}); fovea runs "
            f"{', '.join(sorted(PARSERS))}"
        )
    return supported[0]


def parse_model_config(raw: dict, preprocessor: dict, model_dir: Path | None = None) -> ModelConfig:
    config = PARSERS[architecture_of(raw)](raw, preprocessor)
    if config.architecture == "InternVLChatModel" and model_dir is not None:  # its config.json does not name it
        image_token = token_id_in_files(model_dir, "<IMG_CONTEXT>")
        config = dataclasses.replace(
            config, image_token_id=config.image_token_id if image_token is None else image_token
        )
    if not config.eos_token_ids:  # null or left out in config.json: as transformers, the generation config's or
        # the tokenizer's; the family's own only where the directory has neither
        found = eos_from_files(model_dir) if model_dir is not None else ()
        config = dataclasses.replace(config, eos_token_ids=found or FAMILY_EOS[config.architecture])
    language = text_keys(raw) if "llm_config" not in raw else raw["llm_config"] or {}  # (OpenGVLab's uploads')
    quant = parse_quant_config(raw.get("quantization_config") or language.get("quantization_config"))
    if quant is None:
        return config
    return dataclasses.replace(config, text=dataclasses.replace(config.text, quant=quant))


FAMILY_EOS = {  # the released checkpoints' <|im_end|> and </s>
    "Qwen2_5_VLForConditionalGeneration": (151645,),
    "Qwen3VLForConditionalGeneration": (151645,),
    "Qwen3VLMoeForConditionalGeneration": (151645,),
    "Qwen2VLForConditionalGeneration": (151645,),
    "LlavaForConditionalGeneration": (2,),
    "Gemma3ForConditionalGeneration": (1, 106),  # <eos>, <end_of_turn>
    "InternVLForConditionalGeneration": (151645,),
    "InternVLChatModel": (151645,),
}


# -------------------------------------------------------------------------------------- Qwen2.5-VL, Qwen2-VL


QWEN2_VL_WINDOW_LAYERS = 80  # Qwen2-VL's and Qwen2.5-VL's text configs' default max_window_layers


def parse_qwen2_5_vl(raw: dict, preprocessor: dict) -> ModelConfig:
    text = parse_text(text_keys(raw), mrope=True, attention_bias=True, window_layers=QWEN2_VL_WINDOW_LAYERS)
    vision = raw.get("vision_config") or {}
    rope = vision.get("rope_parameters") or {}
    return qwen_model_config(
        raw,
        preprocessor,
        text,
        VisionConfig(
            depth=vision.get("depth", 32),
            hidden_size=vision.get("hidden_size", 1280),
            intermediate_size=vision.get("intermediate_size", 3420),
            num_heads=vision.get("num_heads", 16),
            in_channels=vision.get("in_channels", vision.get("in_chans", 3)),
            patch_size=vision.get("patch_size", 14),
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            spatial_merge_size=vision.get("spatial_merge_size", 2),
            window_size=vision.get("window_size", 112),
            fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
            out_hidden_size=vision.get("out_hidden_size", text.hidden_size),
            tokens_per_second=vision.get("tokens_per_second", 2),
            rope_theta=rope.get("rope_theta", 10000.0),
            hidden_act=vision.get("hidden_act", "silu"),
        ),
    )


def qwen_model_config(raw: dict, preprocessor: dict, text: TextConfig, vision: VisionConfig) -> ModelConfig:
    """The settings Qwen2-VL and Qwen2.5-VL share: special tokens, image processor, M-RoPE."""
    keys = text_keys(raw)
    return ModelConfig(
        architecture=architecture_of(raw),
        text=text,
        vision=vision,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", keys.get("tie_word_embeddings", False))),
        torch_dtype=checkpoint_dtype(raw),
        image_token_id=raw.get("image_token_id", 151655),
        video_token_id=raw.get("video_token_id", 151656),
        vision_start_token_id=raw.get("vision_start_token_id", 151652),
        vision_end_token_id=raw.get("vision_end_token_id", 151653),
        eos_token_ids=eos_ids(keys.get("eos_token_id")),
        image=ImageProcessorConfig.dynamic(preprocessor),
    )


def parse_qwen2_vl(raw: dict, preprocessor: dict) -> ModelConfig:
    text = parse_text(text_keys(raw), mrope=True, attention_bias=True, window_layers=QWEN2_VL_WINDOW_LAYERS)
    vision = raw.get("vision_config") or {}
    width, depth = vision.get("embed_dim", 1280), vision.get("depth", 32)
    patch, merge = vision.get("patch_size", 14), vision.get("spatial_merge_size", 2)
    return qwen_model_config(
        raw,
        preprocessor,
        text,
        VisionConfig(
            depth=depth,
            hidden_size=width,
            intermediate_size=int(width * vision.get("mlp_ratio", 4)),
            num_heads=vision.get("num_heads", 16),
            in_channels=vision.get("in_channels", vision.get("in_chans", 3)),
            patch_size=patch,
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            spatial_merge_size=merge,
            window_size=patch * merge,
            fullatt_block_indexes=tuple(range(depth)),  # every block attends per frame
            out_hidden_size=vision.get("hidden_size", text.hidden_size),
            tokens_per_second=None,
            rope_theta=(vision.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            hidden_act=vision.get("hidden_act", "quick_gelu"),
        ),
    )


def parse_qwen3_vl(raw: dict, preprocessor: dict) -> ModelConfig:
    """Qwen3-VL (dense): a Qwen3 decoder (q/k norms, interleaved M-RoPE) and a ViT with learned positions, no
    windows, and DeepStack features from a few of its blocks; videos with their frames' times as text."""
    keys = text_keys(raw)
    text = parse_text(keys, mrope=True, attention_bias=None, qk_norm=True)
    vision = raw.get("vision_config") or {}
    depth, patch, merge = vision.get("depth", 27), vision.get("patch_size", 16), vision.get("spatial_merge_size", 2)
    config = qwen_model_config(
        raw,
        preprocessor,
        text,
        VisionConfig(
            depth=depth,
            hidden_size=vision.get("hidden_size", 1152),
            intermediate_size=vision.get("intermediate_size", 4304),
            num_heads=vision.get("num_heads", 16),
            in_channels=vision.get("in_channels", 3),
            patch_size=patch,
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            spatial_merge_size=merge,
            window_size=patch * merge,
            fullatt_block_indexes=tuple(range(depth)),  # every block attends over whole frames
            out_hidden_size=vision.get("out_hidden_size", text.hidden_size),
            tokens_per_second=None,
            rope_theta=(vision.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
            patch_bias=True,
            num_position_embeddings=vision.get("num_position_embeddings", 2304),
            deepstack_indexes=tuple(vision.get("deepstack_visual_indexes", (8, 16, 24))),
        ),
    )
    video = TimestampedVideoOptions.from_preprocessor(preprocessor.get("video_preprocessor") or {})
    return dataclasses.replace(config, video=video)


def parse_qwen3_vl_moe(raw: dict, preprocessor: dict) -> ModelConfig:
    """Qwen3-VL-MoE: Qwen3-VL with experts in place of the MLP of every `decoder_sparse_step`-th layer that
    `mlp_only_layers` does not name."""
    config = parse_qwen3_vl(raw, preprocessor)
    hub_layout = int(str(raw.get("transformers_version", "5")).split(".")[0]) < 5
    moe = moe_config(text_keys(raw), config.text.num_layers, hub_layout)
    return dataclasses.replace(config, text=dataclasses.replace(config.text, moe=moe))


# ------------------------------------------------------------------------------------------------------ LLaVA

LLAMA_DEFAULTS = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=2048,
)
CLIP_DEFAULTS = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    image_size=224,
    patch_size=32,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    num_channels=3,
)
LLAVA_VISION = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    image_size=336,
    patch_size=14,
)  # LlavaConfig's tower when config.json names none


def parse_llava(raw: dict, preprocessor: dict) -> ModelConfig:
    text_raw = text_keys(raw)
    mlp_bias = bool(text_raw.get("mlp_bias", False))
    text = parse_text(text_raw, mrope=False, attention_bias=None, defaults=LLAMA_DEFAULTS, mlp_bias=mlp_bias)
    given = raw.get("vision_config")
    vision = {**CLIP_DEFAULTS, **(LLAVA_VISION if given is None else {}), **(given or {})}
    layer, strategy = raw.get("vision_feature_layer", -2), raw.get("vision_feature_select_strategy", "default")
    if not isinstance(layer, int) or strategy != "default":
        raise ValueError(
            f"vision_feature_layer {layer!r} with select strategy {strategy!r} is not supported: fovea "
            "runs one feature layer with the class token dropped ('default')"
        )
    layers = vision["num_hidden_layers"]
    used = layer if layer >= 0 else layers + 1 + layer  # hidden_states[0] is the embeddings' output
    if not 0 < used <= layers:
        raise ValueError(f"vision_feature_layer {layer} is outside the tower's {layers} layers")
    side, patch = vision["image_size"], vision["patch_size"]
    if side % patch:
        raise ValueError(f"the vision tower's image_size {side} is not a multiple of its patch_size {patch}")
    image_token = raw.get("image_token_id", raw.get("image_token_index", 32000))
    return ModelConfig(
        architecture="LlavaForConditionalGeneration",
        text=text,
        vision=dataclasses.replace(
            fixed_size_tower(vision, used, text.hidden_size),
            projector_act=raw.get("projector_hidden_act", "gelu"),
            projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        ),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        torch_dtype=checkpoint_dtype(raw),
        image_token_id=image_token,
        video_token_id=None,
        vision_start_token_id=None,
        vision_end_token_id=None,
        eos_token_ids=eos_ids(text_raw.get("eos_token_id")),
        image=ImageProcessorConfig.center_crop(preprocessor, patch, side),
        mrope=False,
    )


PARSERS = {
    "Qwen2_5_VLForConditionalGeneration": parse_qwen2_5_vl,
    "Qwen3VLForConditionalGeneration": parse_qwen3_vl,
    "Qwen3VLMoeForConditionalGeneration": parse_qwen3_vl_moe,
    "Qwen2VLForConditionalGeneration": parse_qwen2_vl,
    "LlavaForConditionalGeneration": parse_llava,
    "Gemma3ForConditionalGeneration": parse_gemma3,
    "InternVLForConditionalGeneration": parse_internvl,
    "InternVLChatModel": parse_internvl_chat,
}
