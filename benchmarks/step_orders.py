"""The engine's step orders side by side under preemption: where their tokens part, and how far their log-probs are.

    python benchmarks/step_orders.py [--out FILE]

A tiny random Qwen2.5-VL, fp32, a KV cache too small for five sequences at once (tests/test_overlap.py's
preemption case), each order (in order, overlapped, ahead, in order again) with decode CUDA graphs and eager, and
seeded (temperature 0.8, whole vocabulary) and greedy draws: per prompt, the first position where an order's tokens
differ from in order, with both tokens around it and the log-probs of the token before. On a GPU an order that
schedules other batches (ahead preempts differently) replays other graph sizes, whose rounding differs in the last
digits; over a random model's near-flat vocabulary that moves a seeded draw to a neighbouring token. A lost draw
shows instead as sequences that part with unrelated tokens and equal log-probs before.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from fovea import LLM, SamplingParams
from fovea.testing.tiny import write_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_engine_vs_hf import LOREM  # noqa: E402

OPTIONS = dict(dtype="float32", max_model_len=384, num_gpu_blocks_override=24, max_num_batched_tokens=128)
PROMPTS = [LOREM * 2, "The cat sat on the", LOREM * 2 + " And so", "Numbers: 1 2 3 4", "Colours of the sea"]
ORDERS = {
    "in order": dict(overlap_outputs=False, async_scheduling=False),
    "overlapped": dict(overlap_outputs=True, async_scheduling=False),
    "ahead": dict(async_scheduling=True),
    "in order again": dict(overlap_outputs=False, async_scheduling=False),
}


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def compare(model: str, sampling: str, eager: bool) -> list[str]:
    temperature = 0.8 if sampling == "seeded" else 0.0
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=80, ignore_eos=True, logprobs=1) for i in range(5)
    ]
    outputs, lines = {}, []
    for order, options in ORDERS.items():
        llm = LLM(model, enforce_eager=eager, **options, **OPTIONS)
        outputs[order] = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        lines.append(
            f"{sampling} {'eager' if eager else 'graphs'} {order}: {llm.engine.scheduler.num_preemptions} preemptions"
        )
        del llm
    for order in list(ORDERS)[1:]:
        parts = [first_difference(a.token_ids, b.token_ids) for a, b in zip(outputs[order], outputs["in order"])]
        lines.append(f"  {order} against in order: first differing position per prompt {parts}")
        for prompt, (a, b, i) in enumerate(zip(outputs[order], outputs["in order"], parts)):
            if i:
                before = [out.logprobs[i - 1][out.token_ids[i - 1]].logprob for out in (a, b)]
                lines.append(
                    f"    prompt {prompt} at {i}: {a.token_ids[i - 2 : i + 3]} against {b.token_ids[i - 2 : i + 3]}; "
                    f"log-prob of the token before {before[0]:.7f} against {before[1]:.7f}"
                )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the lines here")
    args = parser.parse_args()
    model = str(write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny-3b", "tiny-3b", seed=1))
    lines = []
    for sampling in ("seeded", "greedy"):
        for eager in (False, True):
            for line in compare(model, sampling, eager):
                print(line, flush=True)
                lines.append(line)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
