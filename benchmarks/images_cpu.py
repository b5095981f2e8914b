"""Images at scale on the CPU (issue 16), side by side with an earlier commit (its tree from `git archive`) in one run:

1. bytes crossing from the front end to the engine for one 1280x720 JPEG (the pickled request through the pipe,
   plus shared memory)
2. front-end preprocessing rate of 1280x720 JPEG data URLs (photo-like), 24 images through the server's
   preparation threads: the baseline's way, ours with decoding in those threads (--mm-processor-workers 0), and
   ours with 1 and 2 decoding processes
3. `fovea bench serve` random-mm (128 text tokens + one 1280x720 image, 64 tokens out, a request a second) against
   a server of each commit, with default flags and with --max-num-batched-tokens 512: mean and P99 inter-token
   latency while images keep arriving, and the client's CPU

    python benchmarks/images_cpu.py [--baseline 7f036f0] [--prompts 24] [--rate 1]
Raw figures go to benchmarks/results/images_cpu_<commit>.json.
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

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import base64, io, json, pickle, sys, time, concurrent.futures
import numpy as np
from PIL import Image
from fovea import SamplingParams
from fovea.config.engine import EngineConfig
from fovea.frontend.input_processor import InputProcessor

model_dir, variant = sys.argv[1], sys.argv[2]

def photo(seed):  # gradients plus mild noise: compresses like a photo (~200 kB at 1280x720)
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:720, 0:1280].astype(np.float32)
    base = np.stack([x / 1280 * 255, y / 720 * 255, (x + y) / 2000 * 255], axis=-1)
    base += rng.normal(0, 12, size=(90, 160, 1)).repeat(8, 0).repeat(8, 1)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()

config = EngineConfig.from_args(model_dir, dtype="float32", max_model_len=4096)
decoder = None
if variant.startswith("workers"):
    from fovea.multimodal.image_workers import ImageWorkers
    decoder = ImageWorkers(int(variant[len("workers"):]))
inputs = InputProcessor(config, decoder) if decoder else InputProcessor(config)
prompt = lambda url: {"prompt": "<|vision_start|><|image_pad|><|vision_end|>Describe.",
                      "multi_modal_data": {"image": url}}
urls = [photo(i) for i in range(24)]
request = inputs.make_request("r", inputs.process(prompt(urls[0])), SamplingParams())
pipe = len(pickle.dumps(request))
handles = [getattr(item, "pixels", None) for item in request.mm_items]  # the baseline's items hold float patches
handles = [h for h in handles if hasattr(h, "release")]  # shared-memory handles
shared = sum(h.nbytes for h in handles)
for handle in handles:
    handle.release()
with concurrent.futures.ThreadPoolExecutor(6) as pool:  # the server's preparation threads on 2 cores
    list(pool.map(lambda u: inputs.process(prompt(u)), urls[:4]))  # warm
    start = time.perf_counter()
    done = list(pool.map(lambda u: inputs.process(prompt(u)), urls))
    seconds = time.perf_counter() - start
for processed in done:
    for image in processed.images:
        getattr(getattr(image, "pixels", None), "release", lambda: None)()
print(json.dumps({"pipe_bytes": pipe, "shared_bytes": shared, "images_per_s": len(urls) / seconds}))
"""


def probe(tree: Path, model_dir: str, variant: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, model_dir, variant], env=env, capture_output=True, text=True, check=True, cwd=tree
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def serve_bench(
    tree: Path, model_dir: str, prompts: int, rate: float, out_dir: Path, label: str, flags: list[str]
) -> dict:
    """Starts `fovea serve` from `tree`, runs this tree's `fovea bench serve` random-mm against it."""
    import httpx

    port = 8400 + (hash(label) % 500)
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fovea.cli",
            "serve",
            model_dir,
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "4096",
            "--uvicorn-log-level",
            "warning",
            "--disable-log-requests",
            *flags,
        ],
        env=env,
        cwd=tree,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise RuntimeError(f"the {label} server did not start")
            time.sleep(0.5)
        name = f"{label}.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "fovea.cli",
                "bench",
                "serve",
                "--base-url",
                f"http://127.0.0.1:{port}",
                "--tokenizer",
                model_dir,
                "--dataset-name",
                "random-mm",
                "--endpoint",
                "/v1/chat/completions",
                "--random-input-len",
                "128",
                "--random-output-len",
                "64",
                "--num-prompts",
                str(prompts),
                "--request-rate",
                str(rate),
                "--random-mm-bucket-config",
                "{(720, 1280, 1): 1.0}",
                "--random-mm-limit-mm-per-prompt",
                '{"image": 1}',
                "--ignore-eos",
                "--save-result",
                "--result-dir",
                str(out_dir),
                "--result-filename",
                name,
                "--percentile-metrics",
                "ttft,tpot,itl,e2el",
                "--metric-percentiles",
                "50,99",
                "--disable-tqdm",
                "--seed",
                "0",
            ],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=True,
            cwd=ROOT,
            capture_output=True,
        )
        return json.loads((out_dir / name).read_text())
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="7f036f0")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--rate", type=float, default=1.0)
    args = parser.parse_args()
    from fovea.testing.tiny import write_tiny_checkpoint

    work = Path(tempfile.mkdtemp())
    model_dir = str(write_tiny_checkpoint(work / "tiny-3b", "tiny-3b", seed=0))
    baseline = work / "baseline"
    baseline.mkdir()
    subprocess.run(f"git archive {args.baseline} | tar -x -C {baseline}", shell=True, check=True, cwd=ROOT)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    transfer = {
        f"{args.baseline} (threads)": probe(baseline, model_dir, "threads"),
        f"{commit} threads (--mm-processor-workers 0)": probe(ROOT, model_dir, "threads"),
        f"{commit} 1 worker": probe(ROOT, model_dir, "workers1"),
        f"{commit} 2 workers": probe(ROOT, model_dir, "workers2"),
    }
    # the server's default token budget (2048: a new prompt's 1,324 tokens prefill in one step) and a smaller one
    # (prefill in chunks of 512), which bounds how long any step runs next to the decodes
    serving = {
        f"{label} {' '.join(flags) or 'default flags'}": serve_bench(
            tree, model_dir, args.prompts, args.rate, work, f"{label}{len(flags)}", flags
        )
        for flags in ([], ["--max-num-batched-tokens", "512"])
        for label, tree in ((args.baseline, baseline), (commit, ROOT))
    }
    keys = ("duration", "mean_ttft_ms", "mean_itl_ms", "p99_itl_ms", "mean_tpot_ms", "client_cpu_s")
    record = {
        "benchmark": "images_cpu",
        "commit": commit,
        "baseline": args.baseline,
        "prompts": args.prompts,
        "rate": args.rate,
        "transfer": transfer,
        "serving": {label: {k: r.get(k) for k in keys} for label, r in serving.items()},
    }
    out = ROOT / "benchmarks" / "results" / f"images_cpu_{commit}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print("| front end | bytes through the pipe | bytes in shared memory | images/s (1280x720 JPEG) |")
    print("| --- | --- | --- | --- |")
    for label, r in transfer.items():
        print(
            f"| {label} | {r['pipe_bytes'] / 1e6:.2f} MB | {r['shared_bytes'] / 1e6:.2f} MB | {r['images_per_s']:.1f} |"
        )
    print("\n| server | duration s | mean TTFT ms | mean ITL ms | P99 ITL ms | P99 / mean ITL | client CPU s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, r in record["serving"].items():
        ratio = r["p99_itl_ms"] / r["mean_itl_ms"] if r["mean_itl_ms"] else float("nan")
        print(
            f"| {label} | {r['duration']:.1f} | {r['mean_ttft_ms']:.0f} | {r['mean_itl_ms']:.1f} | "
            f"{r['p99_itl_ms']:.1f} | {ratio:.1f}x | {r.get('client_cpu_s') or float('nan'):.1f} |"
        )
    print(f"raw: {out}")


if __name__ == "__main__":
    main()
