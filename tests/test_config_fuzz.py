"""Parity on configurations we did not choose: for every family, random but valid configurations (the ranges
below, scaled down from the released checkpoints'), written by the installed transformers' own `save_pretrained`,
against transformers: logits (fp32, within 1e-4 of transformers' float64 ones: `parity`) and greedy tokens through
the engine, for text, one image and two images of odd sizes, and (the Qwen families) an image then a video of an
odd frame count. The engine's own settings are drawn too (`engine_options`: block size, a step budget that cuts
prompts and images into chunks, sequences at a time, prefix caching, the step order, a cache small enough to preempt,
two tensor-parallel ranks); a quarter of the draws have their decoder quantized (`quantize_drawn`: fp8 blocks, fp8 per
tensor or AWQ, against transformers on the dequantized copy), and every KV
block the engine takes afresh holds noise (`poison_fresh_blocks`). The seed is
fixed for a run and printed with every failure (FOVEA_FUZZ_SEED repeats one); one draw per family runs by default,
FOVEA_FUZZ_DRAWS more (the `extended` marker's tier, FOVEA_EXTENDED=1, runs 4).

What is drawn, per family:
- every decoder: 1-3 layers; 2 or 4 attention heads of 8, 16 or 32 dimensions; KV heads any divisor (GQA, MQA or
  none); MLP width 48-160, its gate SiLU or a GELU; tied or untied embeddings; rope theta 1e4 or 1e6, scaled half
  the time (linear, YaRN or Llama 3's, factors 2-8); the M-RoPE sections any split of half the head dimension into
  three (Qwen families); biases where the family's config can ask for them (Llama's attention and MLP biases,
  Qwen3's attention ones); Qwen2 decoders' sliding windows (4-64 keys from a drawn layer on) half the time; the
  norms' epsilon (the decoders', and the CLIP, SigLIP and InternViT towers');
- every bias drawn as the weights are (transformers starts them at zero, where a bias left out would not show);
- Qwen2.5-VL's tower: 1-4 blocks of 1-4 heads of 8 or 16 dimensions, any set of full-attention blocks (none
  too), windows of 56 or 112 pixels, its MLP's gate SiLU or a GELU;
- Qwen2-VL's tower: 1-3 blocks, MLP ratio 2 or 4; its and Qwen3-VL's MLP activation drawn;
- Qwen3-VL's tower: 2-4 blocks, DeepStack from any 1-3 of them, a learned position grid of 4x4, 6x6 or 8x8;
  its MoE variant: 2 or 4 experts of width 16, 20 (not a multiple of 8, so the loop runs, not the grouped products) or
  24, 1 or 2 per token, a sparse step of 1 or 2, any dense (mlp_only) layers;
- LLaVA's CLIP tower: 2-3 layers of 1-4 heads, features from the last or the second-to-last layer; its
  projector's activation and biases;
- Gemma 3: 1-4 decoder layers, every one, every second or every third seeing all keys and the others a window of
  4-64, the scores' scale its own (query_pre_attn_scalar), the global layers' RoPE scaled as any decoder's;
  its SigLIP tower 1-3 layers of 1-4 heads;
- InternVL: a Qwen2, Qwen3, Qwen3-MoE (the experts drawn as Qwen3-VL-MoE's, each expert's matrices stored apart,
  and sliding windows in every layer when on) or GPT-OSS decoder (sinks, biased experts in every layer, a clamped
  SwiGLU, any layers sliding: `gpt_oss`); its InternViT tower 1-3 layers of 1-4 heads, LayerNorm or RMSNorm, q/k/v
  biases or none, q/k norms or none, mean-pooled or with a last norm, features from the last or the second-to-last
  layer, layer scales of 0.1 or 1, tiles of 56 px cut 1-4 or 1-6 at a time (the base's processor).
Weights are drawn wider than transformers' default (initializer_range 0.1): with its 0.02 a model's logits are so
flat that a broken rule can hide; `test_the_fuzzer_sees_a_broken_rule` checks that it does not.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from conftest import hf_inputs
from test_families import (
    MAX_TOKENS,
    conversation,
    forget_hf_models,
    hf_generate,
    hf_logits,
    logits_gap,
    our_logits,
    prompt_logits,
    reference_inputs,
    with_pil,
)
from test_qwen3_vl_video import conversation as video_conversation
from test_qwen3_vl_video import hf_reference as qwen3_video_inputs

from fovea import LLM, SamplingParams
from fovea.config.model import ModelConfig
from fovea.models.loader import load_model
from fovea.multimodal.prompt import PromptProcessor
from fovea.testing.quantize import write_quantized_checkpoint
from fovea.testing.tiny_gemma3 import BOI as GEMMA_BOI
from fovea.testing.tiny_gemma3 import EOI as GEMMA_EOI
from fovea.testing.tiny_gemma3 import IMAGE as GEMMA_IMAGE
from fovea.testing.tiny_gemma3 import VOCAB as GEMMA_VOCAB
from fovea.testing.tiny_internvl import IMG_CONTEXT as INTERNVL_IMAGE
from fovea.testing.tiny_internvl import VOCAB as INTERNVL_VOCAB
from fovea.testing.tiny_llava import IMAGE_TOKEN as LLAVA_IMAGE_TOKEN
from fovea.testing.tiny_llava import LLAVA_SHAPES

LLAVA_VOCAB = LLAVA_SHAPES["tiny-llava"]["vocab"]  # the tiny LLaVA's tokenizer's

SEED = int(os.environ.get("FOVEA_FUZZ_SEED") or random.SystemRandom().randrange(1 << 30))
DRAWS = int(os.environ.get("FOVEA_FUZZ_DRAWS", "1"))
FAMILIES = ["qwen2.5-vl", "qwen2-vl", "qwen3-vl", "qwen3-vl-moe", "llava", "gemma3", "internvl"]
KINDS = ("text", "one_image", "two_images")
INIT = 0.1
EPSILONS = [1e-6, 1e-5, 1e-3]  # the norms' (1e-6 Qwen's, 1e-5 Llama 2's and CLIP's; 1e-3 large enough to show)
TOLERANCE = 1e-4  # on logits, fp32


def sections(rng: random.Random, half: int) -> list[int]:
    """Any split of `half` rotary frequencies into three non-empty M-RoPE sections (t, h, w)."""
    cuts = sorted(rng.sample(range(1, half), 2))
    return [cuts[0], cuts[1] - cuts[0], half - cuts[1]]


def decoder(rng: random.Random, explicit_head_dim: bool = False) -> dict:
    heads, head_dim = rng.choice([2, 4]), rng.choice([8, 16, 32])
    text = dict(
        num_hidden_layers=rng.randint(1, 3),
        num_attention_heads=heads,
        num_key_value_heads=rng.choice([d for d in (1, 2, 4) if heads % d == 0]),
        intermediate_size=rng.choice([48, 96, 160]),
        hidden_size=rng.choice([32, 64, 96]) if explicit_head_dim else heads * head_dim,
        vocab_size=151936,
        max_position_embeddings=4096,
        rms_norm_eps=rng.choice(EPSILONS),
        initializer_range=INIT,
        hidden_act=rng.choice(["silu", "silu", "gelu", "gelu_pytorch_tanh"]),
    )
    if explicit_head_dim:
        text["head_dim"] = head_dim
    return text, head_dim


def rope_scaling(rng: random.Random) -> dict:
    """None half the time; else linear, YaRN or Llama 3's scaling, its parameters drawn (YaRN's context, its
    original length times its factor, holds the engine's 2048 positions)."""
    kind = rng.choice([None, None, "linear", "yarn", "llama3"])
    factor = rng.choice([2.0, 4.0, 8.0])
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": rng.choice([1024, 4096]),
                "beta_fast": rng.choice([16, 32]), "beta_slow": rng.choice([1, 2])}  # fmt: skip
    if kind == "llama3":
        return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": rng.choice([2.0, 4.0]),
                "original_max_position_embeddings": rng.choice([64, 512])}  # fmt: skip
    return {}


def sliding_windows(rng: random.Random, layers: int) -> dict:
    """Qwen2's sliding-window keys, on half the time: the layers from max_window_layers on see a window of 4-64."""
    return dict(use_sliding_window=rng.random() < 0.5, sliding_window=rng.choice([4, 16, 64]),
                max_window_layers=rng.randint(0, layers))  # fmt: skip


def experts(rng: random.Random, layers: int) -> dict:
    """A Qwen3-MoE decoder's experts: 2 or 4 of width 16, 20 (not a multiple of 8: the loop, not the grouped
    products) or 24, 1 or 2 per token, a sparse step of 1 or 2, any dense (mlp_only) layers."""
    count = rng.choice([2, 4])
    return dict(num_experts=count, num_experts_per_tok=min(rng.choice([1, 2]), count),
                moe_intermediate_size=rng.choice([16, 20, 24]), decoder_sparse_step=rng.choice([1, 2]),
                mlp_only_layers=sorted(rng.sample(range(layers), rng.randint(0, layers - 1))))  # fmt: skip


def gpt_oss(rng: random.Random, layers: int) -> dict:
    """GPT-OSS's decoder: each layer sliding (a window of 4-64 keys) or not, 2 or 4 experts of the MLP's width, 1
    or 2 per token, the SwiGLU's clamp 0.5 (it clamps) or 7 and its alpha 1 or 1.702."""
    count = rng.choice([2, 4])
    kinds = [rng.choice(["sliding_attention", "full_attention"]) for _ in range(layers)]
    return dict(num_hidden_layers=layers, layer_types=kinds, sliding_window=rng.choice([4, 16, 64]),
                num_local_experts=count, num_experts_per_tok=min(rng.choice([1, 2]), count),
                swiglu_limit=rng.choice([0.5, 7.0]), swiglu_alpha=rng.choice([1.0, 1.702]))  # fmt: skip


def draw(family: str, rng: random.Random) -> dict:
    """A config.json's content for `family` (transformers' config class takes it as keyword arguments)."""
    tied = rng.random() < 0.5
    if family == "llava":
        text, _ = decoder(rng)
        text.update(model_type="llama", vocab_size=LLAVA_VOCAB, max_position_embeddings=2048,
                    rope_parameters={"rope_type": "default", "rope_theta": rng.choice([1e4, 1e6]), **rope_scaling(rng)},
                    attention_bias=rng.random() < 0.3, mlp_bias=rng.random() < 0.3)  # fmt: skip
        heads, layers = rng.choice([1, 2, 4]), rng.randint(2, 3)
        vision = dict(model_type="clip_vision_model", hidden_size=heads * rng.choice([8, 16]), num_attention_heads=heads,
                      intermediate_size=rng.choice([32, 64]), num_hidden_layers=layers, image_size=336, patch_size=14,
                      layer_norm_eps=rng.choice(EPSILONS), projection_dim=32, initializer_range=INIT,
                      initializer_factor=INIT / 0.02)  # fmt: skip
        return dict(text_config=text, vision_config=vision, vision_feature_layer=rng.choice([-1, -2]),
                    vision_feature_select_strategy="default", image_token_index=LLAVA_IMAGE_TOKEN,
                    projector_hidden_act=rng.choice(["gelu", "gelu_pytorch_tanh", "silu"]),
                    multimodal_projector_bias=rng.random() < 0.7, tie_word_embeddings=tied,
                    initializer_range=INIT)  # fmt: skip
    if family == "gemma3":
        text, head_dim = decoder(rng, explicit_head_dim=True)
        text.update(model_type="gemma3_text", vocab_size=GEMMA_VOCAB, num_hidden_layers=rng.randint(1, 4),
                    sliding_window=rng.choice([4, 8, 16, 64]), sliding_window_pattern=rng.choice([1, 2, 3]),
                    query_pre_attn_scalar=rng.choice([head_dim, 24, 64]), max_position_embeddings=2048,
                    rope_scaling=rope_scaling(rng) or None)  # fmt: skip
        heads = rng.choice([1, 2, 4])
        vision = dict(model_type="siglip_vision_model", hidden_size=heads * rng.choice([8, 16]), num_attention_heads=heads,
                      intermediate_size=rng.choice([32, 64]), num_hidden_layers=rng.randint(1, 3), image_size=56,
                      patch_size=14, vision_use_head=False, layer_norm_eps=rng.choice(EPSILONS),
                      initializer_range=INIT)  # fmt: skip
        return dict(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=GEMMA_IMAGE,
                    boi_token_index=GEMMA_BOI, eoi_token_index=GEMMA_EOI, tie_word_embeddings=tied,
                    initializer_range=INIT)  # fmt: skip
    if family == "internvl":
        kind = rng.choice(["qwen2", "qwen3", "qwen3_moe", "gpt_oss"])
        text, _ = decoder(rng, explicit_head_dim=kind != "qwen2")
        rope = {"rope_type": "default", "rope_theta": rng.choice([1e4, 1e6]), **rope_scaling(rng)}
        text.update(model_type=kind, vocab_size=INTERNVL_VOCAB, rope_parameters=rope,
                    **sliding_windows(rng, text["num_hidden_layers"]))  # fmt: skip
        if kind != "qwen2":
            text["attention_bias"] = rng.random() < 0.3
        if kind == "qwen3_moe":
            text.update(experts(rng, text["num_hidden_layers"]))
        if kind == "gpt_oss":
            text.update(gpt_oss(rng, text.pop("num_hidden_layers")))
            del text["use_sliding_window"], text["max_window_layers"]
        heads, layers = rng.choice([1, 2, 4]), rng.randint(1, 3)
        vision = dict(hidden_size=heads * rng.choice([8, 16]), num_attention_heads=heads, num_hidden_layers=layers,
                      intermediate_size=rng.choice([32, 64]), image_size=56, patch_size=14,
                      norm_type=rng.choice(["layer_norm", "rms_norm"]), attention_bias=rng.random() < 0.5,
                      use_qk_norm=rng.random() < 0.5, use_mean_pooling=rng.random() < 0.5,
                      layer_scale_init_value=rng.choice([0.1, 1.0]), layer_norm_eps=rng.choice(EPSILONS),
                      initializer_range=INIT)  # fmt: skip
        return dict(text_config=text, vision_config=vision, image_token_id=INTERNVL_IMAGE, image_seq_length=4,
                    vision_feature_layer=rng.choice([-1, -2]) if layers > 1 else -1, tie_word_embeddings=tied,
                    initializer_range=INIT)  # fmt: skip
    qwen3 = family.startswith("qwen3")
    text, head_dim = decoder(rng, explicit_head_dim=qwen3)
    rope = dict(rope_type="default", rope_theta=rng.choice([1e4, 1e6]), mrope_section=sections(rng, head_dim // 2))
    rope.update(rope_scaling(rng))
    if qwen3:
        rope["mrope_interleaved"] = True
        text["attention_bias"] = rng.random() < 0.3
    else:
        text.update(sliding_windows(rng, text["num_hidden_layers"]))
    text["rope_parameters"] = rope
    heads = rng.choice([1, 2, 4])
    width = heads * rng.choice([8, 16])
    if family == "qwen2.5-vl":
        depth = rng.randint(1, 4)
        vision = dict(depth=depth, hidden_size=width, num_heads=heads, intermediate_size=rng.choice([32, 64, 96]),
                      out_hidden_size=text["hidden_size"], window_size=rng.choice([56, 112]),
                      hidden_act=rng.choice(["silu", "gelu_pytorch_tanh"]),
                      fullatt_block_indexes=sorted(rng.sample(range(depth), rng.randint(0, depth))))  # fmt: skip
    elif family == "qwen2-vl":
        vision = dict(depth=rng.randint(1, 3), embed_dim=width, num_heads=heads, mlp_ratio=rng.choice([2, 4]),
                      hidden_size=text["hidden_size"], hidden_act=rng.choice(["quick_gelu", "gelu", "silu"]))  # fmt: skip
    else:
        depth = rng.randint(2, 4)
        vision = dict(depth=depth, hidden_size=width, num_heads=heads, intermediate_size=rng.choice([32, 64]),
                      out_hidden_size=text["hidden_size"], patch_size=16, num_position_embeddings=rng.choice([16, 36, 64]),
                      deepstack_visual_indexes=sorted(rng.sample(range(depth), rng.randint(1, min(3, depth)))),
                      hidden_act=rng.choice(["gelu_pytorch_tanh", "gelu", "silu"]))  # fmt: skip
        if family == "qwen3-vl-moe":
            text.update(experts(rng, text["num_hidden_layers"]))
    vision["initializer_range"] = INIT
    return dict(text_config=text, vision_config=vision, tie_word_embeddings=tied)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Each family's tiny checkpoint: its tokenizer, processor settings and chat template are the draws' too."""
    from fovea.testing.tiny import write_tiny_checkpoint
    from fovea.testing.tiny_gemma3 import write_gemma3_checkpoint
    from fovea.testing.tiny_internvl import write_internvl_checkpoint
    from fovea.testing.tiny_llava import write_llava_checkpoint
    from fovea.testing.tiny_qwen3_vl import write_qwen3_vl_checkpoint

    root = tmp_path_factory.mktemp("fuzz-bases")
    qwen3 = write_qwen3_vl_checkpoint(root / "qwen3-vl", seed=1)
    return {
        "qwen2.5-vl": write_tiny_checkpoint(root / "qwen2.5-vl", "tiny-3b", seed=1),
        "qwen2-vl": write_tiny_checkpoint(root / "qwen2-vl", "tiny-qwen2-vl", seed=1),
        "qwen3-vl": qwen3,
        "qwen3-vl-moe": qwen3,
        "llava": write_llava_checkpoint(root / "llava", seed=1),
        "gemma3": write_gemma3_checkpoint(root / "gemma3", seed=1),  # 56 px images, 4 tokens each
        "internvl": write_internvl_checkpoint(
            root / "internvl", seed=1, max_patches=random.Random(SEED).choice([4, 6])
        ),
    }


def materialize(family: str, config: dict, base, out, seed: int):
    """The drawn checkpoint as transformers writes it (save_pretrained), beside the base's tokenizer and
    processor files."""
    import transformers

    names = {"qwen2.5-vl": "Qwen2_5_VL", "qwen2-vl": "Qwen2VL", "qwen3-vl": "Qwen3VL", "qwen3-vl-moe": "Qwen3VLMoe",
             "llava": "Llava", "gemma3": "Gemma3", "internvl": "InternVL"}  # fmt: skip
    keep = shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json")
    shutil.copytree(base, out, ignore=keep)
    torch.manual_seed(seed)
    settings = getattr(transformers, f"{names[family]}Config")(**config)
    model = getattr(transformers, f"{names[family]}ForConditionalGeneration")(settings)
    with torch.no_grad():  # transformers starts biases at zero, where a bias left out would not show
        for name, parameter in model.named_parameters():
            if name.endswith((".bias", "_bias")):  # (GPT-OSS's experts': gate_up_proj_bias, down_proj_bias)
                parameter.normal_(0, INIT)
            elif name.endswith(".sinks"):  # GPT-OSS's, at 0.02 too small to take a share of the weights
                parameter.normal_(0, 1)
    model.save_pretrained(str(out))
    return out


def parity(family: str, model_dir, kind: str, reference_dir=None) -> tuple[float, float, bool]:
    """(our fp32 logits' largest distance from transformers' float64 ones, the distance allowed, the same argmax
    wherever its top two are further apart than rounding can move them). Allowed: TOLERANCE, or three times
    transformers' own fp32 distance where a draw's activations are so large that fp32 rounding alone passes
    TOLERANCE: a CLIP tower at 5x the default init has features up to 26, and transformers' fp32 logits were up to
    1.1e-4 from its float64 ones. Over 60 LLaVA image prompts (30 draws) ours were 0.2-1.8 times transformers'
    distance (0.7 typically)."""
    if kind == "video":
        _, prompt, inputs = video_case(family, model_dir)
        ours = prompt_logits(load_model(model_dir, dtype="float32")[0], prompt)
    else:
        ours, inputs = our_logits(family, model_dir, kind), reference_inputs(family, model_dir, *conversation(kind))
    reference_dir = reference_dir or model_dir  # (a quantized checkpoint's dequantized copy)
    exact, theirs = hf_logits(reference_dir, inputs, torch.float64), hf_logits(reference_dir, inputs)
    allowed = max(TOLERANCE, 3 * (theirs - exact).abs().max().item())
    top_two = exact.topk(2, -1).values
    near_tie = top_two[:, 0] - top_two[:, 1] <= 2 * allowed  # either order is within rounding there
    same = bool((ours.argmax(-1) == exact.argmax(-1)).logical_or(near_tie).all())
    return (ours - exact).abs().max().item(), allowed, same


def video_case(family: str, model_dir):
    """An image, then a video of an odd frame count and size, then text: (our messages, our processed prompt,
    transformers' inputs). Qwen3-VL's inputs come from its own processor code (tests/test_qwen3_vl_video.py);
    Qwen2/2.5-VL's from our sized frames (conftest.hf_inputs: transformers sizes them with torchvision); InternVL's
    from its processor with the frames resized as its published code does (conftest.InternVLFrames)."""
    template_messages, messages, images, videos = video_conversation("image_and_video")
    if family == "internvl":  # its frames given without a rate: all kept, each one tile (an image to the model)
        clip = videos[0][0]
        messages = [
            {**m, "content": [{"type": "video", "video": clip} if p["type"] == "video" else p for p in m["content"]]}
            for m in messages
        ]
    prompt = PromptProcessor(model_dir, ModelConfig.from_dir(model_dir)).process_chat(messages)
    if family == "internvl":
        inputs = reference_inputs(family, model_dir, template_messages, images, [clip])
    elif family.startswith("qwen3"):
        inputs = qwen3_video_inputs(model_dir, template_messages, images, videos)
    else:
        seconds = (lambda item: item.second_per_grid_t) if family == "qwen2.5-vl" else (lambda item: None)
        frames = [(item.pixels, seconds(item)) for item in prompt.images if item.is_video]
        inputs = hf_inputs(model_dir, template_messages, images, videos=frames)
    assert prompt.token_ids == inputs["input_ids"][0].tolist()
    return messages, prompt, inputs


def engine_options(rng: random.Random, prompt_lens: list[int]) -> dict:
    """The engine's own settings, drawn: the tokens must not depend on them. Block sizes, step budgets small
    enough to cut prompts (and images' spans) into chunks, one sequence at a time or several, prefix caching on or
    off, the step order (in order, overlapped, scheduled ahead), at times a KV cache that holds only the
    longest sequence and a block, so that sequences preempt one another and come back, and at times two
    tensor-parallel ranks."""
    block_size = rng.choice([16, 32, 64])
    options = dict(
        block_size=block_size,
        max_num_batched_tokens=rng.choice([64, 128, 256, 2048]),
        max_num_seqs=rng.choice([1, 2, 8]),
        enable_prefix_caching=rng.random() < 0.5,
    )
    # the steps in order, each step's outputs built while the next runs, or the next step scheduled ahead
    orders = [dict(overlap_outputs=False, async_scheduling=False), dict(overlap_outputs=True, async_scheduling=False)]
    options.update(rng.choice([*orders, dict(async_scheduling=True)]))
    if rng.random() < 0.5:  # the cache must hold max_model_len: the model length shrinks with it
        blocks = -(-(max(prompt_lens) + MAX_TOKENS) // block_size) + 1
        options.update(num_gpu_blocks_override=blocks, max_model_len=blocks * block_size)
    if rng.random() < 0.25:  # two ranks (gloo here), the vision tower split over them where its heads divide
        options.update(tensor_parallel_size=2, mm_encoder_tp_mode=rng.choice(["weights", "data"]))
    return options


def poison_fresh_blocks(llm: LLM) -> None:
    """Each KV block the cache hands out afresh is filled with noise first. Without it a sequence preempted and
    taken up again would often get its own freed blocks back, still holding its KV, and a step that reads KV it
    never wrote (a recomputation skipped, a chunk's slots off by a block) would give the right tokens anyway."""
    engine = llm.engine
    take, noise = engine.blocks._take_free_block, torch.Generator().manual_seed(0)

    def take_poisoned() -> int:
        block = take()
        for cache in engine.runner.kv_caches:
            cache[:, block].normal_(0, 10, generator=noise)
        return block

    engine.blocks._take_free_block = take_poisoned


def quantize_drawn(rng: random.Random, config: dict, options: dict, model_dir, out):
    """A quarter of the draws: the drawn checkpoint's decoder quantized (fovea/testing/quantize.py) in a
    weight-only format (fp8 blocks, fp8 per tensor, AWQ: exact against the dequantized copy, which transformers
    runs as the reference; stacked experts written one tensor per expert, as Qwen's FP8 MoE uploads are).
    Returns (checkpoint, reference) directories."""
    text, size = config["text_config"], options.get("tensor_parallel_size", 1)
    if rng.random() >= 0.25 or text.get("model_type") == "gpt_oss":  # (GPT-OSS is published in MXFP4 only)
        return model_dir, model_dir
    experts = "num_experts" in text
    fmt = rng.choice(["fp8-block", "fp8-tensor"] if experts else ["fp8-block", "fp8-tensor", "awq"])
    # blocks that every fused piece (q, k, v; gate, up) and each rank's share start on, as vLLM requires
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    shares = [text["intermediate_size"] // size, text["num_attention_heads"] // size * head_dim]
    shares += [text["moe_intermediate_size"] // size] if experts else []
    rows, cols = rng.choice([(2, 2), (4, 8), (8, 4), (8, 16)])
    if head_dim % rows or any(share % rows or share % cols for share in shares):
        rows, cols = 2, 2
    return write_quantized_checkpoint(model_dir, out, fmt, block=(rows, cols), group_size=8)


def check_draw(family: str, draw_index: int, bases, tmp_path) -> None:
    seed = SEED + 1000 * draw_index + FAMILIES.index(family)
    config = draw(family, random.Random(seed))
    where = f"FOVEA_FUZZ_SEED={SEED} draw {draw_index} ({family}, seed {seed}): {json.dumps(config)}"
    model_dir = reference_dir = materialize(family, config, bases[family], tmp_path / f"{family}-{draw_index}", seed)
    kinds = KINDS if family in ("llava", "gemma3") else (*KINDS, "video")
    try:
        cases = []
        for kind in kinds:
            if kind == "video":
                messages, _, inputs = video_case(family, model_dir)
            else:
                template_messages, images = conversation(kind)
                inputs = reference_inputs(family, model_dir, template_messages, images)
                messages = with_pil(template_messages, images)
            cases.append((messages, inputs))
        options = engine_options(random.Random(seed + 1), [inputs["input_ids"].shape[1] for _, inputs in cases])
        model_dir, reference_dir = quantize_drawn(
            random.Random(seed + 2), config, options, model_dir, tmp_path / f"{family}-{draw_index}-quantized"
        )
        if model_dir != reference_dir:
            where += (
                f", quantized: {json.dumps(json.loads((model_dir / 'config.json').read_text())['quantization_config'])}"
            )
        for kind in kinds:
            gap, allowed, same = parity(family, model_dir, kind, reference_dir)
            assert gap <= allowed and same, (
                f"{kind}: logits {gap:.2e} from transformers' float64 ones, {allowed:.2e} allowed "
                f"(argmax equal: {same}) at {where}"
            )
        llm = LLM(str(model_dir), dtype="float32", **{"max_model_len": 2048, **options})
        poison_fresh_blocks(llm)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.chat([messages for messages, _ in cases], params, use_tqdm=False)
        for (_, inputs), out, kind in zip(cases, outputs, kinds):
            assert out.outputs[0].token_ids == hf_generate(reference_dir, inputs), (
                f"{kind}: greedy tokens differ at {where}, engine {options}"
            )
    except Exception as error:
        if where not in str(error):  # the seed of any failure, not only of the comparisons
            error.add_note(where)
        raise
    finally:
        forget_hf_models(reference_dir)


@pytest.mark.parametrize("family", FAMILIES)
def test_drawn_configurations_match_transformers(family, bases, tmp_path):
    for index in range(DRAWS):
        check_draw(family, index, bases, tmp_path)


@pytest.mark.extended
@pytest.mark.parametrize("family", FAMILIES)
def test_more_drawn_configurations_match_transformers(family, bases, tmp_path):
    for index in range(DRAWS, DRAWS + 4):
        check_draw(family, index, bases, tmp_path)


@pytest.mark.parametrize(
    "family, broken",
    [
        ("qwen3-vl", "deepstack_dropped"),
        ("qwen3-vl", "mrope_sections_swapped"),
        ("qwen2.5-vl", "window_blocks_changed"),
        ("qwen2.5-vl", "mrope_sections_swapped"),
        ("qwen2.5-vl", "sliding_windows_dropped"),
        ("qwen3-vl", "rope_scaling_dropped"),
        ("qwen2.5-vl", "norm_eps_changed"),
    ],
)
def test_the_fuzzer_sees_a_broken_rule(family, broken, bases, tmp_path):
    """Our side read from a copy whose config.json breaks one rule transformers keeps (DeepStack features dropped, the
    M-RoPE sections in another order, other blocks attending over whole images, the decoder's sliding windows or
    its YaRN scaling left out, its norms' epsilon 1e-6 for 1e-3): the logits part by ten times the fuzzer's
    tolerance or more on an image, with the weights these draws have."""
    config = draw(family, random.Random(SEED))
    text, vision = config["text_config"], config["vision_config"]
    if family == "qwen3-vl":
        # Interleaved, the sections give each of height and width every third of the lowest frequencies, so only the
        # width's count changes when they are reversed: from 5 to 1 moves four frequencies, the fastest of which
        # turns ~70 times faster at 32 dimensions than at 16.
        text["head_dim"] = 32
        text["rope_parameters"]["mrope_section"] = [1, 2, 13]
    else:
        text["hidden_size"] = vision["out_hidden_size"] = text["num_attention_heads"] * 16
        text["rope_parameters"]["mrope_section"] = [1, 2, 5]  # head dimension 16: reversed, every section moves
    vision["depth"] = max(vision["depth"], 2)
    if family == "qwen2.5-vl":
        vision["fullatt_block_indexes"] = [vision["depth"] - 1]
        vision["window_size"] = 56
    else:
        vision["deepstack_visual_indexes"] = [0]
    if broken == "sliding_windows_dropped":
        text.update(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    elif broken == "rope_scaling_dropped":
        text["rope_parameters"].update(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024)
    elif broken == "norm_eps_changed":
        text["rms_norm_eps"] = 1e-3
    reference = materialize(family, config, bases[family], tmp_path / "reference", SEED)
    ours = tmp_path / "ours"
    shutil.copytree(reference, ours)
    raw = json.loads((ours / "config.json").read_text())
    rope = raw["text_config"]["rope_parameters"]
    mutate = None
    if broken == "mrope_sections_swapped":
        rope["mrope_section"] = rope["mrope_section"][::-1]
    elif broken == "window_blocks_changed":
        raw["vision_config"]["fullatt_block_indexes"] = list(range(raw["vision_config"]["depth"]))
    elif broken == "sliding_windows_dropped":
        raw["text_config"]["use_sliding_window"] = False
    elif broken == "rope_scaling_dropped":
        rope["rope_type"] = "default"
    elif broken == "norm_eps_changed":
        raw["text_config"]["rms_norm_eps"] = 1e-6
    else:
        mutate = drop_deepstack
    (ours / "config.json").write_text(json.dumps(raw))
    assert_broken_rule_seen(
        family, reference, ours, mutate, f"{broken} at FOVEA_FUZZ_SEED={SEED}: {json.dumps(config)}"
    )


@pytest.mark.parametrize("broken", ["sliding_window_changed", "images_seen_one_way"])
def test_the_fuzzer_sees_a_broken_gemma3_rule(broken, bases, tmp_path):
    """Gemma 3: our side with another sliding window (64 for 4), or with an image's tokens seeing only earlier ones
    (no bidirectional spans): the logits part by ten times the tolerance or more on an image."""
    import dataclasses

    config = draw("gemma3", random.Random(SEED))
    config["text_config"].update(num_hidden_layers=2, sliding_window=4, sliding_window_pattern=2)
    reference = materialize("gemma3", config, bases["gemma3"], tmp_path / "reference", SEED)
    ours = tmp_path / "ours"
    shutil.copytree(reference, ours)
    mutate = None
    if broken == "sliding_window_changed":
        raw = json.loads((ours / "config.json").read_text())
        raw["text_config"]["sliding_window"] = 64
        (ours / "config.json").write_text(json.dumps(raw))
    else:

        def mutate(model):
            model.config = dataclasses.replace(model.config, bidirectional_images=False)

    assert_broken_rule_seen(
        "gemma3", reference, ours, mutate, f"{broken} at FOVEA_FUZZ_SEED={SEED}: {json.dumps(config)}"
    )


@pytest.mark.parametrize("broken", ["last_norm_dropped", "layer_scales_dropped"])
def test_the_fuzzer_sees_a_broken_internvl_rule(broken, bases, tmp_path):
    """InternVL: our side without the tower's last norm (read as mean-pooling), or with its layer scales taken as
    1 (0.1 drawn): the logits part by ten times the tolerance or more on an image."""
    config = draw("internvl", random.Random(SEED))
    config["vision_config"].update(use_mean_pooling=False, layer_scale_init_value=0.1)
    config["vision_feature_layer"] = -1
    reference = materialize("internvl", config, bases["internvl"], tmp_path / "reference", SEED)
    ours = tmp_path / "ours"
    shutil.copytree(reference, ours)
    mutate = None
    if broken == "last_norm_dropped":
        raw = json.loads((ours / "config.json").read_text())
        raw["vision_config"]["use_mean_pooling"] = True
        (ours / "config.json").write_text(json.dumps(raw))
    else:

        def mutate(model):
            for layer in model.visual.layers:
                layer.lambda_1.data.fill_(1.0)
                layer.lambda_2.data.fill_(1.0)

    assert_broken_rule_seen(
        "internvl", reference, ours, mutate, f"{broken} at FOVEA_FUZZ_SEED={SEED}: {json.dumps(config)}"
    )


def assert_broken_rule_seen(family: str, reference, ours, mutate, what: str) -> None:
    """The reference checkpoint matches transformers; ours (a copy with a rule broken in its config.json, or
    `mutate`d) is ten times the tolerance or more away on an image."""
    try:
        assert logits_gap(family, reference, reference, "one_image")[0] <= TOLERANCE  # intact, it matches
        gap, _ = logits_gap(family, ours, reference, "one_image", mutate)
        assert gap > 10 * TOLERANCE, f"went unseen (gap {gap:.2e}): {what}"
    finally:
        forget_hf_models(reference)


def drop_deepstack(model) -> None:
    """Qwen3-VL's DeepStack features zeroed before they reach the decoder's first layers."""
    width, forward = model.config.text.hidden_size, model.forward

    def without(input_ids, positions, meta, mm_embeds=None, mm_mask=None):
        if mm_embeds is not None:
            mm_embeds = torch.cat([mm_embeds[:, :width], torch.zeros_like(mm_embeds[:, width:])], 1)
        return forward(input_ids, positions, meta, mm_embeds, mm_mask)

    model.forward = without
