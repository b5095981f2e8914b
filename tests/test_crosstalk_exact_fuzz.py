"""Cross-talk, exactly, at a stub model's speed: the engine's bookkeeping (scheduler, KV block tables and slots, forks'
block copies, the prefix cache, preemption, the runner's rows, async scheduling's tokens filled on the device, image
rows) under the cross-talk fuzz's draws (tests/test_crosstalk_fuzz.py: requests, arrivals, aborts, poison, engine
settings; the step order overlapped too; at times a max_model_len that prompts exceed and samples reach), with a model
whose every token reads the whole KV it is given.

The stub writes into each token's KV slot a number made of its id, its M-RoPE position and its LoRA adapter (an
image row: its picture and row); the next token of a sequence is a hash of everything in the slots its block table
lists up to its length. A block that holds another sequence's tokens, a copy gone to the wrong block, a cached
block shared where the prompts differ (another picture, another adapter), a position off by one or a token filled
from the wrong sample changes the tokens. The logits put everything on that token, so that sampled requests draw
it too: every request not aborted must end exactly as it did alone, tokens, finish reasons and logprobs. The
real model's arithmetic is the other fuzz's part; this one runs many more draws in the same time (each some
seconds). The seed is fixed for a run and printed with every failure (FOVEA_FUZZ_SEED repeats one); FOVEA_FUZZ_DRAWS
sets how many (2 by default)."""

from __future__ import annotations

import json
import os
import random
import zlib

import numpy as np
import pytest
import torch
from test_crosstalk_fuzz import (
    REQUESTS,
    alone_then_together,
    draw_params,
    draw_traffic,
    engine_options,
)

from fovea import LLM

SEED = int(os.environ.get("FOVEA_FUZZ_SEED") or random.SystemRandom().randrange(1 << 30))
DRAWS = int(os.environ.get("FOVEA_FUZZ_DRAWS", "2"))


def install_stub(llm: LLM) -> None:
    """The engine's language model and vision tower replaced by the stub (the module's docstring)."""
    engine = llm.engine
    runner, block_size = engine.runner, engine.config.block_size
    vocab = engine.config.model.text.vocab_size
    kv = np.zeros(runner.num_blocks * block_size, np.int64)  # one number per KV slot
    # under the chosen token, logits of distinct values (turned by the context): rows a grammar, allowed_token_ids
    # or a bias leave without it hold no ties, whose order top-k would be free to pick
    spread = torch.randn(vocab, generator=torch.Generator().manual_seed(0)).to(runner.device)

    def encode(items):  # an image's rows: its picture's hash and the row, in bytes (exact in bfloat16 too)
        rows = []
        for item in items:
            digest = zlib.crc32(item.content_hash.encode())
            rows.append(
                torch.tensor(
                    [[digest & 255, digest >> 8 & 255, row & 255, row >> 8] for row in range(item.span.length)]
                )
            )
        return [r.to(runner.device, torch.float32) for r in rows]

    def run_step(step, mm_embeds, previous_tokens=None):
        for src, dst in step.block_copies:
            kv[dst * block_size : (dst + 1) * block_size] = kv[src * block_size : (src + 1) * block_size]
        ids = step.token_ids.astype(np.int64)
        if step.fill_rows:  # async scheduling: tokens sampled by the step still on the device
            ids[step.fill_rows] = previous_tokens[step.fill_from].cpu().numpy()
        position = step.positions.astype(np.int64)
        values = ids * 1_000_003 + position[0] * 7 + position[1] * 11 + position[2] * 13
        if step.num_mm_rows:
            rows = mm_embeds[:, :4].to(torch.int64).cpu().numpy()
            values[step.mm_mask] = -(rows @ np.array([1 << 24, 1 << 16, 1 << 8, 1])) - 1
        if step.loras:
            adapter = np.array([lora.lora_int_id for lora in step.loras])[step.lora_of_seq]
            values += np.repeat(np.where(step.lora_of_seq >= 0, adapter, 0), np.diff(step.query_starts)) << 40
        kv[step.slots] = values
        if not step.logits_rows:  # a prompt's chunk that samples nothing
            return None, None
        owners = np.searchsorted(step.query_starts, step.logits_rows, side="right") - 1
        logits = torch.empty(len(step.logits_rows), vocab, device=runner.device)
        for row, seq in enumerate(owners):
            positions = np.arange(int(step.seq_lens[seq]))
            blocks = step.block_tables[seq][positions // block_size].astype(np.int64)
            context = zlib.crc32(kv[blocks * block_size + positions % block_size].tobytes())
            logits[row] = spread.roll(context % 1000)
            logits[row, context % vocab] = 100.0
        return logits, None

    runner.run_step = run_step
    engine.image_encoder._encode = encode


def check_draw(model: str, models, adapters, draw_index: int, monkeypatch) -> None:
    model_dir, max_model_len = models[model]
    seed = SEED + 1000 * draw_index + list(models).index(model)
    rng = random.Random(seed)
    if model == "qwen2.5-vl" and rng.random() < 0.3:  # short enough that prompts are refused and samples end there
        max_model_len = rng.choice([48, 96])
    options = engine_options(rng, max_model_len)
    # the step orders: in order, scheduled ahead, and outputs built while the next step runs (a GPU's without
    # async scheduling)
    options |= rng.choice([{}, {}, dict(async_scheduling=False, overlap_outputs=True)])
    if rng.random() < 0.35 and model == "qwen2.5-vl":  # (the adapters are written for its checkpoint)
        options |= dict(enable_lora=True, max_loras=rng.choice([1, 2]), max_lora_rank=12)
    if rng.random() < 0.3:
        options["scheduling_policy"] = "priority"
    poison = {f"r{i}" for i in rng.sample(range(REQUESTS), rng.choice([1, 2]))} if rng.random() < 0.3 else set()
    where = f"FOVEA_FUZZ_SEED={SEED} draw {draw_index} ({model}, seed {seed}): {json.dumps(options)}, poison {poison}"
    # (prompt log-probabilities are scored from hidden states, which the stub has none of)
    without_prompt_logprobs = lambda rng: draw_params(rng).clone(prompt_logprobs=None)  # noqa: E731
    requests, arrivals, aborts, streamed = draw_traffic(rng, rng, options, adapters, seed, without_prompt_logprobs)
    with LLM(str(model_dir), **options) as llm:
        install_stub(llm)
        alone, together = alone_then_together(llm, where, requests, arrivals, aborts, streamed, poison, monkeypatch)
    wrong = []
    for request_id, (kind, _), params, extra in requests:
        if request_id in aborts:
            continue
        a, b = (outcome(o) for o in (alone[request_id], together.get(request_id, "never ended")))
        if a != b:
            wrong.append(f"{request_id} ({kind}, {params}, {extra}): alone {a}; together {b}")
    assert not wrong, f"{where}: {len(wrong)} of {REQUESTS} differ; the first: {wrong[0]}"


def outcome(output) -> object:
    """What must be the same alone and together: each sample's tokens, finish reason and logprobs, or that it failed
    (or was refused). Top tokens of logprob -inf (a grammar or allowed_token_ids left fewer than asked for) tie, and
    which of them come is free."""
    if isinstance(output, str):
        return output.split(":")[0]
    finite = lambda entries: {t: e for t, e in entries.items() if e.logprob != float("-inf")}  # noqa: E731
    return [
        (c.index, list(c.token_ids), c.finish_reason, [finite(e) for e in c.logprobs or []]) for c in output.outputs
    ]


@pytest.mark.parametrize("model", ["qwen2.5-vl", "llava"])
def test_requests_run_together_end_exactly_as_they_do_alone(model, crosstalk_models, adapters, monkeypatch):
    for draw_index in range(DRAWS):
        check_draw(model, crosstalk_models, adapters, draw_index, monkeypatch)
