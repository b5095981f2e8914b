"""Tiny random-weight Qwen3-VL checkpoints, written by transformers' own Qwen3VLForConditionalGeneration
(`save_pretrained`): config.json and model.safetensors exactly as transformers writes them today, with Qwen3's
vocabulary (tiny.py's, with <think> and </think>), a Qwen2-VL-style preprocessor_config.json (16-pixel patches, mean and
std 0.5, as the released ones), the released video_preprocessor_config.json, and Qwen3-VL's chat template (the
Instruct models' format: fovea/models/qwen3_vl_chat_template.jinja).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fovea.testing.tiny import write_tokenizer_files

# fmt: off
QWEN3_VL_SHAPES = {
    # head_dim 16: mrope_section sums to 8; interleaved, frequencies 1, 4 read h and 2, 5 read w
    "tiny-qwen3-vl": (
        dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
             rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 3, 3],
                              "mrope_interleaved": True}),
        # an 8 x 8 position table, resampled to every grid; DeepStack from the first and the last block
        dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, temporal_patch_size=2,
             spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=64, deepstack_visual_indexes=[0, 2],
             hidden_act="gelu_pytorch_tanh"),
    ),
}
# the MoE variant: 6 experts of width 24, 2 per token; layer 1 keeps a dense MLP (mlp_only_layers)
QWEN3_VL_SHAPES["tiny-qwen3-vl-moe"] = (
    {**QWEN3_VL_SHAPES["tiny-qwen3-vl"][0], "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
     "decoder_sparse_step": 1, "mlp_only_layers": [1]},
    QWEN3_VL_SHAPES["tiny-qwen3-vl"][1],
)
# The released shapes (random weights), for GPU measurements where no download is possible: Qwen3-VL-8B and -32B
# (Qwen3-8B / -32B decoders), Qwen3-VL-30B-A3B (Qwen3-30B-A3B's: 128 experts, 8 per token); SigLIP2-so400m towers.
SO400M = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, temporal_patch_size=2,
              spatial_merge_size=2, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
              hidden_act="gelu_pytorch_tanh")
ROPE = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
QWEN3_VL_SHAPES["qwen3-vl-8b"] = (
    dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
         num_key_value_heads=8, head_dim=128, max_position_embeddings=262144, rope_parameters=ROPE),
    {**SO400M, "out_hidden_size": 4096},
)
QWEN3_VL_SHAPES["qwen3-vl-32b"] = (
    dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
         num_key_value_heads=8, head_dim=128, max_position_embeddings=262144, rope_parameters=ROPE),
    {**SO400M, "out_hidden_size": 5120},
)
QWEN3_VL_SHAPES["qwen3-vl-30b-a3b"] = (
    dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
         num_key_value_heads=4, head_dim=128, max_position_embeddings=262144, rope_parameters=ROPE, num_experts=128,
         num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[]),
    {**SO400M, "out_hidden_size": 2048},
)
# fmt: on


def hf_config(name: str):
    """transformers' config object of a shape (Qwen3VLMoeConfig when it has experts)."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    text, vision = QWEN3_VL_SHAPES[name]
    return (Qwen3VLMoeConfig if "num_experts" in text else Qwen3VLConfig)(
        text_config=text, vision_config=vision, tie_word_embeddings=False
    )


# the released models' video_preprocessor_config.json: one area bound for all of a video's frames together
VIDEO_PREPROCESSOR = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "processor_class": "Qwen3VLProcessor",
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "fps": 2,
    "min_frames": 4,
    "max_frames": 768,
    "do_sample_frames": True,
}


def preprocessor_config(min_pixels: int = 32 * 32 * 4, max_pixels: int = 32 * 32 * 256) -> dict:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_resize": True,
        "do_convert_rgb": True,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
    }


def write_qwen3_vl_checkpoint(
    out_dir: str | Path,
    name: str = "tiny-qwen3-vl",
    *,
    seed: int = 0,
    dtype: str = "float32",
    layout: str = "published",
    shards: int = 1,
    device: str = "cpu",
) -> Path:
    """Every weight random (norms around 1, so that a norm read wrongly shows in the logits). The published
    layout is transformers 5's (`model.language_model.*`, `model.visual.*`): `layout` may name either."""
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    if layout not in ("published", "transformers5"):
        raise ValueError(f"layout must be 'published' or 'transformers5', got {layout!r}")
    if shards != 1:
        raise ValueError("Qwen3-VL's checkpoints are written by save_pretrained, whole (--shards 1)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    moe = "num_experts" in QWEN3_VL_SHAPES[name][0]
    torch.manual_seed(seed)
    with torch.device(device):  # the released shapes: draw on the GPU (--device cuda), tens of GB in fp32
        model = (Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration)(hf_config(name))
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            noise = torch.randn_like(param)
            param.copy_(1 + 0.2 * noise if "norm" in param_name else 0.08 * noise)
    model.eval().to(getattr(torch, dtype)).save_pretrained(out)
    write_tokenizer_files(out, qwen3=True)
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2))
    (out / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR, indent=2))
    return out
