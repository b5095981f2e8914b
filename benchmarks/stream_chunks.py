"""The event loop's cost of one streamed chunk: `chat_stream` and `completion_stream` (fovea/server/openai_serving.py)
turning a stream of one-token outputs (a choice's new text alone, the commonest chunk) into SSE chunks, without the
HTTP server around them. Microseconds per chunk, medians of --repeats runs of --chunks chunks.

    python benchmarks/stream_chunks.py --out FILE [--baseline TREE] [--chunks 20000] [--repeats 5]

`--baseline DIR` (a `git archive` of another commit) runs the same measurement on that tree, in a process of its
own, the trees alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(chunks: int) -> dict[str, float]:
    from fovea.core.request import CompletionOutput, RequestOutput
    from fovea.server import openai_serving as serving

    first = RequestOutput("r", "p", [1, 2, 3], None, [CompletionOutput(0, "Hello", [5], None, None)], False)

    async def outputs():
        for i in range(chunks):
            yield RequestOutput("r", None, [], None, [CompletionOutput(0, " word", [7], None, None)], i == chunks - 1)

    async def tagged():
        async for output in outputs():
            yield 0, output

    async def timed(stream) -> float:
        start, count = time.perf_counter(), 0
        async for _ in stream:
            count += 1
        return (time.perf_counter() - start) / count * 1e6

    shown = serving.Shown(usage=(True, False))
    chat = serving.chat_stream(first, outputs(), "model", "chatcmpl-1", 1, shown)
    completion = serving.completion_stream((0, first), tagged(), "model", "cmpl-1", 1, shown)
    return {"chat_us": asyncio.run(timed(chat)), "completion_us": asyncio.run(timed(completion))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--baseline", help="another tree (a git archive of a commit) measured side by side")
    parser.add_argument("--chunks", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.chunks)))
        return
    trees = {"current": ROOT} | ({"baseline": Path(args.baseline).resolve()} if args.baseline else {})
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
            one = [sys.executable, __file__, "--one", "--chunks", str(args.chunks)]
            done = subprocess.run(one, env=env, cwd=tree, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    medians = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result = {"commit": commit.stdout.strip(), "args": vars(args), "medians": medians, "runs": runs}
    print(json.dumps(medians, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
