"""The `fovea` command: the README's demo path on the embedded model, and writing tiny checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fovea.testing.tiny import DEMO_DIR_NAME


def run_fovea(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "fovea.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def test_demo_builds_and_announces_the_embedded_model(tmp_path):
    done = run_fovea("demo", "--max-tokens", "4", "--threads", "1", env={"FOVEA_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "RANDOM weights" in done.stderr and "gibberish" in done.stderr
    assert "image grid (1, 24, 32) -> 192 image tokens" in done.stdout
    assert "--- 4 tokens in" in done.stdout
    config = json.loads((tmp_path / DEMO_DIR_NAME / "config.json").read_text())
    assert config["max_position_embeddings"] == 8192  # a request without max_tokens ends within minutes on a CPU
    again = run_fovea("demo", "--max-tokens", "2", "--threads", "1", env={"FOVEA_CACHE_DIR": str(tmp_path)})
    assert again.returncode == 0 and "building" not in again.stderr  # built once, reused


def test_tiny_command_and_errors(tmp_path):
    done = run_fovea("tiny", str(tmp_path / "t"), "--config", "tiny-7b", "--layout", "transformers5", "--shards", "2")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "t" / "model.safetensors.index.json").read_text())["weight_map"]
    missing = run_fovea("demo", str(tmp_path / "nowhere"))
    assert missing.returncode != 0 and "neither a local directory nor a hub id" in missing.stderr
    assert run_fovea("--version").stdout.strip()
    as_module = subprocess.run([sys.executable, "-m", "fovea", "--version"], capture_output=True, text=True)
    assert as_module.returncode == 0 and as_module.stdout.strip() == run_fovea("--version").stdout.strip()


def test_serve_flags_help_and_errors():
    from fovea.config.flags import json_arg as _json_arg

    assert _json_arg('{"image": 4}') == _json_arg("image=4") == {"image": 4}
    assert _json_arg("image=2, video=0") == {"image": 2, "video": 0}
    shown = run_fovea("serve", "--help").stdout
    for group, flag in (
        ("server", "--served-model-name"),
        ("server", "--trust-request-chat-template"),
        ("images", "--limit-mm-per-prompt"),
        ("engine", "--enable-prefix-caching"),
    ):
        assert f"\n{group}:" in shown and flag in shown
    bad_json = run_fovea("serve", "--limit-mm-per-prompt", "image:four")
    assert bad_json.returncode == 2 and "--limit-mm-per-prompt: not valid JSON" in bad_json.stderr
    tensor_parallel = run_fovea("serve", "--tensor-parallel-size", "3")  # the demo model's decoder has 4 heads
    assert tensor_parallel.returncode != 0
    assert "attention heads (4) do not divide over tensor_parallel_size 3" in tensor_parallel.stderr
