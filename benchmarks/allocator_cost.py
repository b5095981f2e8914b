"""What fovea's allocator upkeep for long runs (fovea/core/memory.py) costs in throughput, and saves in memory.

    python benchmarks/allocator_cost.py --rounds 2 --passes 3 --num-prompts 300 \
        --out results/allocator_cost_cpu_COMMIT.json [--variant NAME=KEY=VALUE,KEY=VALUE ...]

Each round starts `fovea serve` on the demo model once per variant (the rounds alternate the order): as it runs
(two malloc arenas; malloc_trim every 10 s, sooner once the RSS has risen 32 MB), with glibc's own arena count
(MALLOC_ARENA_MAX=0, which glibc ignores) and the trim, glibc left alone (no trim either) and any given
(environment variables over glibc left alone).
Each server is saturated `--passes` times in a row by `fovea bench serve` with chats carrying fresh random images of
256x256 and 1280x720 (random-mm), all sent at once; after each pass, the resident memory of the front end and the
engine (the processor cache, 0.25 GB here, is full after the first pass; the KV cache is 400 blocks, all written in
the first pass). Throughput per pass, and memory growth from pass to pass on the same server, side by side.
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

VARIANTS = {
    "2 arenas, trim": {},
    "glibc's arenas, trim": {"MALLOC_ARENA_MAX": "0"},
    "glibc left alone": {"FOVEA_MALLOC_TRIM_S": "0", "MALLOC_ARENA_MAX": "0"},
}


def served(env: dict[str, str]):
    port = free_port()
    cmd = [sys.executable, "-m", "fovea.cli", "serve", "--port", str(port), "--uvicorn-log-level", "warning"]
    cmd += ["--mm-processor-cache-gb", "0.25"]  # full within the first pass: later passes show the allocator alone
    # 6,400 tokens of KV cache: the demo's default 2M (1 GB) becomes resident page by page as blocks are first
    # written, which looks like growth for many passes (it stops at the cache's size)
    cmd += ["--num-gpu-blocks-override", "400"]
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


def bench(base: str, num_prompts: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "fovea.cli", "bench", "serve", "--base-url", base, "--seed", str(seed)]
        cmd += ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--dataset-name", "random-mm"]
        cmd += ["--num-prompts", str(num_prompts), "--request-rate", "inf", "--random-input-len", "64"]
        cmd += ["--random-output-len", "16", "--ignore-eos", "--save-result", "--result-dir", out]
        subprocess.run([*cmd, "--result-filename", "r.json"], check=True, capture_output=True)
        result = json.loads((Path(out) / "r.json").read_text())
    keys = ("completed", "failed", "duration", "request_throughput", "median_ttft_ms", "median_tpot_ms")
    return {key: result[key] for key in keys}


def run(env: dict[str, str], num_prompts: int, passes: int) -> list[dict]:
    server, base = served(env)
    try:
        rows = []
        for index in range(passes):
            row = bench(base, num_prompts, seed=index)
            front_end = psutil.Process(server.pid)
            row["front_end_rss_mb"] = front_end.memory_info().rss / 2**20
            row["engine_rss_mb"] = max(child.memory_info().rss for child in front_end.children()) / 2**20
            rows.append(row)
        return rows
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=300)
    parser.add_argument("--variant", action="append", default=[], help="NAME=KEY=VALUE,KEY=VALUE over glibc's defaults")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    variants = dict(VARIANTS)
    for text in args.variant:
        name, settings = text.split("=", 1)
        left_alone = {"FOVEA_MALLOC_TRIM_S": "0", "MALLOC_ARENA_MAX": "0"}
        variants[name] = {**left_alone, **dict(item.split("=", 1) for item in settings.split(","))}
    runs = []
    for round_index in range(args.rounds):
        for name in list(variants) if round_index % 2 == 0 else list(variants)[::-1]:
            for index, row in enumerate(run(variants[name], args.num_prompts, args.passes)):
                runs.append({"variant": name, "env": variants[name], "round": round_index, "pass": index, **row})
                print(f"{name:22s} pass {index}: {row['request_throughput']:6.2f} req/s  "
                      f"TTFT {row['median_ttft_ms']:6.0f} ms  TPOT {row['median_tpot_ms']:5.1f} ms  "
                      f"RSS front end {row['front_end_rss_mb']:5.0f} MB, engine {row['engine_rss_mb']:5.0f} MB", flush=True)  # fmt: skip
    Path(args.out).write_text(json.dumps({"num_prompts": args.num_prompts, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
