"""Checkpoint loading: sharded vs single, both name layouts, dtypes, clear errors, hub ids."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hf_inputs, our_model, random_image
from safetensors.torch import load_file, save_file
from test_model_vs_hf import our_logits

from fovea.config.model import ModelConfig, resolve_model_dir
from fovea.models.loader import CheckpointMismatchError, load_model
from fovea.testing.tiny import write_tiny_checkpoint

MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "image_pil", "image_pil": random_image(200, 150, 9)},
            {"type": "text", "text": "What is this?"},
        ],
    }
]


def logits_of(model_dir, dtype="float32"):
    model, _ = load_model(model_dir, dtype=dtype)
    _, processor = our_model(model_dir)
    return our_logits(model, processor.process_chat(MESSAGES)), model


@pytest.mark.parametrize("config", ["tiny-3b", "tiny-7b"])
def test_sharded_and_transformers5_layouts_give_identical_logits(tmp_path, config):
    single = write_tiny_checkpoint(tmp_path / "single", config, seed=5)
    sharded = write_tiny_checkpoint(tmp_path / "sharded", config, seed=5, shards=3)
    tf5 = write_tiny_checkpoint(tmp_path / "tf5", config, seed=5, layout="transformers5", shards=2)
    assert len(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert "text_config" in json.loads((tf5 / "config.json").read_text())
    assert any(k.startswith("model.language_model.") for k in load_file(tf5 / "model-00001-of-00002.safetensors"))
    reference, _ = logits_of(single)
    for other in (sharded, tf5):
        logits, _ = logits_of(other)
        assert torch.equal(logits, reference)


def test_transformers_reads_our_transformers5_checkpoint_the_same(tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    tf5 = write_tiny_checkpoint(tmp_path / "tf5", "tiny-7b", seed=2, layout="transformers5")
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tf5), dtype=torch.float32).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    with torch.no_grad():
        ref = hf(**hf_inputs(tf5, messages, [MESSAGES[0]["content"][0]["image_pil"]])).logits[0]
    ours, _ = logits_of(tf5)
    assert ((ours - ref).norm() / ref.norm()).item() <= 1e-4


def test_config_forms_parse_identically(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", "tiny-3b", layout="published")
    b = write_tiny_checkpoint(tmp_path / "b", "tiny-3b", layout="transformers5")
    ca, cb = ModelConfig.from_dir(a), ModelConfig.from_dir(b)
    assert ca == cb
    assert (
        ca.tie_word_embeddings
        and not ModelConfig.from_dir(write_tiny_checkpoint(tmp_path / "c", "tiny-7b")).tie_word_embeddings
    )
    assert ca.text.mrope_section == (2, 3, 3) and ca.vision.fullatt_block_indexes == (2,)
    assert ca.vision.patch_dim == 1176 and ca.vision.window_merged == 4


def test_tied_model_shares_embedding_and_head(tiny_dirs):
    model, _ = our_model(tiny_dirs["tiny-3b"])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied, _ = our_model(tiny_dirs["tiny-7b"])
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    weights = load_file(tiny_dirs["tiny-7b"] / "model.safetensors")
    assert torch.equal(untied.lm_head.weight, weights["lm_head.weight"])


def test_bf16_load_runs_and_stays_close(tiny_dirs):
    fp32, _ = logits_of(tiny_dirs["tiny-3b"])
    bf16, model = logits_of(tiny_dirs["tiny-3b"], dtype="bfloat16")
    assert model.lm_head.weight.dtype == torch.bfloat16 and bf16.dtype == torch.bfloat16
    assert torch.isfinite(bf16.float()).all()
    assert ((bf16.float() - fp32).norm() / fp32.norm()).item() < 0.05


def test_auto_dtype_follows_config(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "bf", "tiny-3b", dtype="bfloat16")
    model, _ = load_model(d)  # dtype="auto"
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(d, dtype="int3")


def _rewrite(model_dir, edit):
    path = model_dir / "model.safetensors"
    weights = load_file(path)
    edit(weights)
    save_file(weights, str(path))


def test_missing_tensor_is_named(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "m", "tiny-3b")
    _rewrite(d, lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointMismatchError, match=r"missing tensors.*model\.layers\.1\.self_attn\.qkv_proj"):
        load_model(d)


def test_unexpected_tensor_is_named(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "u", "tiny-3b")
    _rewrite(d, lambda w: w.update({"model.layers.7.mlp.up_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(CheckpointMismatchError, match=r"unexpected tensors: model\.layers\.7\.mlp\.up_proj"):
        load_model(d)


def test_wrong_checkpoint_for_config_names_the_tensor(tmp_path):
    small = write_tiny_checkpoint(tmp_path / "small", "tiny-3b")
    big = write_tiny_checkpoint(tmp_path / "big", "tiny-7b")
    (small / "model.safetensors").write_bytes((big / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointMismatchError, match=r"tensor \S+ does not fit the model: .*shape"):
        load_model(small)


def test_experts_stored_apart_that_do_not_fit_the_config_are_named(tmp_path):
    """Qwen3-MoE's layout (one tensor per expert): an expert past the config's count, or one left out."""
    from safetensors.torch import load_file, save_file

    from fovea.testing.tiny_internvl import write_internvl_checkpoint

    model_dir = write_internvl_checkpoint(tmp_path / "moe", decoder="qwen3_moe")
    tensors = load_file(model_dir / "model.safetensors")
    extra = "language_model.model.layers.0.mlp.experts.4.up_proj.weight"  # the config has 4 (0-3)
    save_file({**tensors, extra: tensors[extra.replace(".4.", ".3.")].clone()}, model_dir / "model.safetensors")
    with pytest.raises(CheckpointMismatchError, match=rf"tensor {extra} does not fit the model: expert 4: the config"):
        load_model(model_dir)
    del tensors["language_model.model.layers.0.mlp.experts.2.down_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(
        CheckpointMismatchError, match=r"missing tensors \(our parameter names\): model.layers.0.mlp.experts.down_proj"
    ):
        load_model(model_dir)


def test_missing_weights_and_bad_config(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "nw", "tiny-3b")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        load_model(d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ValueError, match="unsupported architecture 'LlamaForCausalLM'"):
        ModelConfig.from_dir(d)
    (d / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 1]}}))
    with pytest.raises(ValueError, match="must sum to head_dim/2"):
        ModelConfig.from_dir(d)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)


def test_hub_id_resolves_from_local_cache_or_fails_clearly(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)  # downloading: tests/test_hub_download.py
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache and HF_HUB_OFFLINE is set"):
        resolve_model_dir("Qwen/Qwen2.5-VL-7B-Instruct")
    repo = tmp_path / "models--Qwen--Qwen2.5-VL-7B-Instruct"
    snapshot = repo / "snapshots" / ("a" * 40)
    write_tiny_checkpoint(snapshot, "tiny-7b")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    assert resolve_model_dir("Qwen/Qwen2.5-VL-7B-Instruct") == snapshot
    with pytest.raises(FileNotFoundError, match="neither a local directory nor a hub id"):
        resolve_model_dir("./no/such/dir")


def test_a_checkpoint_tokenizer_loads_once_per_process_until_a_file_changes(tiny_dirs, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from fovea.multimodal.prompt import load_tokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_dirs["tiny-3b"], model)
    first = load_tokenizer(model)
    assert load_tokenizer(model) is first and load_tokenizer(str(model) + "/") is first
    assert (
        first("a shared tokenizer")["input_ids"]
        == AutoTokenizer.from_pretrained(model)("a shared tokenizer")["input_ids"]
    )
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    changed = load_tokenizer(model)
    assert changed is not first and changed.model_max_length == 77 and first.model_max_length != 77
    # keyed by the files' content, not the directory: a checkpoint with other weights and another config.json but
    # the same tokenizer files shares it, unless its config.json names another tokenizer class
    assert load_tokenizer(tiny_dirs["tiny-7b"]) is load_tokenizer(tiny_dirs["tiny-3b"])
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5}))
    assert load_tokenizer(model) is changed
    (model / "config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    assert load_tokenizer(model) is not changed
