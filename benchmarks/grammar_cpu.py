"""The two grammar engines vLLM uses, on the CPU at batch 256, for choosing one (issue 19): per step, the masks
of 256 samples under a 3-field JSON schema (fill, then consume the next token of a valid answer) and applying the
masks to 256 x 151,936 logits. One torch thread, Qwen2's tokenizer (the embedded demo model's).

    pip install xgrammar llguidance && python benchmarks/grammar_cpu.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VOCAB, BATCH = 151936, 256
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
    },
}
ANSWER = json.dumps({"name": "Alice", "age": 30, "tags": ["a", "bb"]})  # both engines' default: any whitespace


def per_step_ms(fill, consume, apply, answer_ids: list[int]) -> dict:
    logits = torch.randn(BATCH, VOCAB)
    fills, applies = [], []
    apply(logits.clone())  # warm-up: first calls load kernels
    for token in answer_ids:
        start = time.perf_counter()
        fill()
        middle = time.perf_counter()
        apply(logits)
        end = time.perf_counter()
        consume(token)
        fills.append(middle - start + time.perf_counter() - end)
        applies.append(end - middle)
    return {
        "fill_and_consume_ms": statistics.mean(fills) * 1e3,
        "apply_ms": statistics.mean(applies) * 1e3,
        "fill_and_consume_median_ms": statistics.median(fills) * 1e3,
    }


def llguidance_case(tokenizer, answer_ids):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(BATCH)]
    mask = lt.allocate_token_bitmask(BATCH, VOCAB)

    def fill():
        for slot, matcher in enumerate(matchers):
            lt.fill_next_token_bitmask(matcher, mask, slot)

    def consume(token):
        assert all(matcher.consume_token(token) for matcher in matchers)

    return per_step_ms(fill, consume, lambda logits: lt.apply_token_bitmask_inplace(logits, mask), answer_ids)


def xgrammar_case(tokenizer, answer_ids):
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)).compile_json_schema(
        json.dumps(SCHEMA)
    )
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    mask = xgr.allocate_token_bitmask(BATCH, VOCAB)

    def fill():
        for slot, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(mask, slot)

    def consume(token):
        assert all(matcher.accept_token(token) for matcher in matchers)

    return per_step_ms(fill, consume, lambda logits: xgr.apply_token_bitmask_inplace(logits, mask), answer_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from fovea.testing.tiny import demo_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_dir()))
    answer_ids = tokenizer.encode(ANSWER)
    results = {"llguidance": llguidance_case(tokenizer, answer_ids), "xgrammar": xgrammar_case(tokenizer, answer_ids)}
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    record = {
        "benchmark": "grammar_cpu",
        "batch": BATCH,
        "vocab": VOCAB,
        "commit": commit,
        "torch_threads": 1,
        "answer_tokens": len(answer_ids),
        "cpu": platform.processor() or platform.machine(),
        "results": results,
    }
    out = Path(args.out) / f"grammar_cpu_{commit}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(
        "| engine | masks: fill + consume, mean (median) ms/step | apply to logits, mean ms/step |\n| --- | --- | --- |"
    )
    for name, r in results.items():
        print(
            f"| {name} | {r['fill_and_consume_ms']:.1f} ({r['fill_and_consume_median_ms']:.1f}) | {r['apply_ms']:.1f} |"
        )
    print(f"raw: {out}")


if __name__ == "__main__":
    main()
