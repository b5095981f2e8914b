"""Where each process and thread of a py-spy recording spent its samples: a table per thread, busiest first.

    py-spy record --subprocesses --threads --idle -f raw -o FILE -- CMD...
    python benchmarks/pyspy_summary.py FILE [--top 25] [--within FUNCTION] [--json OUT]

py-spy's raw format is one line per distinct stack, "frame;frame;...;frame COUNT", the process ("process PID:CMD")
and thread ("thread (TID): NAME") as frames of their own. Each function's share counts the samples whose stack
holds it (inclusive), once per sample; import machinery is left out. With --idle the waits show too (a thread
blocked on a pipe or a lock is sampled where it waits), which is what says whether a process was busy or starved.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path


def split_frames(stack: str) -> list[str]:
    """The stack's frames; a process frame's command line may hold ';' (a spawned child's `-c` code), so one is
    joined again until its quotes close."""
    frames: list[str] = []
    for piece in stack.split(";"):
        if frames and frames[-1].startswith("process ") and frames[-1].count('"') % 2:
            frames[-1] += ";" + piece
        else:
            frames.append(piece)
    return frames


def function(frame: str) -> str:
    """'name (path/to/file.py:123)' -> 'name (path/to/file.py)': one entry per function, not per line."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if where else name


def stacks(lines):
    """(process, thread, the frames below them, samples) per line; the innermost process: a child's stack nests in
    its parent's."""
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = split_frames(stack)
        processes = [i for i, f in enumerate(frames) if f.startswith("process ")]
        process = frames[processes[-1]][:100] if processes else "process"
        body = frames[processes[-1] + 1 if processes else 0 :]
        thread = body.pop(0) if body and body[0].startswith("thread ") else "thread"
        yield process, thread, body, int(count)


def summarize(lines, within: str | None = None) -> dict:
    """`within`: in a thread where some stack passes through a function of that name (e.g. the engine's serving
    loop `_serve`), only the samples that do count (its start-up is left out); other threads count whole."""

    def passes(body: list[str]) -> bool:
        return within is not None and any(f.startswith(within + " (") for f in body)

    parsed = list(stacks(lines))
    inside = {(process, thread) for process, thread, body, _ in parsed if passes(body)}
    threads: Counter = Counter()
    functions: dict[tuple[str, str], Counter] = defaultdict(Counter)
    leaves: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for process, thread, body, count in parsed:
        key = (process, thread)
        if key in inside and not passes(body):
            continue
        calls = [function(f) for f in body if "<frozen importlib" not in f]
        threads[key] += count
        functions[key].update(dict.fromkeys(calls, count))
        if calls:
            leaves[key][calls[-1]] += count
    total = sum(threads.values()) or 1
    return {
        "samples": total,
        "threads": [
            {
                "process": process,
                "thread": thread,
                "samples": n,
                "share": n / total,
                "functions": functions[(process, thread)].most_common(),
                "leaves": leaves[(process, thread)].most_common(),
            }
            for (process, thread), n in threads.most_common()
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--within", default=None, help="a function: its process's samples outside it are left out")
    parser.add_argument("--json", default=None, help="write the whole summary here")
    args = parser.parse_args()
    summary = summarize(Path(args.file).read_text().splitlines(), args.within)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    for entry in summary["threads"]:
        if entry["samples"] < summary["samples"] * 0.01:
            continue
        print(f"\n== {entry['process']} / {entry['thread']}: {entry['samples']} samples")
        for name, n in entry["functions"][: args.top]:
            print(f"  {100 * n / entry['samples']:5.1f}%  {name}")
        print("  where it was (innermost frame):")
        for name, n in entry["leaves"][:8]:
            print(f"  {100 * n / entry['samples']:5.1f}%  {name}")


if __name__ == "__main__":
    main()
