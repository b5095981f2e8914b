"""What glibc's settings for long runs (fovea/server/allocator.py) cost in throughput and in memory at the end.

    python benchmarks/allocator_cost.py --rounds 3 --num-prompts 300 --out results/allocator_cost_cpu_COMMIT.json

Each round starts `fovea serve` on the demo model twice, once as it runs by default (the settings) and once with
FOVEA_MALLOC=default (glibc's own), in alternating order, and saturates each with `fovea bench serve`: chats with
fresh random images of 256x256 and 1280x720 (random-mm), all sent at once. It records each run's throughput and
latencies, and the resident memory of the front end and the engine after it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serving import free_port  # noqa: E402 - the tests' helper

VARIANTS = {"settings": {}, "glibc default": {"FOVEA_MALLOC": "default"}}


def served(env: dict[str, str]):
    port = free_port()
    cmd = [sys.executable, "-m", "fovea.cli", "serve", "--port", str(port), "--uvicorn-log-level", "warning"]
    server = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return server, base
        except httpx.HTTPError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError("the server did not start")


def run(env: dict[str, str], num_prompts: int) -> dict:
    server, base = served(env)
    try:
        with tempfile.TemporaryDirectory() as out:
            bench = [sys.executable, "-m", "fovea.cli", "bench", "serve", "--base-url", base]
            bench += ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--dataset-name", "random-mm"]
            bench += ["--num-prompts", str(num_prompts), "--request-rate", "inf", "--random-input-len", "64"]
            bench += ["--random-output-len", "16", "--ignore-eos", "--save-result", "--result-dir", out]
            subprocess.run([*bench, "--result-filename", "r.json"], check=True, capture_output=True)
            result = json.loads((Path(out) / "r.json").read_text())
        processes = [psutil.Process(server.pid), *psutil.Process(server.pid).children()]
        rss = sorted((p.memory_info().rss / 2**20 for p in processes), reverse=True)
        keys = ("completed", "failed", "duration", "request_throughput", "median_ttft_ms", "median_tpot_ms")
        return {**{key: result[key] for key in keys}, "largest_rss_mb": rss[:2]}  # the engine's and the front end's
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=300)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    runs = []
    for round_index in range(args.rounds):
        names = list(VARIANTS) if round_index % 2 == 0 else list(VARIANTS)[::-1]
        for name in names:
            runs.append({"variant": name, "round": round_index, **run(VARIANTS[name], args.num_prompts)})
            row = runs[-1]
            print(f"{name:14s} {row['request_throughput']:6.2f} req/s  TTFT {row['median_ttft_ms']:7.0f} ms  "
                  f"TPOT {row['median_tpot_ms']:5.1f} ms  RSS {row['largest_rss_mb'][0]:.0f}, {row['largest_rss_mb'][1]:.0f} MB")  # fmt: skip
    Path(args.out).write_text(json.dumps({"num_prompts": args.num_prompts, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
