"""Issue 56 in CI: a server's memory stays flat under mixed traffic (a short benchmarks/soak.py run), and a server
process killed mid-traffic leaves nothing behind once the server has recovered: no shared-memory segment, no
open file, no child process."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
from conftest import jpeg_bytes, random_image
from serving import metric, running_server
from test_hostile_load import engine_pid

from fovea.multimodal.image_workers import segment_prefix

ROOT = Path(__file__).resolve().parents[1]


def image_chat(base: str, seed: int) -> int:
    """A chat with a fresh JPEG of its own size (a data URL): its pixels cross to the engine in shared memory."""
    image = jpeg_bytes(random_image(64 + 37 * (seed % 13), 48 + 29 * (seed % 11), seed=seed))
    url = "data:image/jpeg;base64," + base64.b64encode(image).decode()
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "ignore_eos": True}
    try:
        return httpx.post(base + "/v1/chat/completions", json=body, timeout=120).status_code
    except httpx.HTTPError:
        return 0


def segments(server_pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(segment_prefix(server_pid))]


def decoder(front_end: psutil.Process) -> int:
    """An image decoding worker: a child with Pillow's decoders and without torch (the engine has both)."""
    for child in front_end.children():
        maps = open(f"/proc/{child.pid}/maps").read()
        if "PIL/_imaging" in maps and "libtorch" not in maps:
            return child.pid
    raise AssertionError("no decoding worker")


def wait_until(check, timeout_s: float = 120, what: str = "the server to recover") -> None:
    deadline = time.time() + timeout_s
    while not check():
        assert time.time() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.3)


def traffic_then_kill(base: str, victim, seeds: range, freeze_s: float = 0.0) -> list[int]:
    """Image chats, 12 at a time; `victim()` (a pid) is killed once they are under way. `freeze_s`: it is stopped
    that long first, so that requests (and their pixels' segments) are sure to wait in its pipe when it dies (these
    small chats take ~10 ms each: a gauge polled for running ones can miss them all)."""
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(image_chat, base, seed) for seed in seeds]
        time.sleep(0.3)
        pid = victim()
        if freeze_s:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(freeze_s)
        os.kill(pid, signal.SIGKILL)
        return [future.result() for future in futures]


def test_a_killed_engine_or_decoder_leaves_no_segment_file_or_process(tiny_dirs):
    flags = ["--dtype", "float32", "--max-engine-restarts", "3", "--mm-processor-workers", "2"]
    with running_server(tiny_dirs["tiny-3b"], *flags) as (base, server):
        front_end = psutil.Process(server.pid)
        assert {image_chat(base, seed) for seed in range(4)} == {200}
        files, children = front_end.num_fds(), len(front_end.children())

        engine = engine_pid(server.pid)
        statuses = traffic_then_kill(base, lambda: engine, range(100, 160), freeze_s=2.0)
        assert 503 in statuses and set(statuses) <= {200, 503}, statuses
        wait_until(lambda: httpx.get(base + "/health").status_code == 200)
        assert {image_chat(base, seed) for seed in range(200, 204)} == {200}
        wait_until(lambda: not segments(server.pid), 10, f"its segments to go: {segments(server.pid)}")

        statuses = traffic_then_kill(base, lambda: decoder(front_end), range(300, 360))
        assert set(statuses) <= {200, 400, 500, 503}, statuses
        assert {image_chat(base, seed) for seed in range(400, 404)} == {200}
        wait_until(lambda: metric(base, "fovea:num_requests_running") == 0)
        # (a worker killed between making a segment and handing it back: the front end named it, and frees it)
        wait_until(lambda: not segments(server.pid), 10, f"its segments to go: {segments(server.pid)}")

        wait_until(lambda: len(front_end.children()) == children, 30, f"{children} children")
        assert not [c for c in front_end.children() if c.status() == psutil.STATUS_ZOMBIE]
        assert front_end.num_fds() <= files + 2, (files, front_end.num_fds())


def test_three_minutes_of_mixed_traffic_leave_memory_flat(tmp_path):
    """benchmarks/soak.py for 3 minutes (the issue's 60-minute run, short): after a minute's warm-up no process's
    memory rises by more than 1 % and 50 MB along its fitted line, no count of files, threads or segments
    climbs, no request is answered 5xx, the encoder cache stays within its bound, unloaded adapters leave, and no
    KV block is held once idle. 50 MB, not the hour's 20: with this mix the engine's memory swings by 40 MB within a
    minute on this machine (videos, long prompts), which two minutes cannot tell from growth; glibc left alone
    grew the engine by ~60 MB in two minutes of images."""
    out = tmp_path / "soak.json"
    soak = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", "3", "--warmup-minutes", "1"]
    # a processor cache full within the first minute: filling it is not growth
    soak += ["--rate", "4", "--processor-cache-gb", "0.02", "--growth-mb", "50", "--out", str(out)]
    subprocess.run(soak, check=True, timeout=600, capture_output=True)
    result = json.loads(out.read_text())
    grown = {name: row for name, row in result["verdict"].items() if row["grows"]}
    assert not grown, grown
    answered = Counter()
    for key, count in result["outcomes"].items():
        answered[key.rsplit(" ", 1)[1]] += count
    assert answered["500"] == 0 and answered["200"] > 300, result["outcomes"]
    assert result["idle"]["fovea:kv_cache_used_blocks"] == 0
    most = result["most_held"]
    assert most["fovea:encoder_cache_used_tokens"] <= most["fovea:encoder_cache_capacity_tokens"]
    # room for 4 (--max-cpu-loras), ~30 adapters loaded, used and unloaded one after another: they leave
    assert 0 < most["fovea:lora_adapters_held"] <= 3
