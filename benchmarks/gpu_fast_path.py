"""Issue 6's measurements on one GPU, side by side with their floors: run on the GPU machine, results under --out.

    python benchmarks/gpu_fast_path.py --model DIR --out DIR [--commit SHA] [--steps rates,serve,hf] [--quick]

rates:  bf16 matmul rate (8192^3) and device-to-device copy bandwidth (read + written), as `fovea bench kernels`
        measures them (medians of CUDA-event-timed runs)
serve:  `fovea serve DIR` (prefix caching off, otherwise default flags: the fast path) measured with `fovea bench
        serve`: seed-001 (8000/1000 x16), 1000/1000 x256, random-mm (one 1280x720 image + 100 text tokens, 128 out,
        x500) with GPU utilisation sampled by nvidia-smi every 100 ms during the image run
hf:     `fovea bench throughput --compare hf` (1000 in / 256 out x64) on the same checkpoint
--profile-server runs the server under py-spy (benchmarks/pyspy_summary.py sums its samples per process and thread,
the engine's from its serving loop on): where the host spends a run that leaves the GPU idle.
Every step writes its raw JSON; summary.json and summary.md put each figure beside its floor (fovea/bench/floors.py).
--quick shrinks every workload so the script itself can be checked on a CPU with a tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pyspy_summary  # benchmarks/, beside this script
import torch

from fovea.bench.floors import Hardware, workload_floor
from fovea.config.model import ModelConfig

WORKLOADS = {  # name -> (bench flags, input tokens for the floor, output tokens, prompts, image patches)
    "seed-001": (
        [
            "--dataset-name",
            "random",
            "--random-input-len",
            "8000",
            "--random-output-len",
            "1000",
            "--num-prompts",
            "16",
        ],
        8000,
        1000,
        16,
        0,
    ),
    "random-1000-1000-x256": (
        [
            "--dataset-name",
            "random",
            "--random-input-len",
            "1000",
            "--random-output-len",
            "1000",
            "--num-prompts",
            "256",
        ],
        1000,
        1000,
        256,
        0,
    ),
    "random-mm-720p-x500": (
        [
            "--dataset-name",
            "random-mm",
            "--endpoint",
            "/v1/chat/completions",
            "--random-input-len",
            "100",
            "--random-output-len",
            "128",
            "--num-prompts",
            "500",
            "--random-mm-base-items-per-request",
            "1",
            "--random-mm-bucket-config",
            "{(720, 1280, 1): 1.0}",
            "--random-mm-limit-mm-per-prompt",
            '{"image": 1}',
        ],
        100 + 1196,
        128,
        500,
        4784,
    ),
}
QUICK = {"--random-input-len": "64", "--random-output-len": "16", "--num-prompts": "4"}


def hardware(commit: str) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "commit": commit}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():  # read off nvidia-smi: this process keeps no CUDA context beside the server's
        info["gpu"], info["driver"] = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
            )
            .stdout.strip()
            .split(", ")[:2]
        )
    else:
        info["gpu"] = "none (CPU: " + platform.processor() + ")"
    return info


class GpuSampler(threading.Thread):
    """nvidia-smi utilisation every 100 ms while a run lasts."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[int] = []
        self.proc = None

    def run(self):
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100"],
                stdout=subprocess.PIPE,
                text=True,
            )
        except FileNotFoundError:
            return
        for line in self.proc.stdout:
            if line.strip().isdigit():
                self.samples.append(int(line))

    def stop(self) -> dict:
        if self.proc:
            self.proc.terminate()
        busy = self.samples
        return {
            "gpu_util_samples": len(busy),
            "gpu_util_mean": sum(busy) / len(busy) if busy else None,
            "gpu_util_p10": sorted(busy)[len(busy) // 10] if busy else None,
        }


def start_server(model: str, port: int, extra: list[str], log: Path, profile: Path | None = None) -> subprocess.Popen:
    """`profile`: the server runs under py-spy (every process and thread, waits included), which writes this file
    when the server exits (stop_server)."""
    # what holds the GPU before the server takes its share (an engine refuses to start without it)
    apps = (
        subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv"],
            capture_output=True,
            text=True,
        )
        if torch.cuda.is_available()
        else None
    )
    print("GPU before the server:", apps.stdout if apps else "-", flush=True)
    cmd = [
        sys.executable,
        "-m",
        "fovea.cli",
        "serve",
        model,
        "--port",
        str(port),
        "--no-enable-prefix-caching",
        "--disable-log-requests",
        "--uvicorn-log-level",
        "warning",
    ] + extra
    if profile is not None:  # py-spy starts the server: its processes are py-spy's own children, readable without
        # the ptrace capability a container may lack
        pyspy = ["py-spy", "record", "--subprocesses", "--threads", "--idle", "--nonblocking", "--rate", "50"]
        cmd = pyspy + ["--format", "raw", "--output", str(profile), "--"] + cmd
    print("$", " ".join(cmd), flush=True)
    server = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 900
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            time.sleep(2)
    server.kill()
    raise RuntimeError("server did not come up")


def stop_server(server: subprocess.Popen, profiled: bool) -> None:
    """SIGTERM to the server; under py-spy to py-spy's child, the server, so that py-spy sees it exit and writes."""
    pids = [server.pid]
    if profiled and server.poll() is None:
        pids = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split() or pids
    for pid in pids:
        os.kill(int(pid), signal.SIGTERM)
    server.wait(120)


def bench_serve(model: str, port: int, name: str, flags: list[str], out: Path, quick: bool) -> dict:
    if quick:
        flags = [QUICK.get(prev, flag) for prev, flag in zip([""] + flags, flags)]  # values after QUICK's flags
    cmd = [
        sys.executable,
        "-m",
        "fovea.cli",
        "bench",
        "serve",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--tokenizer",
        model,
        "--ignore-eos",
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        f"{name}.json",
        "--label",
        name,
        "--disable-tqdm",
    ] + flags
    print("$", " ".join(cmd), flush=True)
    sampler = GpuSampler() if "random-mm" in name else None
    if sampler:
        sampler.start()
    subprocess.run(cmd, check=True)
    result = json.loads((out / f"{name}.json").read_text())
    if sampler:
        result.update(sampler.stop())
        (out / f"{name}.json").write_text(json.dumps(result, indent=2))  # kept even if a later step fails
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default=os.environ.get("FOVEA_COMMIT", "unknown"))
    parser.add_argument("--steps", default="rates,serve,hf")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--server-args", default="", help="extra `fovea serve` flags (none: the defaults)")
    parser.add_argument("--rates", help="MATMUL_TFLOPS,COPY_TB_S measured earlier in the run (no rates step)")
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--profile-server", action="store_true", help="run the server under py-spy (OUT/server-pyspy)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"hardware": hardware(args.commit), "server_args": args.server_args, "workloads": {}}
    steps = args.steps.split(",")
    matmul, copy = (float(x) for x in args.rates.split(",")) if args.rates else (798, 3.0)
    rates = {"matmul_tflops": matmul, "copy_tb_s": copy}
    if "rates" in steps:  # in a child process: whatever it leaves on the GPU is gone before the server starts
        code = f"import json; from fovea.bench.kernels import measure_rates; print(json.dumps(measure_rates({args.quick})))"
        rates = json.loads(
            subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
            .stdout.strip()
            .splitlines()[-1]
        )
    summary["rates"] = rates
    print("rates:", rates, flush=True)
    hw = Hardware(rates["matmul_tflops"] * 1e12, rates["copy_tb_s"] * 1e12)
    config = ModelConfig.from_dir(args.model)
    if "serve" in steps:
        profile = out / "server-pyspy.txt" if args.profile_server else None
        server = start_server(args.model, args.port, args.server_args.split(), out / "server.log", profile)
        try:
            for name in args.workloads.split(","):
                flags, input_len, output_len, prompts, patches = WORKLOADS[name]
                result = bench_serve(args.model, args.port, name, flags, out, args.quick)
                if not args.quick:
                    result["floor"] = workload_floor(config, hw, input_len, output_len, prompts, image_patches=patches)
                summary["workloads"][name] = result
        finally:
            stop_server(server, profile is not None)
        if profile is not None:  # the engine's samples from its serving loop on: its start-up left out
            summary["server_profile"] = pyspy_summary.summarize(profile.read_text().splitlines(), within="_serve")
            (out / "server-pyspy.json").write_text(json.dumps(summary["server_profile"], indent=1))
    if "hf" in steps:
        quick = ["--random-input-len", "64", "--random-output-len", "8", "--num-prompts", "4"]
        cmd = (
            [
                sys.executable,
                "-m",
                "fovea.cli",
                "bench",
                "throughput",
                "--model",
                args.model,
                "--compare",
                "hf",
                "--dataset-name",
                "random",
                "--output-json",
                str(out / "hf-compare.json"),
            ]
            + (
                quick
                if args.quick
                else ["--random-input-len", "1000", "--random-output-len", "256", "--num-prompts", "64"]
            )
            + ["--gpu-memory-utilization", "0.45"]
            + args.server_args.split()
        )  # transformers' model fits beside
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        summary["hf"] = json.loads((out / "hf-compare.json").read_text())
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(summary_table(summary))
    print(summary_table(summary))


def summary_table(summary: dict) -> str:
    hw, rates = summary["hardware"], summary["rates"]
    lines = [
        f"{hw.get('gpu')} driver {hw.get('driver', '-')}, torch {hw['torch']}, triton {hw.get('triton', '-')}, "
        f"commit {hw['commit']}; matmul {rates['matmul_tflops']:.0f} TFLOP/s, copy {rates['copy_tb_s']:.2f} TB/s",
        "",
        "| workload | duration s | floor s | x floor | output tok/s | mean TTFT ms | mean TPOT ms | "
        "TPOT floor ms | x floor | GPU util % |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in summary["workloads"].items():
        floor = r.get("floor") or {}
        total, tpot = floor.get("total_s"), floor.get("tpot_floor_ms")
        ratio = f"{r['duration'] / total:.2f}" if total else "-"
        tpot_ratio = f"{r['mean_tpot_ms'] / tpot:.2f}" if tpot else "-"
        util = r.get("gpu_util_mean")
        lines.append(
            f"| {name} | {r['duration']:.2f} | {total or 0:.2f} | {ratio} | {r['output_throughput']:.0f} | "
            f"{r['mean_ttft_ms']:.0f} | {r['mean_tpot_ms']:.2f} | {tpot or 0:.2f} | {tpot_ratio} | "
            f"{'-' if util is None else f'{util:.0f}'} |"
        )
    if "hf" in summary:
        hf = summary["hf"]
        lines += [
            "",
            f"offline throughput vs HF generate: fovea {hf['fovea']['output_tokens_per_second']:.0f} vs hf "
            f"{hf['hf']['output_tokens_per_second']:.0f} output tok/s = {hf['ratio']:.1f}x",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
