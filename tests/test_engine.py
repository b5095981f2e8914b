"""Engine behaviour through the offline API: batch independence, caches, n > 1, logprobs, stops, aborts, errors."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import hf_tokenizer, our_model, random_image
from test_engine_vs_hf import LOREM, SYSTEM, assert_engine_idle
from test_model_vs_hf import our_logits

from fovea import LLM, SamplingParams
from fovea.core.sampling_params import RequestOutputKind

PROMPTS = ["The cat sat on the", LOREM, "Numbers: 1 2 3 4", LOREM * 4 + "And so", "Hi", "Colours of the sea"]


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    return LLM(
        str(tiny_dirs["tiny-3b"]),
        dtype="float32",
        max_num_batched_tokens=256,
        max_model_len=2048,
        num_gpu_blocks_override=400,
    )


def image_chat(image, text="What is here?", system=None):
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [
        {"role": "user", "content": [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": text}]}
    ]


def tokens(outputs):
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=10),
        SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=5, max_tokens=10),
    ],
)
def test_batch_equals_solo(llm, params):
    batch = llm.generate(PROMPTS, params, use_tqdm=False)
    solo = [llm.generate(p, params, use_tqdm=False)[0] for p in PROMPTS]
    assert tokens(batch) == tokens(solo)
    assert_engine_idle(llm.engine)


def test_shared_system_prompt_hits_the_prefix_cache(llm, tiny_dirs):
    conversations = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        for q in ("Describe it.", "Count them.", "Name a colour.")
    ]
    params = SamplingParams(temperature=0, max_tokens=8)
    first = llm.chat(conversations[0], params, use_tqdm=False)
    rest = llm.chat(conversations[1:], params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in rest)
    assert llm.reset_prefix_cache()  # vLLM's: nothing found cached after it, the same tokens
    again = llm.chat(conversations[1], params, use_tqdm=False)
    assert again[0].num_cached_tokens == 0 and tokens(again) == tokens(rest[:1])
    uncached = LLM(
        str(tiny_dirs["tiny-3b"]),
        dtype="float32",
        enable_prefix_caching=False,
        max_model_len=2048,
        num_gpu_blocks_override=200,
    )
    reference = uncached.chat(conversations, params, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in reference)
    assert tokens(first + rest) == tokens(reference)


@pytest.mark.parametrize("budget", [8192, 2048])
def test_requests_arriving_together_share_an_image_and_a_prefix(tiny_dirs, budget):
    """32 chats with one 448x448 image and different questions in one call: one sequence fills the image's
    blocks, the others (deferred a step when they would fill the same blocks in the same step) take them from
    the cache; the same for a shared text prefix. Tokens equal an engine without prefix caching."""
    image = random_image(448, 448, seed=31)
    chats = [image_chat(image, f"Question number {i}: what is it?") for i in range(32)]
    texts = [LOREM * 3 + f" Item {i}:" for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=4)
    llm = LLM(
        str(tiny_dirs["tiny-3b"]),
        dtype="float32",
        max_model_len=2048,
        max_num_batched_tokens=budget,
        num_gpu_blocks_override=1200,
    )
    together = llm.chat(chats, params, use_tqdm=False)
    scheduler = llm.engine.scheduler
    assert scheduler.prefix_cache_queries == sum(len(o.prompt_token_ids) for o in together)
    full_blocks = (min(len(o.prompt_token_ids) for o in together) - 1) // 16 * 16  # the last token's is computed
    assert scheduler.prefix_cache_hits >= 31 * (full_blocks - 32)  # all but a few tokens before the image
    assert all(o.num_cached_tokens >= full_blocks - 32 for o in together[1:])
    hits = scheduler.prefix_cache_hits
    text_outputs = llm.generate(texts, params, use_tqdm=False)
    shared = min(len(o.prompt_token_ids) for o in text_outputs) - 8  # the lorem part, in whole blocks
    assert scheduler.prefix_cache_hits - hits >= 11 * (shared // 16 * 16 - 16)
    assert_engine_idle(llm.engine)
    plain = LLM(
        str(tiny_dirs["tiny-3b"]),
        dtype="float32",
        max_model_len=2048,
        enable_prefix_caching=False,
        num_gpu_blocks_override=1200,
    )
    assert tokens(together) == tokens(plain.chat(chats, params, use_tqdm=False))
    assert tokens(text_outputs) == tokens(plain.generate(texts, params, use_tqdm=False))


def test_images_key_the_prefix_and_encoder_caches(llm):
    params = SamplingParams(temperature=0, max_tokens=6)
    a, b = random_image(320, 240, 21), random_image(320, 240, 22)
    encoded, hits = llm.engine.encoder_cache.encoded, llm.engine.encoder_cache.hits
    first = llm.chat(image_chat(a, system=SYSTEM), params, use_tqdm=False)[0]
    other = llm.chat(image_chat(b, system=SYSTEM), params, use_tqdm=False)[0]
    image_start = other.prompt_token_ids.index(151655)
    assert 0 < other.num_cached_tokens <= image_start  # the system prompt is shared, the image is not
    again = llm.chat(image_chat(a, "Something else?"), params, use_tqdm=False)[0]
    assert llm.engine.encoder_cache.encoded - encoded == 2  # a and b, never a twice
    assert llm.engine.encoder_cache.hits - hits == 1
    assert first.outputs[0].token_ids != other.outputs[0].token_ids
    assert again.outputs[0].finish_reason == "length"
    assert_engine_idle(llm.engine)


def assert_same_draws(sample, single):
    """A seeded sample drew what the single request with its seed drew: the same tokens, with the same logprobs.
    The two ran in batches of 3 and of 1, whose matrix products round differently, and the random model's almost
    uniform logits now and then put a draw within rounding of the boundary between two token ids (2-4 of 60
    samples of 8 tokens, at steps 2-7): such a draw takes the neighbouring id, and the two texts part there."""
    for step, (token, single_token) in enumerate(zip(sample.token_ids, single.token_ids)):
        ours, theirs = sample.logprobs[step], single.logprobs[step]
        common = ours.keys() & theirs.keys()
        assert len(common) >= 2  # the top 2, drawn or not
        assert [ours[t].logprob for t in common] == pytest.approx([theirs[t].logprob for t in common], abs=1e-4)
        if token != single_token:
            assert abs(token - single_token) == 1, (step, token, single_token)
            return
    assert sample.cumulative_logprob == pytest.approx(single.cumulative_logprob)


def test_n_samples_share_the_prompt_and_match_seeded_singles(llm):
    prompt = LOREM * 2 + "Next"  # not a multiple of the block size: the fork copies a partial block
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, logprobs=2)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    singles = [llm.generate(prompt, params.clone(n=1, seed=11 + i), use_tqdm=False)[0].outputs[0] for i in range(3)]
    for sample, single in zip(out.outputs, singles):
        assert_same_draws(sample, single)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert_engine_idle(llm.engine)


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63)])
def test_every_64_bit_seed_is_taken_with_any_n(llm, seed):
    """OpenAI's and vLLM's seeds are any 64-bit integer; sample i draws from seed + i (torch's generators take
    up to 2**64 - 1). The largest seed was refused with n = 1 before (the check left room for an n-th sample)."""
    params = SamplingParams(n=3, temperature=1.0, seed=seed, max_tokens=6)
    first, again = (llm.generate("Next", params, use_tqdm=False)[0].outputs for _ in range(2))
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in first}) > 1
    assert llm.generate("Next", params.clone(n=1), use_tqdm=False)[0].outputs[0].token_ids == first[0].token_ids


def test_a_cache_salt_keeps_a_requests_blocks_from_requests_without_it(llm):
    """vLLM's cache_salt (SamplingParams here, a prompt dict's key as in vLLM): prefix-cache hits only among
    requests with the same salt; the tokens are the same either way."""
    prompt = LOREM * 3
    greedy = SamplingParams(temperature=0, max_tokens=4)

    def run(salt=None, as_key=False):
        given = {"prompt": prompt, "cache_salt": salt} if as_key else prompt
        params = greedy if salt is None or as_key else greedy.clone(cache_salt=salt)
        return llm.generate(given, params, use_tqdm=False)[0]

    plain = run()
    assert run().num_cached_tokens >= 48
    first = run("a")
    assert first.num_cached_tokens == 0 and first.outputs[0].token_ids == plain.outputs[0].token_ids
    assert run("b", as_key=True).num_cached_tokens == 0
    assert run("a", as_key=True).num_cached_tokens >= 48
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        greedy.clone(cache_salt="")


def test_logprobs_are_log_softmax_of_the_model_logits(llm, tiny_dirs):
    model, processor = our_model(tiny_dirs["tiny-3b"])
    messages = image_chat(random_image(200, 150, 23))
    out = llm.chat(
        messages, SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2), use_tqdm=False
    )[0]
    generated = out.outputs[0].token_ids
    prompt = processor.process_chat(messages)
    assert out.prompt_token_ids == prompt.token_ids
    reference = our_logits(model, prompt, generated[:-1]).log_softmax(-1)
    num_prompt = len(prompt.token_ids)
    for step, (token, entry) in enumerate(zip(generated, out.outputs[0].logprobs)):
        row = reference[num_prompt - 1 + step]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == 1  # greedy
        best = row.topk(3)
        assert sorted(entry) == sorted(set(best.indices.tolist()) | {token})
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(generated, out.outputs[0].logprobs))
    )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == num_prompt
    for index in (1, 7, num_prompt - 1):
        target = prompt.token_ids[index]
        assert out.prompt_logprobs[index][target].logprob == pytest.approx(
            reference[index - 1, target].item(), abs=1e-4
        )


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logits"])
def test_logprobs_mode_reports_the_drawn_distribution_or_the_logits(tiny_dirs, mode):
    """--logprobs-mode: processed_logprobs are those of the distribution a token was drawn from (here the four
    best logits over the temperature), raw_logits the model's logits; prompt logprobs stay log-probabilities. Beam
    search, which ranks by log-probabilities, is refused."""
    model, processor = our_model(tiny_dirs["tiny-3b"])
    engine = LLM(str(tiny_dirs["tiny-3b"]), dtype="float32", max_model_len=1024, logprobs_mode=mode)
    messages = image_chat(random_image(120, 90, 5))
    params = SamplingParams(temperature=0.8, top_k=4, seed=9, max_tokens=6, logprobs=4, prompt_logprobs=1)
    out = engine.chat(messages, params, use_tqdm=False)[0]
    generated = out.outputs[0].token_ids
    prompt = processor.process_chat(messages)
    logits = our_logits(model, prompt, generated[:-1])
    num_prompt = len(prompt.token_ids)
    for step, (token, entry) in enumerate(zip(generated, out.outputs[0].logprobs)):
        row = logits[num_prompt - 1 + step]
        if mode == "raw_logits":
            expected = row
        else:
            kept = (row / 0.8).topk(4)
            expected = torch.full_like(row, float("-inf")).scatter(0, kept.indices, kept.values.log_softmax(-1))
        assert sorted(entry) == sorted(set(expected.topk(4).indices.tolist()) | {token})
        for t, value in entry.items():
            assert value.logprob == pytest.approx(expected[t].item(), abs=1e-4), (step, t)
        if mode == "processed_logprobs":  # the four kept tokens hold all of the mass
            assert sum(math.exp(v.logprob) for v in entry.values()) == pytest.approx(1.0, abs=1e-4)
    target = prompt.token_ids[5]
    assert out.prompt_logprobs[5][target].logprob == pytest.approx(logits[4].log_softmax(-1)[target].item(), abs=1e-4)
    with pytest.raises(ValueError, match=f"beam search ranks beams by the model's log-probabilities.*{mode}"):
        engine.generate(["Hi"], SamplingParams(n=2, use_beam_search=True), use_tqdm=False)


def test_prompt_logprobs_scored_in_blocks_match_the_model(llm, tiny_dirs, monkeypatch):
    """Prompt log-probabilities are scored a few rows at a time (PROMPT_LOGPROB_BLOCK); blocks of 5 rows, with
    spans that do not divide evenly, must give every position's log-probability, rank and top tokens."""
    import fovea.runner.model_runner as model_runner

    vocab = llm.engine.config.model.text.vocab_size
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_BLOCK", 5 * vocab)
    scored, compute_logits = [], llm.engine.runner.model.compute_logits
    monkeypatch.setattr(
        llm.engine.runner.model,
        "compute_logits",
        lambda rows, out=None: scored.append(len(rows)) or compute_logits(rows, out),
    )
    model, processor = our_model(tiny_dirs["tiny-3b"])
    messages = [{"role": "user", "content": LOREM}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    prompt = processor.process_chat(messages)
    reference = our_logits(model, prompt, []).log_softmax(-1)
    assert len(out.prompt_logprobs) == len(prompt.token_ids) > 23
    for index in range(1, len(prompt.token_ids)):
        row, target = reference[index - 1], prompt.token_ids[index]
        entry = out.prompt_logprobs[index]
        assert entry[target].logprob == pytest.approx(row[target].item(), abs=1e-4)
        value = row[target].item()  # near-ties of a random model: the rank within the tolerance's bounds
        assert 1 + int((row > value + 1e-4).sum()) <= entry[target].rank <= 1 + int((row > value - 1e-4).sum())
        assert {t for t, lp in entry.items() if lp.rank <= 3} >= set(row.topk(3).indices.tolist()) - {target}
    assert max(scored) <= 5  # never the whole prompt's logits at once


def test_stop_strings_cut_the_text_exactly(llm):
    base = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate(PROMPTS[1], base, use_tqdm=False)[0].outputs[0]
    text = full.text
    assert len(text) > 12
    stop = text[5:9]  # spans token boundaries in general
    index = text.find(stop)
    cut = llm.generate(PROMPTS[1], base.clone(stop=[stop, "\x00never"]), use_tqdm=False)[0].outputs[0]
    assert cut.text == text[:index] and cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate(PROMPTS[1], base.clone(stop=stop, include_stop_str_in_output=True), use_tqdm=False)[0].outputs[
        0
    ]
    assert kept.text == text[: index + len(stop)]
    by_token = llm.generate(PROMPTS[1], base.clone(stop_token_ids=[full.token_ids[3]]), use_tqdm=False)[0].outputs[0]
    assert by_token.token_ids == full.token_ids[: full.token_ids.index(full.token_ids[3]) + 1]
    assert by_token.stop_reason == full.token_ids[3] and by_token.finish_reason == "stop"
    assert llm.generate(PROMPTS[1], base.clone(max_tokens=3), use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_min_tokens_holds_back_eos(llm):
    eos = 151645
    biased = SamplingParams(temperature=0, max_tokens=6, logit_bias={eos: 100.0})
    assert llm.generate("Hi", biased, use_tqdm=False)[0].outputs[0].token_ids == [eos]
    held = llm.generate("Hi", biased.clone(min_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) == 4 and held.token_ids[-1] == eos and eos not in held.token_ids[:3]


def test_abort_frees_blocks_at_once_and_streams_deltas(llm):
    engine = llm.engine
    inputs = llm.inputs
    delta = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(inputs.make_request(f"r{i}", inputs.process(prompt), delta))
    pieces: dict[str, list[int]] = {}
    for _ in range(4):
        for out in engine.step():
            pieces.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    engine.abort_request(["r0", "r3"])
    assert all(s.finish_reason == "abort" for s in engine.scheduler.running if s.request.request_id in ("r0", "r3"))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                finished[out.request_id] = out.outputs[0].finish_reason
    assert finished["r0"] == finished["r3"] == "abort"
    assert all(finished[f"r{i}"] == "length" and len(pieces[f"r{i}"]) == 30 for i in (1, 2, 4, 5))
    assert_engine_idle(engine)
    solo = llm.generate(PROMPTS[1], delta.clone(output_kind=RequestOutputKind.CUMULATIVE), use_tqdm=False)[0]
    assert pieces["r1"] == solo.outputs[0].token_ids  # deltas add up to the whole


def test_bad_requests_fail_at_admission_with_a_clear_message(llm, tiny_dirs):
    inputs = llm.inputs
    greedy = SamplingParams(temperature=0)
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        llm.generate([0] * 3000, greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate([1, 2, 10**7], greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="image placeholders"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": random_image(64, 64)}}, use_tqdm=False)
    with pytest.raises(TypeError, match="unexpected engine arguments"):
        LLM(str(tiny_dirs["tiny-3b"]), no_such_option=1)
    small = LLM(
        str(tiny_dirs["tiny-3b"]),
        dtype="float32",
        encoder_cache_size=50,
        limit_mm_per_prompt={"image": 1},
        max_model_len=1024,
        num_gpu_blocks_override=100,
    )
    with pytest.raises(ValueError, match="does not fit the encoder cache"):
        small.chat(image_chat(random_image(448, 448)), use_tqdm=False)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        small.chat(
            [{"role": "user", "content": [{"type": "image_pil", "image_pil": random_image(64, 64)}] * 2}],
            use_tqdm=False,
        )
    assert inputs.process("fine") and llm.generate("still serving", greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert_engine_idle(llm.engine)


def test_prompts_prepared_in_threads_keep_their_order_and_the_first_error(llm):
    """LLM prepares a batch's prompts (images decoded and resized) in several threads: the requests keep the
    order of the prompts, and the first bad prompt in that order is the one the error names."""
    greedy = SamplingParams(temperature=0, max_tokens=4)
    chats = [image_chat(random_image(96 + 32 * i, 64, 50 + i), f"Picture {i}?") for i in range(5)]
    threads = llm.prepare_threads
    try:
        llm.prepare_threads = 1
        one = llm.chat(chats, greedy, use_tqdm=False)
        llm.prepare_threads = 3
        many = llm.chat(chats, greedy, use_tqdm=False)
        assert [o.prompt for o in many] == [o.prompt for o in one] and tokens(many) == tokens(one)
        assert len({o.prompt for o in many}) == 5
        no_placeholder = {"prompt": "no placeholder", "multi_modal_data": {"image": random_image(64, 64)}}
        bad = PROMPTS[:2] + [{"prompt": "x", "bogus": 1}] + PROMPTS[2:4] + [no_placeholder]
        with pytest.raises(ValueError, match="unknown prompt fields"):
            llm.generate(bad, greedy, use_tqdm=False)
    finally:
        llm.prepare_threads = threads
    assert_engine_idle(llm.engine)


def test_generate_accepts_vllm_prompt_forms(llm):
    image = random_image(128, 96, 30)
    text = "<|vision_start|><|image_pad|><|vision_end|>Describe."
    params = SamplingParams(temperature=0, max_tokens=4)
    as_dict = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, params, use_tqdm=False)[0]
    as_list = llm.generate(
        [{"prompt": text, "multi_modal_data": {"image": [image]}, "mm_processor_kwargs": {"max_pixels": 128 * 96}}],
        params,
        use_tqdm=False,
    )[0]
    ids = llm.get_tokenizer().encode("Describe the sea.")
    as_ids = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert as_dict.outputs[0].token_ids == as_list.outputs[0].token_ids
    assert as_ids.prompt_token_ids == ids and as_dict.prompt == text and as_ids.prompt is None
    chat = llm.chat([{"role": "user", "content": "Hello"}], params, use_tqdm=False)[0]
    assert (
        chat.prompt == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert llm.get_default_sampling_params().repetition_penalty == 1.05  # from generation_config.json


def test_output_timings_are_ordered(llm):
    out = llm.generate("Timing", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time


def test_logprobs_zero_gives_only_the_chosen_token_and_others_none(llm):
    with_lp, without = llm.generate(
        ["a b", "c d"],
        [SamplingParams(temperature=0, max_tokens=3, logprobs=0), SamplingParams(temperature=0, max_tokens=3)],
        use_tqdm=False,
    )
    entries = with_lp.outputs[0].logprobs
    assert [list(e) for e in entries] == [[t] for t in with_lp.outputs[0].token_ids]
    assert without.outputs[0].logprobs is None and without.outputs[0].cumulative_logprob is None


def test_kv_cache_too_small_for_max_model_len_fails_at_start_with_advice(tiny_dirs, fovea_log):
    with pytest.raises(
        ValueError,
        match=r"max_model_len 1024 needs .* only 160 tokens .* Lower max_model_len "
        r"\(to at most 160\), max_num_batched_tokens, max_pixels",
    ):
        LLM(str(tiny_dirs["tiny-3b"]), dtype="float32", max_model_len=1024, num_gpu_blocks_override=10)
    fits = LLM(str(tiny_dirs["tiny-3b"]), dtype="float32", num_gpu_blocks_override=10)  # the model's length
    assert fits.engine.config.max_model_len == 160
    assert "KV cache: 160 tokens of float32, max concurrency 1.00x for max_model_len 160" in fovea_log.text
    assert "lowered from the model's 128000" in fovea_log.text


@pytest.mark.parametrize("flags", [{}, {"fp32_softmax": True}, {"fp32_softmax_vision": True}])
def test_fp32_softmax_flags_reach_the_attention(tiny_dirs, monkeypatch, flags):
    """A bf16 model: --fp32-softmax runs the language model's attention in fp32, --fp32-softmax-vision the vision
    tower's; the other stays in bf16. The answer still comes back. On the reference (SDPA) backends, the CPU's: the
    GPU's Triton kernels keep scores in fp32 whatever the flags."""
    from types import SimpleNamespace

    import torch
    import torch.nn.functional as F

    import fovea.attention.backend as paged_attention
    import fovea.attention.layer as vision_attention

    seen = {"lm": set(), "vision": set()}

    def recorder(name):
        def sdpa(q, *args, **kwargs):
            seen[name].add(q.dtype)
            return F.scaled_dot_product_attention(q, *args, **kwargs)

        return SimpleNamespace(scaled_dot_product_attention=sdpa)

    monkeypatch.setattr(paged_attention, "F", recorder("lm"))
    monkeypatch.setattr(vision_attention, "F", recorder("vision"))
    llm = LLM(str(tiny_dirs["tiny-3b"]), dtype="bfloat16", max_model_len=256, device="cpu", **flags)
    chat = [
        {
            "role": "user",
            "content": [{"type": "image_pil", "image_pil": random_image(56, 56)}, {"type": "text", "text": "What?"}],
        }
    ]
    out = llm.chat([chat], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert seen["lm"] == {torch.float32 if flags.get("fp32_softmax") else torch.bfloat16}
    assert seen["vision"] == {torch.float32 if flags.get("fp32_softmax_vision") else torch.bfloat16}


def test_default_dtype_is_bf16_on_gpus(tiny_dirs, tmp_path):
    """dtype auto: the checkpoint's dtype, except that an fp32 checkpoint serves in bf16 on a GPU (and fp16 runs
    in fp32 on the CPU). Only the configuration is built here, so no GPU is needed."""
    import json
    import shutil

    import torch

    from fovea.config.engine import EngineConfig

    def config_dir(dtype: str):
        target = tmp_path / dtype
        shutil.copytree(tiny_dirs["tiny-3b"], target)
        raw = json.loads((target / "config.json").read_text())
        raw["torch_dtype"] = raw["dtype"] = dtype
        (target / "config.json").write_text(json.dumps(raw))
        return target

    cases = {
        ("float32", "cuda"): torch.bfloat16,
        ("float32", "cpu"): torch.float32,
        ("bfloat16", "cuda"): torch.bfloat16,
        ("float16", "cuda"): torch.float16,
        ("float16", "cpu"): torch.float32,
    }
    for (checkpoint, device), expected in cases.items():
        assert EngineConfig.build(config_dir(checkpoint), device=device).dtype == expected, (checkpoint, device)
        shutil.rmtree(tmp_path / checkpoint)
    assert EngineConfig.build(config_dir("float32"), dtype="float32", device="cuda").dtype == torch.float32


def test_streamed_outputs_carry_the_prompt_only_first_and_last(llm):
    """DELTA outputs (what a server streams) keep a step at batch 256 cheap to send: the prompt fields travel
    with a request's first and final output; usage can still be counted from either."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    request = llm.inputs.make_request("delta", llm.inputs.process(LOREM), params)
    engine.add_request(request)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == "delta"]
    assert len(outputs) == 5 and outputs[-1].finished
    for i, output in enumerate(outputs):
        carries = output.prompt_token_ids == request.prompt_token_ids and output.prompt == LOREM
        assert carries == (i in (0, len(outputs) - 1)), i
        assert len(output.outputs[0].token_ids) == 1
    assert_engine_idle(engine)


def test_stream_interval_reports_the_first_tokens_at_once_then_every_k(llm, tiny_dirs):
    """vLLM's --stream-interval: a streamed request's first output at once, then one per `k` new tokens of a
    sample, and one when a sample finishes; the outputs add up to the tokens, text and logprobs the request gets
    unstreamed (n = 2, a stop string ending one sample mid-interval)."""
    every = LLM(
        str(tiny_dirs["tiny-3b"]), dtype="float32", max_model_len=2048, num_gpu_blocks_override=400, stream_interval=4
    )
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    whole = llm.generate(LOREM, greedy, use_tqdm=False)[0].outputs[0]
    stop = whole.text[len(llm.generate(LOREM, greedy.clone(max_tokens=6), use_tqdm=False)[0].outputs[0].text) :][:2]
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, logprobs=1)
    cases = {"greedy": greedy, "stop": greedy.clone(stop=[stop]), "n2": sampled}
    for name, params in cases.items():
        streamed = params.clone(output_kind=RequestOutputKind.DELTA)
        every.engine.add_request(every.inputs.make_request(name, every.inputs.process(LOREM), streamed))
    reports: dict[str, list] = {name: [] for name in cases}
    while every.engine.has_unfinished_requests():
        for output in every.engine.step():
            reports[output.request_id].append(output)
    assert [len(o.outputs[0].token_ids) for o in reports["greedy"]] == [1, 4, 4, 1]
    stopped = [len(o.outputs[0].token_ids) for o in reports["stop"]]
    assert stopped[:2] == [1, 4] and 1 <= stopped[-1] < 4 and len(stopped) == 3, stopped
    for name, params in cases.items():
        alone = llm.generate(LOREM, params, use_tqdm=False)[0]
        for c in alone.outputs:
            pieces = [s for o in reports[name] for s in o.outputs if s.index == c.index]
            assert [t for s in pieces for t in s.token_ids] == c.token_ids, name
            assert "".join(s.text for s in pieces) == c.text, name
            entries = [e for s in pieces for e in s.logprobs]  # (other batches: fp32 sums in another order)
            assert [e.keys() for e in entries] == [e.keys() for e in c.logprobs], name
            assert all(
                math.isclose(e[t].logprob, a[t].logprob, abs_tol=1e-4) for e, a in zip(entries, c.logprobs) for t in e
            ), name
            assert pieces[-1].finish_reason == c.finish_reason, name
        assert reports[name][-1].finished and reports[name][0].prompt_token_ids == alone.prompt_token_ids
    assert_engine_idle(every.engine)
    every.close()


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm, tiny_dirs):
    """vLLM's truncate_prompt_tokens: a text prompt keeps the last k of transformers' tokens of the whole text (one
    longer than max_model_len too, which is otherwise refused) and runs as those k given as ids; token ids keep
    their last k; -1 is max_model_len. A chat with an image is cut in the text before the image, never into it;
    k above max_model_len, or 0, is refused."""
    text = LOREM * 120
    whole = hf_tokenizer(tiny_dirs["tiny-3b"]).encode(text)
    assert len(whole) > llm.engine.config.max_model_len
    greedy = SamplingParams(temperature=0, max_tokens=4)
    cut = llm.generate(text, greedy.clone(truncate_prompt_tokens=100), use_tqdm=False)[0]
    assert cut.prompt_token_ids == whole[-100:]
    as_ids = llm.generate({"prompt_token_ids": whole[-100:]}, greedy, use_tqdm=False)[0]
    assert tokens([cut]) == tokens([as_ids])
    ids = llm.generate(whole[:300], greedy.clone(truncate_prompt_tokens=50), use_tqdm=False)[0]
    assert ids.prompt_token_ids == whole[250:300]
    every = llm.generate(whole[:1000], greedy.clone(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert every.prompt_token_ids == whole[:1000]  # shorter than max_model_len: nothing cut
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        llm.generate(whole[:3000], greedy, use_tqdm=False)
    chars = 2048 * llm.inputs.prompts.max_token_chars
    with pytest.raises(ValueError, match=f"truncate_prompt_tokens reads at most 2048 tokens' worth \\({chars} char"):
        llm.generate("a" * (chars + 1), greedy.clone(truncate_prompt_tokens=8), use_tqdm=False)

    image = random_image(96, 64, seed=8)
    messages = image_chat(image, system=SYSTEM)
    full = llm.inputs.process_chat(messages).token_ids
    image_start = full.index(llm.engine.config.model.vision_start_token_id)
    kept = len(full) - image_start  # the image and everything after it
    chat = llm.chat(messages, greedy.clone(truncate_prompt_tokens=kept), use_tqdm=False)[0]
    assert chat.prompt_token_ids == full[image_start:]
    rendered = llm.inputs.prompts.render_chat(messages)[0]
    tail = {"prompt": rendered[rendered.index("<|vision_start|>") :], "multi_modal_data": {"image": image}}
    assert tokens([chat]) == tokens(llm.generate(tail, greedy, use_tqdm=False))
    with pytest.raises(ValueError, match="would cut into the prompt's images"):
        llm.chat(messages, greedy.clone(truncate_prompt_tokens=kept - 1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(4096\) is more than max_model_len \(2048\)"):
        llm.generate(text, greedy.clone(truncate_prompt_tokens=4096), use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1"):
        SamplingParams(truncate_prompt_tokens=0)
    assert_engine_idle(llm.engine)


def test_priority_scheduling_runs_the_lowest_priority_first(llm, tiny_dirs):
    """vLLM's scheduling_policy="priority": with room for one sequence, prompts run by priority (lower first),
    whatever their order; a non-zero priority under the default fcfs policy is refused, naming the setting."""
    ranked = LLM(
        str(tiny_dirs["tiny-3b"]), dtype="float32", max_model_len=256, max_num_seqs=1, scheduling_policy="priority"
    )
    prompts = ["First given", "Second given", "Third given"]
    outputs = ranked.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False, priority=[2, 0, 1])
    started = sorted(range(3), key=lambda i: outputs[i].metrics.first_scheduled_time)
    assert started == [1, 2, 0]
    with pytest.raises(ValueError, match="priority 1 needs --scheduling-policy priority"):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False, priority=[0, 1, 0])
    with pytest.raises(ValueError, match="got 2 priorities for 3 prompts"):
        ranked.generate(prompts, use_tqdm=False, priority=[0, 1])


def contains(ids: list[int], word: list[int]) -> bool:
    return any(ids[i : i + len(word)] == word for i in range(len(ids) - len(word) + 1))


def test_bad_words_are_never_generated_and_change_nothing_before(llm, tiny_dirs):
    """vLLM's bad_words: a word's last token is banned wherever the output ends with its other tokens (a
    one-token word: everywhere). Words taken from what the model writes unconstrained (greedy and seeded
    sampling) never appear, the tokens before the first place one would are unchanged, and an engine that
    schedules steps ahead (async_scheduling) gives the same tokens."""
    tokenizer = hf_tokenizer(tiny_dirs["tiny-3b"])
    ahead = LLM(str(tiny_dirs["tiny-3b"]), dtype="float32", max_model_len=256, async_scheduling=True)
    for params in (
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=-1, top_p=1.0, seed=3, max_tokens=16, ignore_eos=True),
    ):
        free = list(llm.generate("The harbour at dawn", params, use_tqdm=False)[0].outputs[0].token_ids)
        pair, single = free[4:6], free[9]
        words = [tokenizer.decode(pair), tokenizer.decode([single])]
        assert tokenizer.encode(words[0].lstrip(), add_special_tokens=False) == pair  # as the engine reads it
        banned = params.clone(bad_words=words)
        got = [
            list(o.outputs[0].token_ids)
            for m in (llm, ahead)
            for o in m.generate("The harbour at dawn", banned, use_tqdm=False)
        ]
        assert got[0] == got[1]
        assert not contains(got[0], pair) and single not in got[0]
        first = min(free.index(single), next(i for i in range(len(free)) if free[i : i + 2] == pair) + 1)
        assert got[0][:first] == free[:first], (free, got[0])
    with pytest.raises(ValueError, match="bad_words must be non-blank strings"):
        SamplingParams(bad_words=["ok", "  "])
