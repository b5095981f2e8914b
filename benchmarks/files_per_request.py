"""How many of the project's files one chat with an image runs through (issue 54's "<= 45 files" target).

    python benchmarks/files_per_request.py [--out FILE] [--stream]

Starts `fovea serve` on the embedded demo model with a tracer in every Python process it starts (the HTTP server,
the engine process, the image decoding workers; a sitecustomize on PYTHONPATH installs it), sends one chat
completion with an image to warm up, then a second with another image, and counts the files under fovea/ whose
code ran between the second request's start and its response, in any process. Python function calls are traced
(sys.setprofile), so a file counts when a function of it (or its module body, on a late import) runs. It also
prints the places (process, thread) that code ran in, in time order.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from serving import running_server  # noqa: E402 - the tests' way of starting `fovea serve`

PACKAGE = str(ROOT / "fovea") + os.sep

TRACER = """
import os, sys, threading, time
if os.environ.get("FOVEA_TRACE_FILES"):
    _root, _last = os.environ["FOVEA_TRACE_ROOT"], {}
    _out = open(os.environ["FOVEA_TRACE_FILES"] + f".{os.getpid()}.log", "a", buffering=1)

    def _profile(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(_root):
                now, thread = time.monotonic(), threading.current_thread().name
                if now - _last.get((thread, name), -1.0) > 0.001:  # a line per thread, file and millisecond at most
                    _last[thread, name] = now
                    _out.write(f"{now:.6f} {thread.replace(' ', '_')} {name}:{frame.f_code.co_name}\\n")

    sys.setprofile(_profile)
    threading.setprofile(_profile)
"""


def image_url(shade: int) -> str:
    from fovea.demo import demo_image

    picture = demo_image()
    picture.paste((shade, 90, 200), (10, 10, 60, 60))
    data = io.BytesIO()
    picture.save(data, format="PNG")
    return "data:image/png;base64," + base64.b64encode(data.getvalue()).decode()


def chat(base: str, shade: int, stream: bool) -> None:
    body = {
        "model": "demo",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_url(shade)}},
                    {"type": "text", "text": "What is in the picture?"},
                ],
            }
        ],
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
    }
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as response:
        response.read()
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="files-per-request-") as tmp:
        work = Path(tmp)
        (work / "hook").mkdir()
        (work / "hook" / "sitecustomize.py").write_text(TRACER)
        env = dict(
            PYTHONPATH=f"{work / 'hook'}:{ROOT}", FOVEA_TRACE_FILES=str(work / "trace"), FOVEA_TRACE_ROOT=PACKAGE
        )
        with running_server(None, "--served-model-name", "demo", startup_s=600, env=env) as (base, _):
            chat(base, 10, args.stream)  # warm-up: first-time paths and late imports
            time.sleep(1.0)
            start = time.monotonic()
            chat(base, 240, args.stream)
            end = time.monotonic()
        files: dict[str, set[int]] = defaultdict(set)  # file -> processes that ran it in the window
        calls = []  # (time, process, thread, file:function) in the window
        for log in work.glob("trace.*.log"):
            pid = int(log.name.split(".")[1])
            for line in log.read_text().splitlines():
                stamp, thread, where = line.split(" ", 2)
                if start <= float(stamp) <= end:
                    where = where.removeprefix(str(ROOT) + os.sep)
                    files[where.rsplit(":", 1)[0]].add(pid)
                    calls.append((float(stamp), pid, thread, where))
    names = sorted(files)
    for name in names:
        print(f"{len(files[name])} process(es)  {name}")
    print(f"{len(names)} files ran for one chat completion with an image{' (streamed)' if args.stream else ''}")
    path = places(calls)
    for place, first_call in path:
        print(f"  {place:40s} {first_call}")
    print(f"{len(path) - 1} changes of place in time order (concurrent work interleaves: see places())")
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        result = {
            "commit": commit.stdout.strip(),
            "stream": args.stream,
            "count": len(names),
            "files": names,
            "functions": {
                name: sorted({w.rsplit(":", 1)[1] for *_, w in calls if w.startswith(name + ":")}) for name in names
            },
            "places": path,
        }
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def places(calls: list[tuple]) -> list[tuple[str, str]]:
    """The places (process, thread) where the project's code ran in the window, in time order, each with the
    first call there; a place comes again each time work comes back to it. The event loop's check that the client
    is still there (every DISCONNECT_POLL_S) is left out. Not a count of hops by itself: work beside the request
    interleaves (the engine's stats messages while it waits for the image, a prompt chunk stepped beside the
    encoder), and a thread that runs no project code (the engine pipe's send thread, the event loop writing the
    response) is not seen; benchmarks/README lists the hops."""
    path: list[tuple[str, str]] = []
    roles: dict[int, str] = {}
    for _, pid, thread, where in sorted(calls):
        if where.endswith(("unless_disconnected", "is_disconnected")):
            continue
        roles.setdefault(pid, f"process {len(roles) + 1}")
        place = f"{roles[pid]}/{thread}"
        if not path or path[-1][0] != place:
            path.append((place, where))
    return path


if __name__ == "__main__":
    main()
