"""How each family's config.json (and preprocessor_config.json) becomes a `ModelConfig`: one parser per
architecture, as transformers keeps a configuration file beside each modeling file.

Checkpoints come in two on-disk forms: the flat one of the published Qwen checkpoints (`rope_scaling: {type: mrope,
mrope_section}`, `vision_config.in_chans`) and the nested one transformers 5 writes (`text_config`,
`rope_parameters`, `vision_config.in_channels`, `dtype`). Published llava-hf checkpoints leave most keys to the
defaults of transformers' LlamaConfig and CLIPVisionConfig, so those defaults are part of the format. Adding a model
is a parser here and its module under fovea/models/ (registry.py there names it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from fovea.config.image import ImageProcessorConfig
from fovea.config.model import ModelConfig, MoEConfig, TextConfig, VisionConfig, read_json, resolve_dtype
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
    quant = parse_quant_config(raw.get("quantization_config") or text_keys(raw).get("quantization_config"))
    if quant is None:
        return config
    if config.text.moe is not None:
        raise ValueError(f"{quant.source} quantized MoE experts are not supported yet (dense models only)")
    return dataclasses.replace(config, text=dataclasses.replace(config.text, quant=quant))


# ------------------------------------------------------------------------------------------- shared helpers


def text_keys(raw: dict) -> dict:
    """The language model's keys: transformers 5 and LLaVA nest them under text_config (a null there leaves the
    top level's value)."""
    return {**raw, **{k: v for k, v in (raw.get("text_config") or {}).items() if v is not None}}


def parse_text(
    raw: dict, mrope: bool, attention_bias: bool, defaults: dict | None = None, qk_norm: bool = False
) -> TextConfig:
    """A decoder's settings from its (text_keys) dict; `defaults` for keys the checkpoint leaves out."""
    raw = {**(defaults or {}), **{k: v for k, v in raw.items() if v is not None}}
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    if mrope:
        section = rope.get("mrope_section")
        if section is None or len(section) != 3:
            raise ValueError(f"config has no 3-axis mrope_section in rope_scaling/rope_parameters: {rope}")
        if 2 * sum(section) != head_dim:
            raise ValueError(f"mrope_section {section} must sum to head_dim/2 = {head_dim // 2}")
    else:
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"rope scaling {rope} is not supported; fovea runs the default RoPE")
        section = (head_dim // 2, 0, 0)  # every frequency reads the first position axis: 1-D RoPE
    return TextConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", raw.get("rope_theta", 1e6)),
        mrope_section=tuple(section),
        max_position_embeddings=raw.get("max_position_embeddings", 128000),
        attention_bias=attention_bias,
        qk_norm=qk_norm,
        mrope_interleaved=bool(mrope and rope.get("mrope_interleaved", False)),
    )


def checkpoint_dtype(raw: dict) -> torch.dtype:
    text = raw.get("text_config") or {}
    return resolve_dtype(
        raw.get("torch_dtype") or raw.get("dtype") or text.get("torch_dtype") or text.get("dtype") or "bfloat16"
    )


def eos_ids(eos) -> tuple[int, ...]:
    """An eos_token_id field as ids: an int, a list of them, or nothing (null, missing, an empty list)."""
    values = eos if isinstance(eos, list) else [eos]
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool))


def eos_from_files(model_dir: Path) -> tuple[int, ...]:
    """generation_config.json's eos_token_id, else the tokenizer's eos_token looked up in its files."""
    found = eos_ids(read_json(model_dir / "generation_config.json").get("eos_token_id"))
    if found:
        return found
    token = read_json(model_dir / "tokenizer_config.json").get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    token_id = token_id_in_files(model_dir, token) if isinstance(token, str) else None
    return () if token_id is None else (token_id,)


def token_id_in_files(model_dir: Path, token: str) -> int | None:
    """A token's id as the tokenizer's files give it (tokenizer_config.json's added tokens, tokenizer.json's)."""
    for token_id, added in (read_json(model_dir / "tokenizer_config.json").get("added_tokens_decoder") or {}).items():
        if isinstance(added, dict) and added.get("content") == token:
            return int(token_id)
    vocabulary = read_json(model_dir / "tokenizer.json")
    for added in vocabulary.get("added_tokens") or []:
        if added.get("content") == token:
            return added["id"]
    token_id = ((vocabulary.get("model") or {}).get("vocab") or {}).get(token)
    return token_id if isinstance(token_id, int) else None


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


def parse_qwen2_5_vl(raw: dict, preprocessor: dict) -> ModelConfig:
    text = parse_text(text_keys(raw), mrope=True, attention_bias=True)
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
    text = parse_text(text_keys(raw), mrope=True, attention_bias=True)
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
    text = parse_text(keys, mrope=True, attention_bias=bool(keys.get("attention_bias", False)), qk_norm=True)
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
    keys = text_keys(raw)
    experts = keys.get("num_experts") or keys.get("num_local_experts") or 0  # transformers 5 writes the latter
    step, dense = keys.get("decoder_sparse_step", 1), set(keys.get("mlp_only_layers") or ())
    layers = config.text.num_layers
    moe = MoEConfig(
        num_experts=experts,
        top_k=keys.get("num_experts_per_tok", 8),
        intermediate_size=keys["moe_intermediate_size"],
        sparse_layers=tuple(i for i in range(layers) if experts and i not in dense and (i + 1) % step == 0),
        norm_topk_prob=keys.get("norm_topk_prob", True),
        hub_layout=int(str(raw.get("transformers_version", "5")).split(".")[0]) < 5,
    )
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


def fixed_size_tower(vision: dict, depth: int, out_hidden_size: int, merge: int = 1) -> VisionConfig:
    """A ViT that takes one image size, with transformers' CLIP and SigLIP keys: no windows, no rotary positions;
    `merge`: the side of the patches that make one image token (LLaVA 1, Gemma 3's pooling 4)."""
    return VisionConfig(
        depth=depth,
        hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"],
        num_heads=vision["num_attention_heads"],
        in_channels=vision["num_channels"],
        patch_size=vision["patch_size"],
        temporal_patch_size=1,
        spatial_merge_size=merge,
        window_size=0,
        fullatt_block_indexes=(),
        out_hidden_size=out_hidden_size,
        tokens_per_second=None,
        rope_theta=0.0,
        hidden_act=vision["hidden_act"],
        norm_eps=vision["layer_norm_eps"],
        image_size=vision["image_size"],
    )


def parse_llava(raw: dict, preprocessor: dict) -> ModelConfig:
    text_raw = text_keys(raw)
    text = parse_text(
        text_raw, mrope=False, attention_bias=bool(text_raw.get("attention_bias", False)), defaults=LLAMA_DEFAULTS
    )
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
        vision=fixed_size_tower(vision, used, text.hidden_size),
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


# ---------------------------------------------------------------------------------------------------- Gemma 3

GEMMA3_TEXT = dict(  # Gemma3TextConfig's defaults: published config.json files leave most keys to them
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131_072,
    rms_norm_eps=1e-6,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    attention_bias=False,
)
SIGLIP_DEFAULTS = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_channels=3,
    image_size=224,
    patch_size=16,
    hidden_act="gelu_pytorch_tanh",
    layer_norm_eps=1e-6,
)


def gemma3_rope(text: dict) -> tuple[float, float, float]:
    """(global theta, its linear factor, local theta) from `rope_parameters` per layer type (transformers 5) or
    the older `rope_scaling` + `rope_theta` + `rope_local_base_freq`."""
    per_type = text.get("rope_parameters") or {}
    scaling = per_type.get("full_attention") or text.get("rope_scaling") or {}
    local = per_type.get("sliding_attention") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ValueError(f"Gemma 3 rope scaling {scaling} is not supported; fovea runs default and linear")
    factor = float(scaling.get("factor", 1.0)) if kind == "linear" else 1.0
    theta = scaling.get("rope_theta", text.get("rope_theta", 1_000_000.0))
    return theta, factor, local.get("rope_theta", text.get("rope_local_base_freq", 10_000.0))


def parse_gemma3(raw: dict, preprocessor: dict) -> ModelConfig:
    """Gemma 3: a SigLIP tower, its patches average-pooled to `mm_tokens_per_image` tokens, and a Gemma decoder
    whose layers mostly see a sliding window (every `sliding_window_pattern`-th sees all); 1-D RoPE."""
    text_raw = {**GEMMA3_TEXT, **{k: v for k, v in (raw.get("text_config") or {}).items() if v is not None}}
    if text_raw.get("final_logit_softcapping") or text_raw.get("attn_logit_softcapping"):
        raise ValueError("Gemma 3 with logit soft-capping is not supported (the released checkpoints have none)")
    if text_raw.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with bidirectional text attention (an embedding model) is not supported")
    layers = text_raw["num_hidden_layers"]
    pattern = text_raw.get("sliding_window_pattern") or text_raw.get("_sliding_window_pattern") or 6
    types = text_raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    theta, factor, local_theta = gemma3_rope(text_raw)
    text = dataclasses.replace(
        parse_text({**text_raw, "rope_parameters": None, "rope_scaling": None}, mrope=False, attention_bias=False),
        attention_bias=bool(text_raw["attention_bias"]),
        qk_norm=True,
        rope_theta=theta,
        rope_factor=factor,
        local_rope_theta=local_theta,
        sliding_window=text_raw["sliding_window"],
        sliding_layers=tuple(i for i, kind in enumerate(types) if kind == "sliding_attention"),
        attention_scale=text_raw["query_pre_attn_scalar"] ** -0.5,
        hidden_act=text_raw["hidden_activation"],
    )
    vision = {**SIGLIP_DEFAULTS, **(raw.get("vision_config") or {})}
    side, patch = vision["image_size"], vision["patch_size"]
    tokens = raw.get("mm_tokens_per_image", 256)
    pool = side // patch // round(tokens**0.5)
    if side % patch or pool * pool * tokens != (side // patch) ** 2:
        raise ValueError(f"a {side} px image in {patch} px patches does not pool to {tokens} tokens")
    return ModelConfig(
        architecture="Gemma3ForConditionalGeneration",
        text=text,
        vision=fixed_size_tower(vision, vision["num_hidden_layers"], text.hidden_size, merge=pool),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", True))),
        torch_dtype=checkpoint_dtype(raw),
        image_token_id=raw.get("image_token_id", raw.get("image_token_index", 262_144)),
        video_token_id=None,
        vision_start_token_id=raw.get("boi_token_id", raw.get("boi_token_index", 255_999)),
        vision_end_token_id=raw.get("eoi_token_id", raw.get("eoi_token_index", 256_000)),
        eos_token_ids=eos_ids(raw.get("eos_token_id", text_raw.get("eos_token_id"))),
        image=ImageProcessorConfig.fixed_size(preprocessor, patch, side, pool),
        mrope=False,
        bidirectional_images=True,
        image_placeholder_id=raw.get("boi_token_id", raw.get("boi_token_index", 255_999)),
    )


# --------------------------------------------------------------------------------------------------- InternVL

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
# the language models InternVL checkpoints end in: (q/k/v biases, q/k norms) by text_config's model_type
INTERNVL_DECODERS = {"qwen2": (True, False), "qwen3": (None, True), "llama": (None, False)}


def parse_internvl(raw: dict, preprocessor: dict) -> ModelConfig:
    """InternVL (2.5, 3, 3.5 as transformers converts them, "-hf"): an InternViT tower over 448 px tiles, each
    tile's 32 x 32 patch features pixel-shuffled 2 x 2 into 256 tokens through an MLP projector, and a Qwen2, Qwen3
    or Llama decoder; 1-D RoPE. Each image's tokens sit between <img> and </img>, which the processor adds."""
    text_raw = raw.get("text_config") or {}
    kind = text_raw.get("model_type", "qwen2")
    if kind not in INTERNVL_DECODERS:
        raise ValueError(f"InternVL with a {kind!r} language model is not supported; fovea runs qwen2, qwen3, llama")
    if text_raw.get("use_sliding_window"):
        raise ValueError("InternVL's language model with sliding-window attention is not supported")
    bias, qk_norm = INTERNVL_DECODERS[kind]
    bias = bool(text_raw.get("attention_bias", False)) if bias is None else bias
    text = parse_text(text_keys(raw), mrope=False, attention_bias=bias, qk_norm=qk_norm)
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
    )


# InternVL's own uploads (remote code, `InternVLChatModel`): their config keys -> transformers' InternVLConfig's
INTERNVL_CHAT_DECODERS = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
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
