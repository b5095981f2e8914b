"""The engine's grammar compiler fed ever-new JSON schemas (the soak's json_schema kind): its RSS after each 100,
glibc trimmed, and how many compiled grammars it keeps. What one kept grammar costs, and that the keeping is bounded.

    python benchmarks/grammar_cache_rss.py [--schemas 1200]   # the embedded demo model's tokenizer
"""

from __future__ import annotations

import argparse
import ctypes
import random

import psutil

from fovea.config.model import ModelConfig
from fovea.core.sampling_params import StructuredOutputsParams
from fovea.engine.structured_outputs import GrammarCompiler
from fovea.engine.tokenizer import load_engine_tokenizer
from fovea.testing.tiny import demo_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=1200)
    args = parser.parse_args()
    model_dir = demo_model_dir()
    model = ModelConfig.from_dir(model_dir)
    compiler = GrammarCompiler(load_engine_tokenizer(model_dir), model.text.vocab_size, list(model.eos_token_ids))
    libc, process, rng = ctypes.CDLL("libc.so.6"), psutil.Process(), random.Random(0)
    libc.malloc_trim(0)
    start = process.memory_info().rss
    for i in range(args.schemas):
        fields = {f"field_{i}_{j}": {"type": "integer"} for j in range(rng.randint(1, 4))}
        compiler.matcher(StructuredOutputsParams(json={"type": "object", "properties": fields}))
        if (i + 1) % 100 == 0:
            libc.malloc_trim(0)
            grown = (process.memory_info().rss - start) / 2**20
            print(f"{i + 1} schemas: {len(compiler._compiled)} kept, RSS {grown:+.0f} MB", flush=True)


if __name__ == "__main__":
    main()
