"""config.json of the tiny Qwen2.5-VL and Qwen2-VL checkpoints (and of the published 7B shapes), in the flat
published form or the transformers-5 form; tiny.py writes them with their weights and tokenizer.
"""

from __future__ import annotations

# name -> (text: hidden, intermediate, layers, heads, kv_heads, mrope_section, vocab, tied;
#          vision: hidden, intermediate, depth, heads, fullatt_block_indexes)
# fmt: off
TINY_SHAPES = {
    "tiny-3b": dict(hidden=64, inter=128, layers=2, heads=4, kv=2, mrope=[2, 3, 3], vocab=151936, tied=True,
                    v_hidden=32, v_inter=64, v_depth=3, v_heads=2, v_full=[2]),
    "tiny-7b": dict(hidden=96, inter=160, layers=3, heads=4, kv=1, mrope=[4, 4, 4], vocab=152064, tied=False,
                    v_hidden=48, v_inter=80, v_depth=4, v_heads=4, v_full=[1, 3]),
    # the CPU benchmark's bigger model (benchmarks/cpu_vs_hf.py): the real vocabulary, a 512-wide 6-layer decoder
    "cpu-512": dict(hidden=512, inter=1536, layers=6, heads=8, kv=2, mrope=[8, 12, 12], vocab=151936, tied=True,
                    v_hidden=128, v_inter=256, v_depth=4, v_heads=4, v_full=[3]),
    # Qwen2.5-VL-7B's exact shapes (random weights): what the GPU benchmarks serve, no download being possible
    "qwen2.5-vl-7b": dict(hidden=3584, inter=18944, layers=28, heads=28, kv=4, mrope=[16, 24, 24], vocab=152064,
                          tied=False, v_hidden=1280, v_inter=3420, v_depth=32, v_heads=16, v_full=[7, 15, 23, 31]),
    # Qwen2-VL (v_inter is mlp_ratio x v_hidden; no windows)
    "tiny-qwen2-vl": dict(hidden=64, inter=128, layers=2, heads=4, kv=2, mrope=[2, 3, 3], vocab=151936, tied=True,
                          v_hidden=32, v_inter=128, v_depth=2, v_heads=2, v_full=None),
    "qwen2-vl-7b": dict(hidden=3584, inter=18944, layers=28, heads=28, kv=4, mrope=[16, 24, 24], vocab=152064,
                        tied=False, v_hidden=1280, v_inter=5120, v_depth=32, v_heads=16, v_full=None),
}
# fmt: on


def tiny_config(name: str = "tiny-3b", dtype: str = "float32") -> dict:
    """A config.json in the flat form of the published Qwen2.5-VL-3B/7B checkpoints."""
    s = TINY_SHAPES[name]
    return (
        {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "model_type": "qwen2_5_vl",
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "vision_start_token_id": 151652,
            "vision_end_token_id": 151653,
            "vision_token_id": 151654,
            "image_token_id": 151655,
            "video_token_id": 151656,
            "hidden_act": "silu",
            "hidden_size": s["hidden"],
            "initializer_range": 0.02,
            "intermediate_size": s["inter"],
            "max_position_embeddings": 128000,
            "max_window_layers": s["layers"],
            "num_attention_heads": s["heads"],
            "num_hidden_layers": s["layers"],
            "num_key_value_heads": s["kv"],
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "sliding_window": 32768,
            "tie_word_embeddings": s["tied"],
            "torch_dtype": dtype,
            "transformers_version": "4.49.0",
            "use_cache": True,
            "use_sliding_window": False,
            "vision_config": {
                "depth": s["v_depth"],
                "hidden_act": "silu",
                "hidden_size": s["v_hidden"],
                "intermediate_size": s["v_inter"],
                "num_heads": s["v_heads"],
                "in_chans": 3,
                "out_hidden_size": s["hidden"],
                "patch_size": 14,
                "spatial_merge_size": 2,
                "spatial_patch_size": 14,
                "window_size": 112,
                "fullatt_block_indexes": s["v_full"],
                "tokens_per_second": 2,
                "temporal_patch_size": 2,
            },
            "rope_scaling": {"type": "mrope", "mrope_section": s["mrope"]},
            "vocab_size": s["vocab"],
        }
        if s["v_full"] is not None
        else qwen2_vl_config(tiny_config("tiny-3b", dtype), s)
    )


def qwen2_vl_config(qwen25: dict, s: dict) -> dict:
    """Qwen2-VL's published config.json: Qwen2.5-VL's text keys, its own vision keys."""
    text = {k: v for k, v in qwen25.items() if k not in ("vision_config", "max_window_layers")}
    text.update(
        architectures=["Qwen2VLForConditionalGeneration"],
        model_type="qwen2_vl",
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_hidden_layers=s["layers"],
        max_window_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"],
        tie_word_embeddings=s["tied"],
        vocab_size=s["vocab"],
        rope_scaling={"type": "mrope", "mrope_section": s["mrope"]},
    )
    text["vision_config"] = {
        "depth": s["v_depth"],
        "embed_dim": s["v_hidden"],
        "hidden_size": s["hidden"],
        "mlp_ratio": s["v_inter"] // s["v_hidden"],
        "num_heads": s["v_heads"],
        "in_chans": 3,
        "hidden_act": "quick_gelu",
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return text


def to_transformers5_config(flat: dict) -> dict:
    """The same model in the nested form transformers 5 writes (text_config, rope_parameters, dtype)."""
    top_keys = {
        "architectures",
        "model_type",
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "vision_token_id",
        "tie_word_embeddings",
        "transformers_version",
        "vision_config",
    }
    text = {k: v for k, v in flat.items() if k not in top_keys | {"rope_scaling", "rope_theta", "torch_dtype"}}
    text.update(
        model_type="qwen2_5_vl_text",
        dtype=flat["torch_dtype"],
        rope_parameters={**flat["rope_scaling"], "rope_type": "default", "rope_theta": flat["rope_theta"]},
    )
    vision = {k: v for k, v in flat["vision_config"].items() if k != "in_chans"}
    vision.update(
        in_channels=flat["vision_config"]["in_chans"],
        model_type="qwen2_5_vl_vision",
        rope_parameters={"rope_theta": 10000.0, "rope_type": "axial"},
    )
    out = {k: v for k, v in flat.items() if k in top_keys}
    out.update(dtype=flat["torch_dtype"], text_config=text, vision_config=vision, transformers_version="5.0.0")
    return out
