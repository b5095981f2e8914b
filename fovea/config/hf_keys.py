"""The helpers every family's config.json parser shares (families.py, gemma3.py, internvl.py here): where the
language model's keys are, its decoder settings, the checkpoint's dtype and EOS tokens, a fixed-size ViT's settings.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from fovea.config.model import MoEConfig, RopeScaling, TextConfig, VisionConfig, read_json, resolve_dtype


def text_keys(raw: dict) -> dict:
    """The language model's keys: transformers 5 and LLaVA nest them under text_config (a null there leaves the
    top level's value)."""
    return {**raw, **{k: v for k, v in (raw.get("text_config") or {}).items() if v is not None}}


def parse_text(
    raw: dict,
    mrope: bool,
    attention_bias: bool | None,
    defaults: dict | None = None,
    qk_norm: bool = False,
    window_layers: int | None = None,
    mlp_bias: bool = False,
) -> TextConfig:
    """A decoder's settings from its (text_keys) dict; `defaults` for keys the checkpoint leaves out.
    `attention_bias`: the family's rule for q/k/v biases, none on o_proj (Qwen2: always); None: the config's
    attention_bias, on all four (Llama, Qwen3). `window_layers`: where the decoder reads Qwen2's sliding-window
    keys (transformers ignores them elsewhere), the family's default max_window_layers: with use_sliding_window,
    the layers from there on (or those layer_types names) see only their last sliding_window keys."""
    raw = {**(defaults or {}), **{k: v for k, v in raw.items() if v is not None}}
    output_bias = attention_bias is None and bool(raw.get("attention_bias", False))
    attention_bias = output_bias if attention_bias is None else attention_bias
    window, sliding = None, ()
    if window_layers is not None and raw.get("use_sliding_window") and raw.get("sliding_window"):
        first = raw.get("max_window_layers", window_layers)
        kinds = raw.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(raw["num_hidden_layers"])
        ]
        window, sliding = raw["sliding_window"], tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    scaling = parse_rope_scaling(rope, raw)
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    if mrope:
        section = rope.get("mrope_section")
        if section is None or len(section) != 3:
            raise ValueError(f"config has no 3-axis mrope_section in rope_scaling/rope_parameters: {rope}")
        if 2 * sum(section) != head_dim:
            raise ValueError(f"mrope_section {section} must sum to head_dim/2 = {head_dim // 2}")
    else:
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
        output_bias=output_bias,
        mlp_bias=mlp_bias,
        qk_norm=qk_norm,
        mrope_interleaved=bool(mrope and rope.get("mrope_interleaved", False)),
        rope_scaling=scaling,
        sliding_window=window,
        sliding_layers=sliding,
        hidden_act=raw.get("hidden_act", "silu"),
    )


ROPE_KINDS = ("default", "linear", "yarn", "llama3")


def moe_config(keys: dict, num_layers: int, hub_layout: bool = False) -> MoEConfig:
    """A Qwen3-MoE decoder's experts (Qwen3-VL-MoE's, InternVL3.5's): in every `decoder_sparse_step`-th layer
    that `mlp_only_layers` does not name."""
    experts = keys.get("num_experts") or keys.get("num_local_experts") or 0  # transformers 5 writes the latter
    step, dense = keys.get("decoder_sparse_step", 1), set(keys.get("mlp_only_layers") or ())
    return MoEConfig(
        num_experts=experts,
        top_k=keys.get("num_experts_per_tok", 8),
        intermediate_size=keys["moe_intermediate_size"],
        sparse_layers=tuple(i for i in range(num_layers) if experts and i not in dense and (i + 1) % step == 0),
        norm_topk_prob=keys.get("norm_topk_prob", True),
        hub_layout=hub_layout,
    )


GPT_OSS_DEFAULTS = dict(  # GptOssConfig's, for the keys a config.json leaves out
    attention_bias=True,
    rms_norm_eps=1e-5,
    sliding_window=128,
    rope_theta=150000.0,
    num_local_experts=128,
    num_experts_per_tok=4,
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
    rope_scaling=dict(
        rope_type="yarn",
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=4096,
    ),
)


def gpt_oss_text(keys: dict) -> TextConfig:
    """GPT-OSS's decoder (InternVL3.5-GPT-OSS-20B-A4B's): Llama's layers with biases on q/k/v and o, a learned sink
    logit per head, the layers `layer_types` names (every other one by default) seeing only their last
    `sliding_window` keys, and experts for every layer's MLP (`intermediate_size` is one expert's width)."""
    keys = {**GPT_OSS_DEFAULTS, **{key: value for key, value in keys.items() if value is not None}}
    text = parse_text(keys, False, None)
    layers = range(text.num_layers)
    kinds = keys.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in layers]
    moe = MoEConfig(
        num_experts=keys["num_local_experts"],
        top_k=keys["num_experts_per_tok"],
        intermediate_size=keys["intermediate_size"],
        sparse_layers=tuple(layers),
        norm_topk_prob=True,  # a softmax over the top-k logits: the same weights
        hub_layout=True,  # stored (E, in, out), as x @ W
        router_bias=True,
        expert_bias=True,
        interleaved=True,
        swiglu=(float(keys["swiglu_alpha"]), float(keys["swiglu_limit"])),
    )
    sliding = tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    return dataclasses.replace(
        text, sliding_window=keys["sliding_window"], sliding_layers=sliding, attention_sinks=True, moe=moe
    )


def parse_rope_scaling(rope: dict, raw: dict) -> RopeScaling:
    """`rope`: a decoder's rope_scaling or rope_parameters; `raw`: its keys. The defaults are transformers'."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    kind = "default" if kind == "mrope" else kind  # (the older Qwen2-VL configs' name for plain M-RoPE)
    if kind not in ROPE_KINDS:
        raise ValueError(f"rope scaling {kind!r} is not supported; fovea runs {', '.join(ROPE_KINDS)}")
    if kind == "default":
        return RopeScaling()
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("RoPE over part of each head (partial_rotary_factor) is not supported")
    original = (
        raw.get("original_max_position_embeddings")  # (a top-level value wins, as in transformers)
        or rope.get("original_max_position_embeddings")
        or raw.get("max_position_embeddings", 128000)
    )
    factor = rope.get("factor")
    if factor is None and kind == "yarn":
        factor = raw.get("max_position_embeddings", 128000) / original
    needed = ("factor",) + (("low_freq_factor", "high_freq_factor") if kind == "llama3" else ())
    missing = [key for key in needed if {**rope, "factor": factor}.get(key) is None]
    if missing:
        raise ValueError(f"{kind} rope scaling needs {', '.join(missing)}: {rope}")
    if factor <= 0:
        raise ValueError(f"rope scaling factor must be positive, got {factor}")
    return RopeScaling(
        kind,
        float(factor),
        int(original),
        rope.get("attention_factor"),
        float(rope.get("beta_fast") or 32),
        float(rope.get("beta_slow") or 1),
        rope.get("mscale"),
        rope.get("mscale_all_dim"),
        bool(rope.get("truncate", True)),
        float(rope.get("low_freq_factor", 1.0)),
        float(rope.get("high_freq_factor", 4.0)),
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
