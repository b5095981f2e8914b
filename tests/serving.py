"""Starting a real `fovea serve` process for tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(model_dir, *flags: str, startup_s: float = 120):
    """Yields (base URL, process); on exit sends SIGTERM and checks the exit is clean. The output is kept in
    `process.output` once it has stopped."""
    port = free_port()
    cmd = [sys.executable, "-m", "fovea.cli", "serve", str(model_dir), "--port", str(port),
           "--uvicorn-log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + startup_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start: {proc.communicate()[0]}")
        time.sleep(0.3)
    try:
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.output = proc.communicate(timeout=60)[0]


def metric(base: str, name: str) -> float:
    """The value of one unlabelled-except-model_name sample from /metrics."""
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
