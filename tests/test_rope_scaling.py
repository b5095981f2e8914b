"""RoPE scaled for longer contexts, as a checkpoint's config.json or vLLM's --hf-overrides asks: linear, YaRN and
Llama 3's rules in every family's decoder (M-RoPE, interleaved M-RoPE, 1-D, Gemma 3's global layers), against
transformers' logits over a prompt with an image; the context they allow, as vLLM derives it; the kinds fovea
does not run refused by name. Before, the Qwen families ran a YaRN checkpoint with plain RoPE, silently."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
from test_families import conversation, hf_greedy, logits_gap, with_pil

from fovea import LLM, SamplingParams
from fovea.config.engine import EngineConfig
from fovea.config.model import ModelConfig

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
SCALINGS = {
    "yarn": YARN,
    # the paper's other knobs: an attention factor from mscale / mscale_all_dim, other ramp ends, no rounding
    "yarn-mscale": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 8, "beta_slow": 0.5, "truncate": False},
    "yarn-attention-factor": {**YARN, "factor": 3.0, "attention_factor": 1.3},
    "linear": {"rope_type": "linear", "factor": 2.0},
    # wavelengths of 6-20,000 positions: some divided, some smoothed, some kept
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}
CASES = [
    ("qwen2.5-vl", "yarn"),
    ("qwen2-vl", "linear"),
    ("qwen3-vl", "yarn-mscale"),
    ("qwen3-vl-moe", "llama3"),
    ("llava", "llama3"),
    ("internvl", "yarn-attention-factor"),
    ("gemma3", "yarn"),
]


def checkpoint(family: str, family_dirs, tiny_dirs):
    return tiny_dirs["tiny-3b"] if family == "qwen2.5-vl" else family_dirs[family]


def rope_overrides(raw: dict, scaling: dict) -> dict:
    """The config.json keys that scale `raw`'s decoder RoPE: its rope dict with `scaling` laid over it, where the
    checkpoint keeps it (the top of a flat Qwen2-VL config; text_config's rope_parameters or rope_scaling;
    Gemma 3's full-attention layers)."""
    text = raw.get("text_config")
    if text is None:
        return {"rope_scaling": {**{k: v for k, v in raw["rope_scaling"].items() if k != "type"}, **scaling}}
    key = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
    rope = text.get(key) or {"rope_theta": 10000.0}  # (LLaVA's Llama: transformers' default theta)
    if "full_attention" in rope:
        return {"text_config": {key: {**rope, "full_attention": {**rope["full_attention"], **scaling}}}}
    return {"text_config": {key: {**rope, **scaling}}}


def edited_checkpoint(source, tmp_path, overrides: dict):
    """A copy of `source` whose config.json has `overrides` written in (a sub-config's keys one by one)."""
    target = tmp_path / "scaled"
    shutil.copytree(source, target)
    raw = json.loads((source / "config.json").read_text())
    edited = copy.deepcopy(raw)
    for key, value in overrides.items():
        if key == "text_config":
            edited[key].update(value)
        else:
            edited[key] = value
    (target / "config.json").write_text(json.dumps(edited))
    return target


@pytest.mark.parametrize("family, kind", CASES)
def test_scaled_rope_matches_transformers(family_dirs, tiny_dirs, tmp_path, family, kind):
    source = checkpoint(family, family_dirs, tiny_dirs)
    raw = json.loads((source / "config.json").read_text())
    scaled = edited_checkpoint(source, tmp_path, rope_overrides(raw, SCALINGS[kind]))
    gap, same_argmax = logits_gap(family, scaled, scaled, "one_image")
    assert gap <= 1e-4 and same_argmax, gap
    assert ModelConfig.from_dir(scaled).text.rope_scaling.kind == SCALINGS[kind]["rope_type"]


def test_the_scaled_context_is_vllms():
    """yarn: the original length times the factor; linear: the model's length times it; llama3: the model's;
    Gemma 3: its own (its max_position_embeddings counts the scaling already)."""
    from fovea.testing.tiny_configs import tiny_config

    raw = tiny_config("tiny-3b")
    cases = [(YARN, 4 * 4096), (SCALINGS["linear"], 2 * raw["max_position_embeddings"])]
    cases.append((SCALINGS["llama3"], raw["max_position_embeddings"]))
    for scaling, context in cases:
        assert ModelConfig.from_dict({**raw, **rope_overrides(raw, scaling)}).max_context == context, scaling


@pytest.mark.parametrize(
    "scaling, words",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope scaling 'dynamic' is not supported"),
        ({"rope_type": "longrope", "factor": 2.0}, "rope scaling 'longrope' is not supported"),
        ({"rope_type": "llama3", "factor": 8.0}, "llama3 rope scaling needs low_freq_factor, high_freq_factor"),
        ({"rope_type": "linear"}, "linear rope scaling needs factor"),
        ({"rope_type": "linear", "factor": 0}, "factor must be positive"),
        ({**YARN, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_rope_fovea_does_not_run_is_refused_by_name(family_dirs, scaling, words):
    for family in ("qwen3-vl", "llava"):  # M-RoPE and 1-D
        raw = json.loads((family_dirs[family] / "config.json").read_text())
        text = raw["text_config"]
        key = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
        mrope = {k: v for k, v in (text.get(key) or {}).items() if k.startswith("mrope")}
        raw["text_config"] = {**text, key: {**mrope, **scaling}}
        with pytest.raises(ValueError, match=words):
            ModelConfig.from_dict(raw)


def test_hf_overrides_give_the_edited_checkpoints_tokens(tiny_dirs, tmp_path):
    """`LLM(hf_overrides=...)` (vLLM's --hf-overrides) equals transformers on a config.json with the same keys
    written in: YaRN laid over a flat Qwen2.5-VL config, given at the top and as text_config (vLLM's sub-config
    form); the context grows to the scaled one. A bad override fails naming the problem."""
    source = tiny_dirs["tiny-3b"]
    raw = json.loads((source / "config.json").read_text())
    overrides = rope_overrides(raw, YARN)
    scaled = edited_checkpoint(source, tmp_path, overrides)
    messages, images = conversation("one_image")
    expected = hf_greedy("qwen2.5-vl", scaled, messages, images)
    params = SamplingParams(temperature=0, max_tokens=len(expected), ignore_eos=True)
    plain = LLM(str(source), dtype="float32", max_model_len=2048, num_gpu_blocks_override=160, seed=0)
    unscaled = plain.chat(with_pil(messages, images), params)[0].outputs[0].token_ids
    del plain
    for given in (overrides, {"text_config": overrides}):
        llm = LLM(str(source), dtype="float32", max_model_len=2048, num_gpu_blocks_override=160, hf_overrides=given)
        assert llm.chat(with_pil(messages, images), params)[0].outputs[0].token_ids == expected
        del llm
    assert unscaled != expected  # the scaling changes this prompt's tokens: the equality above says something
    assert EngineConfig.from_args(str(source), hf_overrides=overrides).max_model_len == 4 * 4096
    with pytest.raises(ValueError, match="rope scaling 'dynamic' is not supported"):
        EngineConfig.from_args(str(source), hf_overrides={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(TypeError, match="hf_overrides must be a dict"):
        EngineConfig.from_args(str(source), hf_overrides=lambda config: config)
