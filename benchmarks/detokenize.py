"""A whole output's text at its end (a non-streamed request, offline generate): one DecodeStream step per token,
as the detokenizer did, against one step over all of them (IncrementalDetokenizer.decode_all), on Qwen2's
tokenizer (the embedded demo model's). Medians of --repeats, milliseconds per output.

    python benchmarks/detokenize.py [--tokens 1000] [--repeats 50] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

from fovea.engine.outputs import IncrementalDetokenizer
from fovea.engine.tokenizer import load_engine_tokenizer
from fovea.testing.tiny import demo_model_dir

ROOT = Path(__file__).resolve().parents[1]
TEXT = "Sailors watched the grey horizon, gulls circled the masts; Grüße 🌊 日本語のテキスト, and so on. "


def timed(tokenizer, ids: list[int], whole: bool, repeats: int) -> tuple[float, str]:
    times, text = [], ""
    for _ in range(repeats):
        detokenizer = IncrementalDetokenizer(tokenizer, ids[:4])
        start = time.perf_counter()
        text = detokenizer.decode_all(ids) if whole else "".join(map(detokenizer.decode, ids))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()
    tokenizer = load_engine_tokenizer(demo_model_dir())
    ids = tokenizer.backend_tokenizer.encode(TEXT * (args.tokens // 10 + 1)).ids[: args.tokens]
    per_token, expected = timed(tokenizer, ids, False, args.repeats)
    whole, text = timed(tokenizer, ids, True, args.repeats)
    assert text == expected, "decode_all gave another text"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result = {"commit": commit.stdout.strip(), "tokens": len(ids), "per_token_ms": per_token, "whole_ms": whole}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
