"""Memory under a long run of mixed traffic (issue 56): does any server process grow?

    python benchmarks/soak.py --minutes 60 --out FILE [--plot PNG] [--rate 6] [--warmup-minutes 5] [--seed 0]
        [--kinds K1,K2] [--server-env KEY=VALUE ...] [--processor-cache-gb 0.25] [--base-url URL | -- SERVER FLAGS]

Starts `fovea serve` on the embedded demo model (or the model and flags given after `--`; the log goes to FILE.log)
with its caches sized to fill within minutes (`--mm-processor-cache-gb 0.25` unless --processor-cache-gb says
otherwise, FOVEA_STORED_RESPONSES=200), or
drives a server already running at `--base-url` (loopback only). Requests arrive as a Poisson process at `--rate`
per second, at most CONCURRENCY at once, each one of KINDS: chats with fresh and repeated images of many sizes and
formats (data URLs, and a local HTTP image host), videos, streams that ~30 % of clients leave early, clients that
give up, structured outputs with ever-new JSON schemas and regexes, tools, n=2 with logprobs, Responses chains
with `store` and `previous_response_id`, images given as the tower's output (image_embeds), LoRA adapters loaded
under a new name, used once and unloaded (the server then runs with --enable-lora and runtime adapter updates),
requests that fail validation, and prompts long enough to preempt others and evict cached prefixes.

Every second it samples each process of the server (the front end and its children: the engine, image decoding
workers, tensor-parallel ranks): RSS, USS, open files, threads; the /dev/shm segments; and the engine's gauges
from /metrics (KV blocks used, requests running and waiting, the encoder cache's references and rows against its
bound, LoRA adapters held). After the traffic, an
idle sample. The verdict, per series after the warm-up: its growth from the first to the last minute, and its
least-squares slope per hour; memory that grows by more than 1 % and 20 MB, or a count that keeps climbing,
fails it. JSON (every sample and the verdict) and, with --plot, a PNG of every series.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.server
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import numpy as np
import psutil
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = 32
GAUGES = ("fovea:kv_cache_used_blocks", "fovea:num_requests_running", "fovea:num_requests_waiting")
GAUGES += ("fovea:encoder_cache_references", "fovea:encoder_cache_used_tokens", "fovea:encoder_cache_capacity_tokens")
GAUGES += ("fovea:lora_adapters_held",)
GROWTH_PCT, GROWTH_MB = 1.0, 20.0  # memory grows when both are exceeded (issue 56's target)

# ------------------------------------------------------------------------------------------------ the traffic


def image_bytes(rng: random.Random, size: tuple[int, int] | None = None, fmt: str | None = None) -> tuple[bytes, str]:
    width, height = size or (rng.randint(16, 1280), rng.randint(16, 960))
    pixels = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 256, (height, width, 3), dtype=np.uint8)
    fmt = fmt or rng.choice(["PNG", "JPEG", "WEBP"])
    data = io.BytesIO()
    Image.fromarray(pixels).save(data, format=fmt)
    return data.getvalue(), fmt.lower()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def video_url(rng: random.Random) -> str:
    import av

    frames = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 256, (8, 64, 96, 3), dtype=np.uint8)
    data = io.BytesIO()
    with av.open(data, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=4)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return data_url(data.getvalue(), "video/mp4")


class ImageHost:
    """Images over HTTP on loopback: /N.png is a fresh image for each N."""

    def __init__(self):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                data, _ = image_bytes(random.Random(self.path), fmt="PNG")
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"


class Traffic:
    """What each kind of request sends; `run` returns (kind, status) or raises what the client saw."""

    def __init__(self, base: str, model: str, rng: random.Random, images: ImageHost, adapter: Path | None = None):
        self.base, self.model, self.rng, self.images, self.adapter = base, model, rng, images, adapter
        self.repeated = [data_url(image_bytes(rng, (224 + 32 * i, 224), "PNG")[0], "image/png") for i in range(8)]
        self.videos = [video_url(rng) for _ in range(3)]
        self.responses: list[str] = []  # ids of stored responses to continue
        self.counter = 0
        words = ["alpha", "beta", "gamma", "delta", "image", "river", "stone", "cloud", "seven", "blue"]
        self.long_text = " ".join(rng.choice(words) for _ in range(3000))

    def chat(self, content, **extra) -> dict:
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": 8}
        return {**body, "temperature": 0.7, **extra}

    def image_chat(self, url: str, **extra) -> dict:
        return self.chat(
            [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe."}], **extra
        )

    async def run(self, client: httpx.AsyncClient, kind: str) -> int:
        rng = self.rng
        self.counter += 1
        post = lambda body, path="/v1/chat/completions", **kw: client.post(self.base + path, json=body, **kw)  # noqa: E731
        if kind == "image_fresh":
            data, fmt = image_bytes(rng)
            return (await post(self.image_chat(data_url(data, f"image/{fmt}")))).status_code
        if kind == "image_repeated":
            return (await post(self.image_chat(rng.choice(self.repeated)))).status_code
        if kind == "image_http":
            return (await post(self.image_chat(f"{self.images.base}/{self.counter}.png"))).status_code
        if kind == "image_embeds":  # what the tower would make of an image: random, on a random grid
            return (await post(self.chat([embeds_part(rng), {"type": "text", "text": "Describe."}]))).status_code
        if kind == "video":
            part = {"type": "video_url", "video_url": {"url": rng.choice(self.videos)}}
            return (await post(self.chat([part, {"type": "text", "text": "What happens?"}]))).status_code
        if kind == "stream":
            body = self.image_chat(rng.choice(self.repeated), stream=True, max_tokens=24)
            async with client.stream("POST", self.base + "/v1/chat/completions", json=body) as response:
                leave = rng.random() < 0.3
                async for _ in response.aiter_lines():
                    if leave:
                        break  # the client leaves mid-stream
                return response.status_code
        if kind == "gives_up":
            try:
                await post(self.chat("Write a long story.", max_tokens=200), timeout=0.05)
            except httpx.TimeoutException:
                return 0  # the client gave up
            return 200
        if kind == "json_schema":
            schema = {
                "type": "object",
                "properties": {f"field_{self.counter}_{i}": {"type": "integer"} for i in range(rng.randint(1, 4))},
            }
            body = self.chat(
                "Fill it.", response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
            )
            return (await post(body)).status_code
        if kind == "regex":
            return (
                await post(self.chat("Answer.", structured_outputs={"regex": f"[a-z]{{1,{1 + self.counter % 50}}}"}))
            ).status_code
        if kind == "tools":
            tool = {
                "type": "function",
                "function": {"name": f"tool_{self.counter % 20}", "parameters": {"type": "object"}},
            }
            return (await post(self.chat("Use a tool.", tools=[tool], tool_choice="auto"))).status_code
        if kind == "n2_logprobs":
            return (await post(self.chat("Two answers.", n=2, logprobs=True, top_logprobs=3))).status_code
        if kind == "responses":
            body = {"model": self.model, "input": "Go on.", "max_output_tokens": 8, "store": True}
            if self.responses and rng.random() < 0.7:
                body["previous_response_id"] = rng.choice(self.responses[-50:])
            response = await post(body, "/v1/responses")
            if response.status_code == 200:
                self.responses.append(response.json()["id"])
            return response.status_code
        if kind == "invalid":
            bodies = [
                self.chat("x", temperature=-1),
                self.chat("x", model="nope"),
                {"messages": "x"},
                self.chat("x", n=0),
            ]
            return (await post(rng.choice(bodies))).status_code
        if kind == "lora":  # an adapter loaded under a new name, used once, unloaded
            name = f"adapter-{self.counter}"
            loaded = await post({"lora_name": name, "lora_path": str(self.adapter)}, "/v1/load_lora_adapter")
            if loaded.status_code != 200:
                return loaded.status_code
            answered = await post(self.chat("Name a colour.", model=name))
            unloaded = await post({"lora_name": name}, "/v1/unload_lora_adapter")
            return max(answered.status_code, unloaded.status_code)
        if kind == "long_prompt":
            start = rng.randrange(1000)
            return (await post(self.chat(self.long_text[start:] + f" {self.counter}", max_tokens=16))).status_code
        raise ValueError(kind)


KINDS = {  # kind: weight
    "image_fresh": 4, "image_repeated": 4, "image_http": 2, "video": 1, "stream": 3, "gives_up": 1,
    "json_schema": 1, "regex": 1, "tools": 1, "n2_logprobs": 1, "responses": 2, "invalid": 1, "long_prompt": 1,
    "lora": 1, "image_embeds": 1,
}  # fmt: skip


def embeds_part(rng: random.Random, merge: int = 2) -> dict:
    """An image_embeds content part for the demo model (its tower hands over 64 values per token, one token per
    merge x merge patches) on a grid of up to 16 x 16 patches."""
    import torch

    height, width = merge * rng.randint(1, 8), merge * rng.randint(1, 8)
    embeds = torch.randn(height * width // merge**2, 64, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    saved = io.BytesIO()
    torch.save(embeds, saved)
    encoded = base64.b64encode(saved.getvalue()).decode()
    return {"type": "image_embeds", "image_embeds": {"image_embeds": encoded, "image_grid_thw": [1, height, width]}}


def write_adapter(model_dir: Path, out: Path, rank: int = 4) -> Path:
    """A PEFT adapter of random weights on the language model's q_proj layers, shaped from the checkpoint."""
    import safetensors.torch
    import torch
    from safetensors import safe_open

    torch.manual_seed(0)
    tensors = {}
    for shard in model_dir.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as checkpoint:
            for key in checkpoint.keys():
                if key.endswith("self_attn.q_proj.weight") and "visual" not in key:
                    outputs, inputs = checkpoint.get_slice(key).get_shape()
                    module = "base_model.model." + key.removesuffix(".weight")
                    tensors[module + ".lora_A.weight"] = torch.randn(rank, inputs) * 0.05
                    tensors[module + ".lora_B.weight"] = torch.randn(outputs, rank) * 0.05
    out.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"], "bias": "none"}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


async def drive(
    traffic: Traffic, minutes: float, rate: float, outcomes: Counter, rng: random.Random, kinds: dict[str, int]
) -> None:
    limit = asyncio.Semaphore(CONCURRENCY)
    kinds, weights = zip(*kinds.items())

    async def one(client, kind):
        try:
            status = await traffic.run(client, kind)
            outcomes[kind, status // 100 * 100 if status else "client left"] += 1
        except httpx.HTTPError as error:
            outcomes[kind, type(error).__name__] += 1
        finally:
            limit.release()

    end, tasks = time.monotonic() + minutes * 60, set()
    async with httpx.AsyncClient(timeout=120) as client:
        while time.monotonic() < end:
            await asyncio.sleep(rng.expovariate(rate))
            await limit.acquire()
            task = asyncio.create_task(one(client, rng.choices(kinds, weights)[0]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)


# ------------------------------------------------------------------------------------------------ the samples


def shm_segments() -> tuple[int, int]:
    count = size = 0
    for entry in os.scandir("/dev/shm"):
        try:
            if entry.is_file():
                count, size = count + 1, size + entry.stat().st_size
        except FileNotFoundError:  # freed while being read: an image's segment lives only while it is in flight
            continue
    return count, size


def gauges(client: httpx.Client, base: str) -> dict[str, float]:
    found = {}
    try:
        for line in client.get(base + "/metrics").text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in GAUGES:
                found[name] = float(line.rsplit(" ", 1)[1])
    except httpx.HTTPError:
        pass
    return found


def sample(root: psutil.Process, base: str, start: float) -> dict:
    processes = {}
    for proc in [root] + root.children(recursive=True):
        try:
            with proc.oneshot():
                memory = proc.memory_full_info()
                processes[proc.pid] = {
                    "parent": proc.ppid(),
                    "rss_mb": memory.rss / 2**20,
                    "uss_mb": memory.uss / 2**20,
                    "fds": proc.num_fds(),
                    "threads": proc.num_threads(),
                }
        except psutil.Error:  # it ended while being read
            continue
    count, size = shm_segments()
    return {"t": time.monotonic() - start, "processes": processes, "shm_segments": count, "shm_mb": size / 2**20}


class Sampler(threading.Thread):
    def __init__(self, root: psutil.Process, base: str):
        super().__init__(daemon=True)
        self.root, self.base, self.samples, self.running = root, base, [], True
        self.start_time = time.monotonic()
        self.client = httpx.Client(timeout=5)  # one for the run: a client's TLS set-up costs ~0.1 s of CPU here

    def run(self) -> None:
        while self.running:
            tick = time.monotonic()
            self.samples.append({**sample(self.root, self.base, self.start_time), **gauges(self.client, self.base)})
            time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))


# ------------------------------------------------------------------------------------------------ the verdict


def series(samples: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Every series by name: each process's memory, files and threads (named by pid: a restarted process is a new
    series), /dev/shm and the gauges."""
    out = defaultdict(list)
    for s in samples:
        for pid, values in s["processes"].items():
            for key in ("rss_mb", "uss_mb", "fds", "threads"):
                out[f"{pid}/{key}"].append((s["t"], values[key]))
        for key in ("shm_segments", "shm_mb", *GAUGES):
            if key in s:
                out[key].append((s["t"], s[key]))
    return dict(out)


def verdict(
    named: dict[str, list[tuple[float, float]]], warmup_s: float, growth_mb: float = GROWTH_MB
) -> dict[str, dict]:
    """Per series after the warm-up: first and last minute's means, slope per hour, and the rise of that fitted
    line over the run (`trend`); `grows` where memory's trend passes both bounds (a minute's mean of a process whose
    memory swings between trims by tens of MB says more about where the swing stood than about growth: the
    engine's last minute at a4a3390 averaged 535 MB over a lowest of 498 and a median of 529), or a count (files,
    threads, segments) stays above the first half's highest."""
    out = {}
    for name, points in named.items():
        points = [(t, v) for t, v in points if t >= warmup_s]
        if len(points) < 10 or name in GAUGES:
            continue
        t, v = map(np.array, zip(*points))
        first, last = v[t <= t[0] + 60].mean(), v[t >= t[-1] - 60].mean()
        slope = float(np.polyfit(t / 3600, v, 1)[0]) if t[-1] > t[0] else 0.0
        trend = slope * (t[-1] - t[0]) / 3600
        if name.endswith("_mb"):
            grows = trend > growth_mb and trend / max(first, 1e-9) * 100 > GROWTH_PCT
        else:  # a count: grows when the last minute never falls to the highest of the first half (a trend: a
            # pool that starts threads as it needs them, up to its size, steps up once and stays)
            grows = v[t >= t[-1] - 60].min() > v[t <= (t[0] + t[-1]) / 2].max()
        out[name] = {
            "first": float(first),
            "last": float(last),
            "slope_per_hour": slope,
            "trend": trend,
            "grows": bool(grows),
        }
    return out


def plot(named: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = ["rss_mb", "uss_mb", "fds", "threads", "shm", "fovea:"]
    fig, axes = plt.subplots(len(groups), 1, figsize=(10, 2.6 * len(groups)), sharex=True)
    for axis, group in zip(axes, groups):
        for name, points in named.items():
            if group in name:
                t, v = zip(*points)
                axis.plot(np.array(t) / 60, v, label=name, linewidth=0.8)
        axis.set_ylabel(group)
        axis.legend(fontsize=6, loc="upper left")
    axes[-1].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------------------ main


def commands(samples: list[dict]) -> dict[int, str]:
    """What each sampled process is: its command line's start (a spawned child names the multiprocessing entry)."""
    pids = {pid for s in samples for pid in s["processes"]}
    out = {}
    for pid in sorted(pids):
        try:
            out[pid] = " ".join(psutil.Process(pid).cmdline())[:160]
        except psutil.Error:
            out[pid] = "(ended)"
    return out


def thread_highs(log: Path) -> list[str]:
    """The server's own account of its Python threads by name at each new high (fovea/core/memory.py): tells a
    pool reaching its size from a leak, where the sampled counts only rise."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [line for line in lines if "Python threads, the most so far" in line]


def start_server(
    flags: list[str], log: Path, extra_env: dict[str, str], lora: bool, cache_gb: str
) -> tuple[subprocess.Popen, str]:
    sys.path.insert(0, str(ROOT / "tests"))
    from serving import free_port  # noqa: E402 - the tests' helper

    port = free_port()
    defaults = ["--served-model-name", "demo", "--mm-processor-cache-gb", cache_gb, "--enable-auto-tool-choice"]
    defaults += ["--tool-call-parser", "hermes", "--allowed-media-domains", "127.0.0.1", "--enable-mm-embeds"]
    defaults += ["--num-gpu-blocks-override", "400"]  # 6,400 tokens: two long prompts at once preempt others
    if lora:
        defaults += ["--enable-lora", "--max-lora-rank", "8", "--max-cpu-loras", "4"]
    cmd = [sys.executable, "-m", "fovea.cli", "serve", "--port", str(port), *(flags or defaults)]
    env = {**os.environ, "FOVEA_STORED_RESPONSES": "200", "OMP_NUM_THREADS": "1", **extra_env}
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=1) as client:
        for _ in range(1200):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
            try:
                if client.get(base + "/health").status_code == 200:
                    return proc, base
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start in 10 minutes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--warmup-minutes", type=float, default=5)
    parser.add_argument("--rate", type=float, default=6.0, help="requests per second (Poisson arrivals)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--plot")
    parser.add_argument("--base-url", help="a running server (loopback), whose process tree is sampled")
    parser.add_argument("--model", default="demo", help="the served model name to ask for")
    parser.add_argument("--kinds", help=f"only these kinds of request, comma-separated ({', '.join(KINDS)})")
    parser.add_argument("--server-env", action="append", default=[], help="KEY=VALUE for the server's processes")
    parser.add_argument("--processor-cache-gb", default="0.25", help="the server's --mm-processor-cache-gb")
    parser.add_argument("--growth-mb", type=float, default=GROWTH_MB, help="memory grows past this many MB (and 1 %%)")
    parser.add_argument("--verdict-of", help="a saved run's JSON: its verdict by today's rule, printed (no run)")
    parser.add_argument("flags", nargs="*", help="after --: `fovea serve` arguments instead of the defaults")
    args = parser.parse_args()
    if args.verdict_of:
        saved = json.loads(Path(args.verdict_of).read_text())
        print_verdict(verdict(series(saved["samples"]), args.warmup_minutes * 60, args.growth_mb))
        return
    rng = random.Random(args.seed)
    kinds = {kind: KINDS[kind] for kind in args.kinds.split(",")} if args.kinds else KINDS
    server, adapter = None, None
    if "lora" in kinds:
        from fovea.testing.tiny import demo_model_dir

        adapter = write_adapter(demo_model_dir(), Path(tempfile.mkdtemp(prefix="fovea-soak-adapter-")))
    if args.base_url:
        base = args.base_url.rstrip("/")
        port = int(base.rsplit(":", 1)[1])
        pids = [c.pid for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port]
        root = psutil.Process(pids[0])
    else:
        env = dict(item.split("=", 1) for item in args.server_env)
        server, base = start_server(
            args.flags, Path(args.out + ".log"), env, adapter is not None, args.processor_cache_gb
        )
        root = psutil.Process(server.pid)
    images = ImageHost()
    traffic = Traffic(base, args.model, rng, images, adapter)
    sampler = Sampler(root, base)
    sampler.start()
    outcomes: Counter = Counter()
    try:
        asyncio.run(drive(traffic, args.minutes, args.rate, outcomes, rng, kinds))
        time.sleep(5)  # idle: whatever is still held now stays
        idle = {**sample(root, base, sampler.start_time), **gauges(sampler.client, base)}
        processes = commands(sampler.samples)
    finally:
        sampler.running = False
        sampler.join()
        if server is not None:
            server.terminate()
            server.wait(60)
        if adapter is not None:
            shutil.rmtree(adapter, ignore_errors=True)
    named = series(sampler.samples)
    result = {
        "kinds": args.kinds or ",".join(KINDS),
        "server_env": args.server_env,
        "processes": processes,
        "minutes": args.minutes,
        "rate": args.rate,
        "outcomes": {f"{kind} {status}": n for (kind, status), n in sorted(outcomes.items(), key=str)},
        "idle": idle,
        "verdict": verdict(named, args.warmup_minutes * 60, args.growth_mb),
        "most_held": {name: max((v for _, v in named.get(name, ())), default=0) for name in GAUGES},
        "thread_highs": thread_highs(Path(args.out + ".log")),
        "samples": sampler.samples,
    }
    Path(args.out).write_text(json.dumps(result) + "\n")
    if args.plot:
        plot(named, args.plot)
    errors = sum(n for (kind, status), n in outcomes.items() if status == 500)
    print(f"{sum(outcomes.values())} requests, {errors} answered 5xx; idle: {idle.get(GAUGES[0])} KV blocks used")
    most = result["most_held"]
    print(f"most held: encoder cache {most['fovea:encoder_cache_used_tokens']:.0f} of "
          f"{most['fovea:encoder_cache_capacity_tokens']:.0f} rows, {most['fovea:lora_adapters_held']:.0f} LoRA adapters")  # fmt: skip
    print_verdict(result["verdict"])


def print_verdict(rows: dict[str, dict]) -> None:
    for name, row in rows.items():
        flag = "GROWS" if row["grows"] else "flat"
        print(f"{flag:6s} {name:28s} {row['first']:10.1f} -> {row['last']:10.1f}  {row['slope_per_hour']:+10.1f} /h"
              f"  trend {row['trend']:+8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
