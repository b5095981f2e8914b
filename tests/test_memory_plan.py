"""`fovea plan`: parameter and KV-cache sizes checked against loaded checkpoints and the published shapes."""

from __future__ import annotations

import pytest

from conftest import QWEN_SHAPES, published_param_count, published_shape_dir
from fovea.cli import main
from fovea.engine.memory_plan import count_parameters, plan_memory


def test_sizes_match_what_the_engine_loads_and_allocates(tiny_dirs):
    from fovea import LLM
    from fovea.config import ModelConfig

    for name, model_dir in tiny_dirs.items():
        llm = LLM(str(model_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=20)
        runner = llm.engine.runner
        assert count_parameters(ModelConfig.from_dir(model_dir)) == sum(p.numel() for p in runner.model.parameters())
        plan = plan_memory(model_dir, 80, dtype="float32")
        assert plan.kv_bytes_per_token == runner.kv_cache_bytes // (runner.num_blocks * 16), name


@pytest.mark.parametrize("size", sorted(QWEN_SHAPES))
def test_published_sizes(tiny_dirs, tmp_path, size):
    model_dir = published_shape_dir(tmp_path / size, tiny_dirs["tiny-3b"], size)
    from fovea.config import ModelConfig

    assert count_parameters(ModelConfig.from_dir(model_dir)) == published_param_count(size)
    hidden, layers, heads, kv_heads, *_ = QWEN_SHAPES[size]
    plan = plan_memory(model_dir, 80, max_model_len=32768)
    assert plan.kv_bytes_per_token == layers * kv_heads * 128 * 2 * 2  # bf16 K and V
    assert plan.weights_bytes == published_param_count(size) * 2
    rows = {(w, h): tokens for w, h, tokens, _ in plan.images}
    assert rows[(1280, 720)] == 1196  # the facts' token count; checkpoint max_pixels caps 3840x2160 no lower
    # the registry's tensor-parallel size is the fewest GPUs that hold a 32k-token sequence next to the weights
    from fovea.eval.registry import MODELS

    tp = MODELS[f"qwen2.5-vl-{size}"].tensor_parallel_size
    assert plan_memory(model_dir, 80, max_model_len=32768, tensor_parallel_size=tp).kv_tokens >= 32768
    if tp > 1:
        assert plan_memory(model_dir, 80, max_model_len=32768, tensor_parallel_size=tp // 2).kv_tokens < 32768
    assert (plan.kv_tokens == 0) == (size == "72b")  # 147 GB of bf16 weights leave nothing on one 80 GiB card


def test_plan_command_prints_the_capacity_table(tiny_dirs, tmp_path, capsys):
    model_dir = published_shape_dir(tmp_path / "7b", tiny_dirs["tiny-3b"], "7b")
    main(["plan", str(model_dir), "--gpu-memory", "80", "--max-model-len", "32768", "--max-pixels", "1003520"])
    out = capsys.readouterr().out
    assert "KV cache per token" in out and "56.0 KiB" in out and "1280x720" in out
    kv_line = next(line for line in out.splitlines() if line.startswith("KV cache:"))
    tokens = int(kv_line.split()[2])
    assert 900_000 < tokens < 1_150_000  # (72 GiB - 15.4 GiB weights - activations) / 56 KiB
    main(["plan", str(model_dir), "--gpu-memory", "16", "--max-model-len", "32768"])
    assert "does not fit: lower max_model_len" in capsys.readouterr().out
