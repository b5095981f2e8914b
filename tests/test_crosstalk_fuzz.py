"""Cross-talk: a request's tokens do not depend on what else the engine runs. Random requests (text, shared prefixes,
token ids, one or two of a few images; greedy or seeded sampling with penalties, logit bias, allowed and banned tokens,
min_tokens, stop rules, logprobs, prompt logprobs, n > 1, grammars, and now and then a grammar its own allowed tokens
contradict, which fails) each run alone, then all of them arriving at random steps into one engine, with aborts between,
under drawn engine settings (block size, a step budget that cuts prompts and images, sequences at a time, prefix
caching, the step order, a KV cache tight enough to preempt, what logprobs hold, how often streamed requests are
reported, LoRA with one or two adapters a batch on Qwen2.5-VL, priority scheduling, two tensor-parallel ranks); half
the requests stream there, their outputs joined as a server's reader joins them. With LoRA on, each request asks for
one of three adapters or none; with priorities, for one of four. Now and then one or two requests are poison: every
step that runs one fails (test_engine_failures.py's `fail_steps_running`), so the requests of that step run alone from
then on until each samples (Scheduler.isolate), and the poison fails alone. Now and then one or two of the images are
poison instead: the vision tower fails whenever it runs one (a device out of memory), the images encoded with it are
encoded again alone, and every request showing it fails, each told (failures the engine collects at once included).
Each request runs alone from empty prefix
and image caches (what a wrong cache hit gives is never the reference). Every request that was not aborted ends as it
did alone: the same tokens and finish reasons (logprobs within 1e-4 where they agree), or the same failure. The seed
is fixed for a run and printed with every failure (FOVEA_FUZZ_SEED repeats one); one draw per model runs by default,
FOVEA_FUZZ_DRAWS more.

One difference is allowed, and only for sampled requests: on the CPU the batch's shape changes the rounding of the
matmuls (a step of one to four rows takes another kernel), so logits differ in the last bits, and a draw from the
tiny models' nearly flat distributions over the vocabulary can land on the next token: the draw walks the
cumulative probabilities in vocabulary order. So where a sampled request first differs, the two tokens must be
neighbours in the vocabulary (within NEIGHBOURS ids); a request that read another's state would differ by far more.
A row with a top_k walks only its top_k tokens, whose neighbours can be thousands of ids apart (seed 916 moved to the
next of its 50 best, 844 ids away): there the token drawn together must be among the k best of the request run alone
(its logprobs, from a run that asks for them).

Found when it was written: with LLaVA's 576-token images and a tight encoder cache, requests failed with "the
request cannot be scheduled even with the engine idle" when run together (test_scheduler.py has the case)."""

from __future__ import annotations

import json
import os
import random

import pytest
from conftest import random_image
from test_engine_failures import fail_steps_running
from test_engine_vs_hf import assert_engine_idle

from fovea import LLM, SamplingParams
from fovea.core.sampling_params import RequestOutputKind
from fovea.engine.engine import StepFailed
from fovea.frontend.outputs import joined
from fovea.multimodal.prompt import ChatOptions

SEED = int(os.environ.get("FOVEA_FUZZ_SEED") or random.SystemRandom().randrange(1 << 30))
DRAWS = int(os.environ.get("FOVEA_FUZZ_DRAWS", "1"))
REQUESTS = 32
NEIGHBOURS = 64
WORDS = "the cat sat on a mat and then it ran far away from home into the deep dark wood".split()


def draw_params(rng: random.Random) -> SamplingParams:
    def maybe(chance: float) -> bool:
        return rng.random() < chance

    p = dict(max_tokens=rng.choice([1, 4, 12]), seed=rng.randrange(1 << 30))
    p["temperature"] = 0.0 if maybe(0.3) else rng.choice([0.5, 1.0, 1.5])
    drawn = {
        "top_p": [0.3, 0.9],
        "top_k": [1, 5, 50],
        "min_p": [0.05, 0.3],
        "presence_penalty": [-1.0, 1.5],
        "frequency_penalty": [-1.0, 1.0],
        "repetition_penalty": [0.8, 1.5],
        "stop": ["e", ["a", "t"]],
        "bad_words": [["the"], ["cat", "a mat"]],
        "logprobs": [0, 2, 5],
        "prompt_logprobs": [0, 2],
        "n": [2, 3],
        "ignore_eos": [True],
    }
    for name, values in drawn.items():
        if maybe(0.25):
            p[name] = rng.choice(values)
    if maybe(0.25):
        p["logit_bias"] = {rng.randrange(300): rng.choice([-100, 5, 100]) for _ in range(rng.randint(1, 4))}
    if maybe(0.2):
        p["stop_token_ids"] = rng.sample(range(300), 5)
    if maybe(0.2):
        p["min_tokens"] = rng.randint(1, p["max_tokens"])
    if maybe(0.05):  # a grammar its own allowed tokens contradict: it fails, alone and together
        p["allowed_token_ids"], p["structured_outputs"] = [0], {"regex": "[a-e]{2,6}"}
    elif maybe(0.15):
        p["allowed_token_ids"] = rng.sample(range(300), rng.randint(2, 30))
    elif maybe(0.15) and "bad_words" not in p and "min_tokens" not in p:
        p["structured_outputs"] = rng.choice([{"regex": "[a-e]{1,6}"}, {"choice": ["yes", "no", "maybe"]}])
    return SamplingParams(**p)


def draw_prompt(rng: random.Random, prefix: str, images: list) -> tuple[str, object]:
    kind = rng.choice(["text", "shared", "ids", "image", "two images"])
    if kind == "ids":
        return "ids", [rng.randrange(1, 300) for _ in range(rng.randint(1, 60))]
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
    if kind == "text":
        return "text", text
    if kind == "shared":
        return "text", prefix + " " + text
    shown = rng.sample(images, 1 if kind == "image" else 2)
    content = [{"type": "image_pil", "image_pil": image} for image in shown] + [{"type": "text", "text": text}]
    return "chat", [{"role": "user", "content": content}]


MAX_STEPS = 20_000  # (the longest draws take a few hundred steps)


def engine_options(rng: random.Random, max_model_len: int) -> dict:
    block_size = rng.choice([16, 32])
    options = dict(
        max_model_len=max_model_len,
        block_size=block_size,
        max_num_batched_tokens=rng.choice([64, 128, 512]),
        max_num_seqs=rng.choice([3, 8, 16]),
        enable_prefix_caching=rng.random() < 0.7,
    )
    if rng.random() < 0.5:  # the longest sequence and a few blocks: sequences preempt one another
        options["num_gpu_blocks_override"] = max_model_len // block_size + rng.choice([2, 8, 24])
    if rng.random() < 0.3:  # what logprobs hold: the processed ones are each row's own filters over its row
        options["logprobs_mode"] = rng.choice(["raw_logits", "processed_logprobs", "processed_logits"])
    if rng.random() < 0.3:  # streamed requests are reported every few tokens: across preemptions, forks, aborts
        options["stream_interval"] = rng.choice([2, 3, 5])
    orders = [dict(async_scheduling=False, overlap_outputs=False), dict(async_scheduling=True)]
    return options | rng.choice(orders)


def request_options(rng: random.Random, options: dict, adapters) -> dict:
    """What a request asks of the engine besides its prompt and parameters: an adapter, a priority."""
    drawn = {}
    if options.get("enable_lora"):
        drawn["lora"] = rng.choice([None, *adapters()])
    if options.get("scheduling_policy") == "priority":
        drawn["priority"] = rng.choice([-1, 0, 1, 2])
    return drawn


def run(
    llm: LLM, requests: list, arrivals: list[int], aborts: dict[str, int], streamed: frozenset = frozenset()
) -> dict[str, object]:
    """Adds each request (id, prompt, parameters, `request_options`) at its step, aborts some at theirs; each
    request's final output (the `streamed` ones' outputs joined as a server's reader joins them), or why it
    failed."""
    engine, ended, so_far = llm.engine, {}, {}
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    step = 0
    while order or engine.has_unfinished_requests():
        while order and arrivals[order[0]] <= step:
            request_id, (kind, prompt), params, extra = requests[order.pop(0)]
            output_kind = RequestOutputKind.DELTA if request_id in streamed else RequestOutputKind.FINAL_ONLY
            try:  # (a draw's settings can contradict each other, a prompt be too long: refused, alone and together)
                processed = (
                    llm.inputs.process_chat(prompt, None, ChatOptions())
                    if kind == "chat"
                    else llm.inputs.process(prompt)
                )
                input = llm.inputs.make_request(request_id, processed, params.clone(output_kind=output_kind), **extra)
                engine.add_request(input)
            except ValueError as error:
                ended[request_id] = f"refused: {error}"
        for request_id, at in aborts.items():
            if at == step:
                engine.abort_request(request_id)
        try:
            outputs = engine.step()
        except StepFailed as error:
            ended.update((request_id, f"failed: {error}") for request_id in error.request_ids)
            outputs = []
        for output in outputs:
            if output.request_id in streamed:
                earlier = so_far.get(output.request_id)
                output = so_far[output.request_id] = output if earlier is None else joined([earlier, output], True)
            if output.finished:
                ended[output.request_id] = output
        step += 1
        # a request left in no list never finishes: fail naming it rather than run until CI's time is up
        assert step < MAX_STEPS, f"still unfinished after {step} steps: {sorted(engine.requests)}"
    untold = sorted({request_id for request_id, _, _, _ in requests} - ended.keys() - aborts.keys())
    assert not untold, f"the engine went idle and never told these requests how they ended: {untold}"
    return ended


def draw_traffic(rng: random.Random, options_rng: random.Random, options: dict, adapters, image_seed=0, params=None):
    """REQUESTS requests (id, prompt, parameters, `request_options` drawn from `options_rng`), their arrival steps,
    the steps some are aborted at, and the ids of those that stream. `params(rng)`: a request's parameters
    (`draw_params`)."""
    prefix = " ".join(rng.choice(WORDS) for _ in range(40))
    images = [random_image(rng.choice([28, 56, 84]), rng.choice([28, 56]), seed=image_seed + i) for i in range(3)]
    requests = [(f"r{i}", draw_prompt(rng, prefix, images), (params or draw_params)(rng)) for i in range(REQUESTS)]
    arrivals = [rng.randrange(3 * REQUESTS) for _ in requests]
    # aborted a few steps after they arrive, while they run (drawn over the whole run, most came before or after)
    aborted = rng.sample(range(REQUESTS), REQUESTS // 8)
    aborts = {f"r{i}": arrivals[i] + rng.randrange(1, 12) for i in aborted}
    streamed = frozenset(request_id for request_id, _, _ in requests if rng.random() < 0.5)
    requests = [(*request, request_options(options_rng, options, adapters)) for request in requests]
    return requests, arrivals, aborts, streamed


def alone_then_together(
    llm: LLM, where: str, requests, arrivals, aborts, streamed, poison, monkeypatch, poison_images=()
) -> tuple:
    """Each request's outcome run alone (from empty prefix and image caches: what a wrong hit gives is never the
    reference), then all of them together (`run`), after which the engine holds nothing (no KV block, image or
    request left); the `poison` requests fail every step they are in, the `poison_images` every encoding."""
    if poison:
        fail_steps_running(llm.engine, poison, monkeypatch)
    if poison_images:
        fail_encodings_of(llm, poison_images, monkeypatch)
    alone, stage = {}, "alone"
    try:
        for request in requests:
            llm.reset_prefix_cache()
            llm.reset_mm_cache()
            alone |= run(llm, [request], [0], {})
        llm.reset_prefix_cache()
        llm.reset_mm_cache()
        stage = "together"
        together = run(llm, requests, arrivals, aborts, streamed)
        stage = "after the draw"
        assert_engine_idle(llm.engine)
    except AssertionError as error:
        raise AssertionError(f"{where}: {stage}: {error}") from None
    return alone, together


def shown_images(requests) -> list:
    """The images the requests show, each once, in the order they first appear."""
    shown = {}
    for _, (kind, prompt), _, _ in requests:
        for part in prompt[0]["content"] if kind == "chat" else ():
            if part["type"] == "image_pil":
                shown.setdefault(id(part["image_pil"]), part["image_pil"])
    return list(shown.values())


def fail_encodings_of(llm: LLM, images: list, monkeypatch) -> None:
    """The vision tower raises whenever it runs one of `images` (in the encoder's thread, or the engine's)."""
    encoder = llm.engine.image_encoder
    poison = set()
    for image in images:
        shown = [
            {"role": "user", "content": [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "a"}]}
        ]
        poison.add(llm.inputs.process_chat(shown, None, ChatOptions()).images[0].content_hash)
    real_encode = encoder._encode

    def encode(items):
        if poison.intersection(item.content_hash for item in items):
            raise RuntimeError("injected: the vision tower fails on this image")
        return real_encode(items)

    monkeypatch.setattr(encoder, "_encode", encode)


def differences(alone, together, params: SamplingParams, best_tokens) -> str | None:
    """Why `together` is not `alone`'s outcome (None: it is). `best_tokens(index, position)`: the top_k tokens of
    sample `index` at `position` run alone."""
    if isinstance(alone, str) or isinstance(together, str):
        same = isinstance(alone, str) and isinstance(together, str)
        return None if same else f"alone: {str(alone)[:300]}; together: {str(together)[:300]}"
    for a, b in zip(alone.outputs, together.outputs, strict=True):
        same = (list(a.token_ids), a.finish_reason) == (list(b.token_ids), b.finish_reason)
        first = None if same else first_difference(a.token_ids, b.token_ids)
        shared = len(a.token_ids) if first is None else first
        for i, (x, y) in enumerate(zip((a.logprobs or [])[:shared], (b.logprobs or [])[:shared])):
            gaps = [abs(x[t].logprob - y[t].logprob) for t in x.keys() & y.keys() if x[t].logprob != y[t].logprob]
            if max(gaps, default=0) > 1e-4:
                return f"sample {a.index}: logprobs at token {i} differ by {max(gaps)}"
        if first is not None and not (params.temperature > 0 and moved_to_a_neighbour(a, b, params, best_tokens)):
            return f"sample {a.index}: alone {a.token_ids} {a.finish_reason}, together {b.token_ids} {b.finish_reason}"
    return None


def first_difference(alone: list[int], together: list[int]) -> int:
    """The first position where the tokens differ (the shorter's length where one starts the other)."""
    return next((i for i, (s, t) in enumerate(zip(alone, together)) if s != t), min(len(alone), len(together)))


def moved_to_a_neighbour(alone, together, params: SamplingParams, best_tokens) -> bool:
    """Whether a sampled sequence's first difference is a draw moved to a neighbouring token (of its top_k)."""
    first = first_difference(alone.token_ids, together.token_ids)
    if first == min(len(alone.token_ids), len(together.token_ids)):
        return False
    token = together.token_ids[first]
    if params.top_k and params.top_k > 0:
        return token in best_tokens(alone.index, first)
    return abs(alone.token_ids[first] - token) <= NEIGHBOURS


def top_k_alone(llm: LLM, request, alone) -> object:
    """`best_tokens` for `request`: its top_k tokens where it ran alone, from the same run asking for logprobs
    (which change no draw); none if that run's tokens are not the alone run's."""
    request_id, prompt, params, extra = request

    def best_tokens(index: int, position: int) -> set[int]:
        asked = params.clone(logprobs=max(params.top_k, params.logprobs or 0))
        llm.reset_prefix_cache()  # (as the alone run)
        llm.reset_mm_cache()
        again = run(llm, [(request_id, prompt, asked, extra)], [0], {})[request_id]
        if isinstance(again, str) or [c.token_ids for c in again.outputs] != [c.token_ids for c in alone.outputs]:
            return set()
        return set(again.outputs[index].logprobs[position])

    return best_tokens


def check_draw(model: str, models, adapters, draw_index: int, monkeypatch) -> None:
    model_dir, max_model_len = models[model]
    seed = SEED + 1000 * draw_index + list(models).index(model)
    rng = random.Random(seed)
    options = engine_options(rng, max_model_len)
    # drawn apart, so that a seed's other draws stay what they were before these were
    extra_rng = random.Random(-seed)
    if model == "qwen2.5-vl" and extra_rng.random() < 0.35:  # (the adapters are written for its checkpoint)
        options |= dict(enable_lora=True, max_loras=extra_rng.choice([1, 2]), max_lora_rank=12)
    if extra_rng.random() < 0.3:
        options["scheduling_policy"] = "priority"
    # poison: every step that runs one of these fails (their requests then run alone, and the poison fails alone);
    # two at most, so that no other request is in MAX_FAILED_STEPS failed steps (each poison is in one with others)
    poison_rng = random.Random(f"poison {seed}")  # (drawn apart too)
    poison = {f"r{i}" for i in poison_rng.sample(range(REQUESTS), poison_rng.choice([1, 2]))}
    poison = poison if poison_rng.random() < 0.3 else set()
    # two tensor-parallel ranks at times (not with poison, which fails rank 0's steps alone: the ranks out of step)
    if not poison and random.Random(f"tensor parallel {seed}").random() < 0.2:
        options["tensor_parallel_size"] = 2
    requests, arrivals, aborts, streamed = draw_traffic(rng, extra_rng, options, adapters)
    # poison images, when no request is poison: one or two of the images shown (drawn apart, as the poison requests)
    image_rng = random.Random(f"poison images {seed}")
    images = shown_images(requests)
    drawn_images = image_rng.sample(images, min(len(images), image_rng.choice([1, 1, 2])))
    alone_rank = not poison and "tensor_parallel_size" not in options  # (the tower fails on rank 0 only)
    poison_images = drawn_images if alone_rank and image_rng.random() < 0.3 else []
    where = f"FOVEA_FUZZ_SEED={SEED} draw {draw_index} ({model}, seed {seed}): {json.dumps(options)}, poison {poison}"
    where += f", poison images {[images.index(image) for image in poison_images]}"
    with LLM(str(model_dir), **options, max_logprobs=64) as llm:  # (a top_k of 50's logprobs: best_tokens)
        alone, together = alone_then_together(
            llm, where, requests, arrivals, aborts, streamed, poison, monkeypatch, poison_images
        )
        enough = REQUESTS // 3 if poison_images else REQUESTS // 2  # (two poison images fail a third of them)
        assert sum(not isinstance(outcome, str) for outcome in alone.values()) >= enough, (where, alone)
        wrong = []
        for request in requests:
            request_id, (kind, _), params, extra = request
            if request_id not in aborts:
                outcome = alone[request_id]
                why = differences(
                    outcome, together.get(request_id, "never ended"), params, top_k_alone(llm, request, outcome)
                )
                wrong += [f"{request_id} ({kind}, {params}, {extra}): {why}"] if why else []
    assert not wrong, f"{where}: {len(wrong)} of {REQUESTS} differ; the first: {wrong[0]}"


@pytest.mark.parametrize("model", ["qwen2.5-vl", "llava"])
def test_requests_run_together_end_as_they_do_alone(model, crosstalk_models, adapters, monkeypatch):
    for draw_index in range(DRAWS):
        check_draw(model, crosstalk_models, adapters, draw_index, monkeypatch)
