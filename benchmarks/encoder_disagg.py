"""random-mm at a fixed request rate against a colocated and a disaggregated server on two test hosts (issue 58).

    sudo python benchmarks/encoder_disagg.py --out FILE.json [--model DIR] [--rate 2] [--prompts 60]
        [--size 448x336] [--workers 1]

Two network-namespace hosts with a Ray cluster over them (tests/hosts.py: needs root and iproute2), one Ray CPU
each. Both servers run `--distributed-executor-backend ray` from host A, one replica: colocated, the replica's
engine runs the vision tower on its own encoder thread; disaggregated (`--mm-encoder-workers N`), the tower runs in
N Ray actors on the other host's CPU and the pixels and embeddings cross the link through Ray's object store. The
client (`fovea bench serve`, random-mm, one image of --size a request, 32 prompt and 16 output tokens) runs outside
both hosts. The hosts share this machine's cores, so the figures say what the split costs and frees on one
machine's CPUs, not what a second machine would add.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from hosts import two_hosts  # noqa: E402
from serving import running_server  # noqa: E402

FIGURES = ("duration", "request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms",
           "median_itl_ms", "p99_itl_ms", "mean_tpot_ms", "completed", "failed")  # fmt: skip


def bench(base: str, model: Path, args) -> dict:
    from fovea.cli import build_parser

    width, height = (int(x) for x in args.size.split("x"))
    parsed = build_parser().parse_args(
        ["bench", "serve", "--base-url", base, "--tokenizer", str(model), "--model", "m", "--backend",
         "openai-chat", "--dataset-name", "random-mm", "--num-prompts", str(args.prompts), "--request-rate",
         str(args.rate), "--seed", "0", "--random-input-len", "32", "--random-output-len", "16", "--ignore-eos",
         "--random-mm-bucket-config", f"{{({width}, {height}, 1): 1.0}}", "--random-mm-base-items-per-request", "1",
         "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}', "--disable-tqdm"]
    )  # fmt: skip
    return parsed.func(parsed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="/tmp/fovea-cpu-512")
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--size", default="448x336")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    model = Path(args.model)
    if not model.exists():
        subprocess.run([sys.executable, "-m", "fovea.cli", "tiny", str(model), "--config", "cpu-512"], check=True)
    flags = ["--dtype", "float32", "--max-model-len", "2048", "--served-model-name", "m"]
    flags += ["--distributed-executor-backend", "ray"]
    modes = {"colocated": [], "disaggregated": ["--mm-encoder-workers", str(args.workers)]}
    results = {}
    with two_hosts(cpus=(1, args.workers)) as cluster:
        a = cluster.hosts[0]
        for mode, extra in modes.items():
            with running_server(
                model, *flags, *extra, env=cluster.env, prefix=a.command(), address=cluster.client_address,
                startup_s=300,
            ) as (base, _):  # fmt: skip
                bench(base, model, argparse.Namespace(**{**vars(args), "prompts": 4}))  # warm-up
                figures = bench(base, model, args)
            results[mode] = {k: figures[k] for k in FIGURES}
            print(mode, json.dumps(results[mode]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    Path(args.out).write_text(
        json.dumps({"commit": commit.stdout.strip(), "args": vars(args), "results": results}, indent=2)
    )
    print(f"| figure | {' | '.join(results)} |\n| --- |{' --- |' * len(results)}")
    for key in FIGURES:
        print(f"| {key} | {' | '.join(f'{results[m][key]:.2f}' for m in results)} |")


if __name__ == "__main__":
    main()
