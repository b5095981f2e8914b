"""Greedy parity at real shapes against transformers, fp32 and bf16: which side is further from the fp32 answer.

    python benchmarks/gpu_parity.py --model DIR --out DIR [--prompts 17,250,1000,2500] [--tokens 24] [--quick]

Four runs, each in its own process so the GPU is empty for the next: transformers fp32 (the reference: its greedy
tokens), transformers bf16, fovea bf16 and fovea fp32. Each run generates greedily from the same random-id prompts
and also scores the reference continuation teacher-forced (the log-probability of every reference token). Against
the reference, per run: prompts whose tokens all match, the first divergence, and the largest and mean absolute
log-probability difference over the reference tokens. fovea bf16 must be no further from fp32 than transformers
bf16 is. Writes parity.json and prints a table. --quick: 2 short prompts, 4 tokens (a CPU check of the script).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

RUNS = ["hf-float32", "hf-bfloat16", "fovea-bfloat16", "fovea-float32"]


def prompts(lengths: list[int], vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, min(vocab, 150000), (n,), generator=gen).tolist() for n in lengths]


def run_hf(model_dir: str, dtype: torch.dtype, ids: list[list[int]], tokens: int, reference) -> dict:
    from transformers import AutoModelForImageTextToText

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()
    out = {"tokens": [], "ref_logprobs": []}
    with torch.inference_mode():
        for i, prompt in enumerate(ids):
            x = torch.tensor([prompt], device=device)
            gen = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            out["tokens"].append(gen[0, len(prompt) :].tolist())
            follow = reference[i] if reference else out["tokens"][-1]
            full = torch.tensor([prompt + follow[:-1]], device=device)
            logits = model(input_ids=full, attention_mask=torch.ones_like(full)).logits[0, len(prompt) - 1 :]
            logprobs = logits.float().log_softmax(-1)
            out["ref_logprobs"].append(logprobs.gather(1, torch.tensor(follow, device=device)[:, None])[:, 0].tolist())
    return out


def run_fovea(model_dir: str, dtype: str, ids: list[list[int]], tokens: int, reference) -> dict:
    from fovea import LLM, SamplingParams

    longest = max(len(p) for p in ids) + tokens + 16
    with LLM(model_dir, dtype=dtype, max_model_len=longest, max_num_seqs=8, enable_prefix_caching=False) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], greedy, use_tqdm=False)
        result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "ref_logprobs": []}
        follow = reference or result["tokens"]
        scored = llm.generate(
            [{"prompt_token_ids": p + f} for p, f in zip(ids, follow)],
            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )
        for prompt, f, o in zip(ids, follow, scored):
            rows = o.prompt_logprobs[len(prompt) :]
            result["ref_logprobs"].append([row[token].logprob for row, token in zip(rows, f)])
    return result


def compare(run: dict, ref: dict) -> dict:
    matched, first_diverge, diffs = 0, [], []
    for got, want in zip(run["tokens"], ref["tokens"]):
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        matched += same == len(want)
        first_diverge.append(same)
    for got, want in zip(run["ref_logprobs"], ref["ref_logprobs"]):
        diffs += [abs(a - b) for a, b in zip(got, want)]
    return {
        "prompts_equal": matched,
        "prompts": len(ref["tokens"]),
        "first_divergence": first_diverge,
        "max_abs_logprob_diff": max(diffs),
        "mean_abs_logprob_diff": sum(diffs) / len(diffs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", default="17,250,1000,2500,600,80", help="prompt lengths in tokens")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--run", choices=RUNS, help="(internal) one run, in this process")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [17, 40] if args.quick else [int(n) for n in args.prompts.split(",")]
    tokens = 4 if args.quick else args.tokens
    vocab = json.loads((Path(args.model) / "config.json").read_text()).get("vocab_size") or 151936
    ids = prompts(lengths, vocab)
    if args.run:
        ref_file = out / "parity-hf-float32.json"
        reference = json.loads(ref_file.read_text())["tokens"] if args.run != RUNS[0] else None
        side, dtype = args.run.split("-")
        result = (
            run_hf(args.model, getattr(torch, dtype), ids, tokens, reference)
            if side == "hf"
            else run_fovea(args.model, dtype, ids, tokens, reference)
        )
        (out / f"parity-{args.run}.json").write_text(json.dumps(result))
        return
    for run in RUNS:
        if (out / f"parity-{run}.json").exists():  # taken earlier (a run per device call, where time is short)
            continue
        print("parity run:", run, flush=True)
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--model",
                args.model,
                "--out",
                str(out),
                "--run",
                run,
                "--prompts",
                ",".join(map(str, lengths)),
                "--tokens",
                str(tokens),
            ],
            check=True,
        )
    ref = json.loads((out / "parity-hf-float32.json").read_text())
    summary = {"prompt_lengths": lengths, "tokens": tokens}
    for run in RUNS[1:]:
        summary[run] = compare(json.loads((out / f"parity-{run}.json").read_text()), ref)
    ours, theirs = summary["fovea-bfloat16"], summary["hf-bfloat16"]
    summary["bf16_no_further_than_hf"] = ours["mean_abs_logprob_diff"] <= theirs["mean_abs_logprob_diff"] * 1.1
    (out / "parity.json").write_text(json.dumps(summary, indent=2))
    print(f"\nparity against transformers fp32, {len(lengths)} prompts of {lengths} tokens, {tokens} greedy tokens")
    print("| run | prompts equal | first divergence | max |dlogprob| | mean |dlogprob| |")
    print("|---|---|---|---|---|")
    for run in RUNS[1:]:
        r = summary[run]
        print(
            f"| {run} | {r['prompts_equal']}/{r['prompts']} | {r['first_divergence']} | "
            f"{r['max_abs_logprob_diff']:.2e} | {r['mean_abs_logprob_diff']:.2e} |"
        )
    print("fovea bf16 no further from fp32 than transformers bf16:", summary["bf16_no_further_than_hf"])


if __name__ == "__main__":
    main()
