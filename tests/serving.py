"""Starting a real `fovea serve` process for tests."""

from __future__ import annotations

import contextlib
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import torch

# On a GPU, the test process's engines and the servers it starts share one card: each takes a small share of it
# (a later --gpu-memory-utilization in a test's own flags wins). Tiny models need little.
GPU_SHARE = 0.06
GPU_SHARE_FLAGS = ["--gpu-memory-utilization", str(GPU_SHARE)] if torch.cuda.is_available() else []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(
    model_dir, *flags: str, startup_s: float = 120, env: dict | None = None, prefix=(), address: str = "127.0.0.1"
):
    """Yields (base URL, process); on exit sends SIGTERM and checks the exit is clean. The output is kept in
    `process.output` once it has stopped. `prefix`: a command the server runs under (a test host's `ip netns
    exec`), where it listens on every address and is reached at `address`."""
    port = free_port()
    model = [] if model_dir is None else [str(model_dir)]  # None: the flags name it
    cmd = [
        *prefix,
        sys.executable,
        "-m",
        "fovea.cli",
        "serve",
        *model,
        "--port",
        str(port),
        "--uvicorn-log-level",
        "warning",
        *GPU_SHARE_FLAGS,
        *(["--host", "0.0.0.0"] if prefix else []),
        *flags,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        start_new_session=True,
    )  # its own process group, as under a terminal or systemd
    # read as it comes: a pipe nobody reads holds 64 kB, and a server that has logged more then blocks in its log
    # call, event loop and all (its request log did, once each line named a few more sampling fields)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()

    def output() -> str:
        reader.join(timeout=60)
        return "".join(lines)

    base = f"http://{address}:{port}"
    deadline = time.time() + startup_s
    with httpx.Client(timeout=1) as client:  # one: each new client's TLS set-up costs ~0.1 s of CPU here
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {output()}")
            try:
                if client.get(base + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"server did not start: {output()}")
            time.sleep(0.3)
    try:
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        proc.output = output()


def metric(base: str, name: str) -> float:
    """The value of one unlabelled-except-model_name sample from /metrics."""
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@contextlib.contextmanager
def drip_host(interval_s: float, headers: bool = False):
    """An image host that sends headers, then one byte every `interval_s` for as long as the client stays
    (`headers`: the status line, then the headers themselves one byte at a time, never finishing them).
    Yields (base URL, an event set when a client hangs up)."""
    closed = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            try:
                if headers:
                    self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                    while True:
                        self.wfile.write(b"X")  # a header name that never ends
                        self.wfile.flush()
                        time.sleep(interval_s)
                self.send_response(200)
                self.send_header("Content-Length", "1000000")
                self.end_headers()
                while True:
                    self.wfile.write(b"\xff")
                    self.wfile.flush()
                    time.sleep(interval_s)
            except OSError:
                closed.set()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", closed
    finally:
        server.shutdown()


def bench_random_mm(base: str, model_dir, model: str, width: int, height: int, num_prompts: int = 4) -> dict:
    """`fovea bench serve` random-mm against a running server: one width x height image a request, 16 prompt and
    4 output tokens (ignore_eos); the result's figures."""
    from fovea.cli import build_parser

    args = build_parser().parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            base,
            "--tokenizer",
            str(model_dir),
            "--model",
            model,
            "--backend",
            "openai-chat",
            "--dataset-name",
            "random-mm",
            "--num-prompts",
            str(num_prompts),
            "--random-input-len",
            "16",
            "--random-output-len",
            "4",
            "--ignore-eos",
            "--random-mm-bucket-config",
            f"{{({width}, {height}, 1): 1.0}}",
            "--random-mm-base-items-per-request",
            "1",
            "--random-mm-limit-mm-per-prompt",
            '{"image": 1, "video": 0}',
            "--disable-tqdm",
        ]  # fmt: skip
    )
    return args.func(args)
