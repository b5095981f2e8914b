"""The front end's CPU per streamed token: `fovea serve` around a forward that costs nothing (host_step.py's stub,
`--vocab`-column logits) streaming `--streams` requests at once to `fovea bench serve` (random 1000-token prompts,
`--output-len` tokens each, ignore_eos), over completions and chat.

    python benchmarks/served_streams.py --out FILE [--baseline TREE] [--streams 256] [--output-len 1500]
        [--server-args "" "--stream-interval 4"] [--backends openai,openai-chat] [--repeats 2] [--vocab 400]

Per case (tree x server arguments x backend, a fresh server each, the trees alternating): the server's processes'
CPU seconds while the benchmark ran, per output token: the front end's (HTTP, detokenizing, the chunks) and the
engine process's; and what the client measured (output throughput, mean TPOT). On a 2-core machine the client
competes with the server for the cores, so throughput moves with everyone's CPU; the front end's CPU per token is
the figure to read. `--baseline DIR` (a `git archive` of another commit) runs the same cases on that tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from host_step import hook_dir  # noqa: E402 - the stub forward, installed in the server's processes

PORT = 8123


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def busiest_child(server: psutil.Process) -> psutil.Process:
    """The engine process: of the server's children, the one that has run the most (it stepped at start-up)."""
    return max(server.children(recursive=True), key=cpu_seconds)


def wait_healthy(server: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not start")


def run_case(case: dict, tree: Path, model: Path, work: Path, args) -> dict:
    env = dict(os.environ, FOVEA_HOST_STEP=str(work / "steps"), PYTHONPATH=f"{hook_dir(work)}:{tree}")
    env.update(OMP_NUM_THREADS="1", FOVEA_HOST_STEP_VOCAB=str(args.vocab))
    serve = [sys.executable, "-m", "fovea", "serve", str(model), "--port", str(PORT), "--dtype", "float32"]
    serve += ["--max-model-len", str(1000 + args.output_len + 100), "--num-gpu-blocks-override", "40000"]
    serve += ["--max-num-seqs", str(args.streams), "--disable-log-stats", "--disable-uvicorn-access-log"]
    log = open(work / "serve.log", "w")
    server = subprocess.Popen(serve + case["server_args"].split(), cwd=tree, env=env, stdout=log, stderr=log)
    try:
        wait_healthy(server)
        front = psutil.Process(server.pid)
        engine = busiest_child(front)
        before = cpu_seconds(front), cpu_seconds(engine)
        result = work / "bench.json"
        bench = [sys.executable, "-m", "fovea", "bench", "serve", "--base-url", f"http://127.0.0.1:{PORT}"]
        bench += ["--model", str(model), "--backend", case["backend"], "--dataset-name", "random"]
        bench += ["--random-input-len", "1000", "--random-output-len", str(args.output_len), "--ignore-eos"]
        bench += ["--num-prompts", str(args.streams), "--max-concurrency", str(args.streams), "--save-result"]
        bench += ["--result-dir", str(work), "--result-filename", result.name]
        subprocess.run(bench, check=True, capture_output=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
        front_cpu, engine_cpu = cpu_seconds(front) - before[0], cpu_seconds(engine) - before[1]
    finally:
        server.terminate()
        server.wait(60)
        log.close()
    measured = json.loads(result.read_text())
    tokens = measured["total_output_tokens"]
    return {
        **case,
        "completed": measured["completed"],
        "output_tokens": tokens,
        "frontend_cpu_us_per_token": front_cpu / tokens * 1e6,
        "engine_cpu_us_per_token": engine_cpu / tokens * 1e6,
        "output_throughput": measured["output_throughput"],
        "mean_tpot_ms": measured["mean_tpot_ms"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--baseline", help="another tree (a git archive of a commit) measured side by side")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=1500)
    parser.add_argument("--server-args", nargs="+", default=[""], help="one server variant per argument")
    parser.add_argument("--backends", default="openai,openai-chat")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=400)
    args = parser.parse_args()
    from fovea.testing.tiny import write_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="served-streams-"))
    model = write_tiny_checkpoint(work / "tiny-3b", "tiny-3b", seed=0)
    trees = {"current": ROOT} | ({"baseline": Path(args.baseline).resolve()} if args.baseline else {})
    runs = []
    for repeat in range(args.repeats):
        for backend in args.backends.split(","):
            for server_args in args.server_args:
                for name, tree in trees.items():
                    case = {"tree": name, "server_args": server_args, "backend": backend, "repeat": repeat}
                    runs.append(run_case(case, tree, model, work, args))
                    print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for run in runs:
        key = f"{run['tree']} {run['backend']} {run['server_args']}".strip()
        summary.setdefault(key, []).append(run)
    medians = {
        key: {
            field: statistics.median(r[field] for r in group)
            for field in ("frontend_cpu_us_per_token", "engine_cpu_us_per_token", "output_throughput", "mean_tpot_ms")
        }
        for key, group in summary.items()
    }
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result = {"commit": commit.stdout.strip(), "args": vars(args), "medians": medians, "runs": runs}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(medians, indent=1))


if __name__ == "__main__":
    main()
