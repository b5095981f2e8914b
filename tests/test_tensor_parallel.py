"""Tensor parallelism on the CPU (gloo): N ranks give exactly the single-process tokens, and log-probabilities
within 1e-4, for text and image prompts, through chunked prefill, prefix-cache hits and preemption, stepping in
order or ahead. A step every rank fails (a request's failure) fails that request alone and the ranks go on; one that
fails on rank 0 alone leaves them out of step, which the engine says at once instead of hanging.

tiny-3b has 4 query / 2 KV heads (TP=2 splits both; TP=4 replicates the KV heads) and a 2-head vision tower
(at TP=4 the engine runs it whole on each rank, mm_encoder_tp_mode data); tiny-7b has 1 KV head (replicated at any size) and a 4-head tower.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest
import torch
from conftest import random_image
from test_engine_vs_hf import assert_engine_idle

from fovea import LLM, SamplingParams, distributed
from fovea.core.sampling_params import RequestOutputKind
from fovea.engine.engine import StepFailed
from fovea.runner import tp_workers

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
SHARED = "A shared opening that is long enough to fill several KV blocks of sixteen tokens each, " * 3


def workload() -> list:
    images = [random_image(140, 112, seed=3), random_image(84, 196, seed=4), random_image(56, 56, seed=5)]
    return [
        "Hello there, how are",
        SHARED + "first ending",
        SHARED + "second ending, which reuses the cached prefix",
        {"prompt": IMAGE + "Describe this picture.", "multi_modal_data": {"image": images[0]}},
        {"prompt": "Compare " + IMAGE + " with " + IMAGE, "multi_modal_data": {"image": images[1:]}},
        list(range(100, 160)),
    ]


def run(model_dir, **engine_args) -> tuple[list, dict]:
    """Greedy tokens and top-2 log-probabilities (of the prompts too) of the workload, in two rounds (the second hits the prefix
    cache), on an engine small enough to chunk prompts and preempt sequences."""
    llm = LLM(
        str(model_dir),
        max_model_len=160,
        max_num_batched_tokens=48,
        num_gpu_blocks_override=10,
        block_size=16,
        **engine_args,
    )
    try:
        # the images encoded first and kept in the encoder cache: which sequences wait, and so how steps are
        # batched (the order of sums in near-tied logprobs) and preempted, does not depend on how fast the
        # vision tower's thread keeps up on a busy machine
        llm.generate([p for p in workload() if isinstance(p, dict)], SamplingParams(max_tokens=1), use_tqdm=False)
        steps_ahead = []  # per step: whether it was queued before the previous one was back (async scheduling)
        execute = llm.engine.runner.execute
        llm.engine.runner.execute = lambda step, encoded, previous=None: (
            steps_ahead.append(previous is not None) or execute(step, encoded, previous)
        )
        params = SamplingParams(temperature=0, max_tokens=20, logprobs=2, prompt_logprobs=2, ignore_eos=True)
        outputs = llm.generate(workload(), params, use_tqdm=False) + llm.generate(
            workload()[1:3], params, use_tqdm=False
        )
        runner = llm.engine.runner
        stats = {
            "preemptions": llm.engine.scheduler.num_preemptions,
            "prefix_hits": llm.engine.scheduler.prefix_cache_hits,
            "kv_bytes_per_token": runner.kv_cache_bytes // (runner.num_blocks * 16),
            "ranks": runner.parallel.size if runner.parallel else 0,
            "steps_ahead": sum(steps_ahead),
            "weight_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters()),
            "expert_bytes": sum(
                p.numel() * p.element_size() for name, p in runner.model.named_parameters() if ".experts." in name
            ),
        }
        # the prompt's log-probabilities too: every rank joins in scoring them (a gathered vocabulary)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs + o.prompt_logprobs[1:]) for o in outputs], stats
    finally:
        llm.close()


_BASELINES: dict = {}


def baseline(model_dir, device: str | None = None, async_scheduling: bool = False):
    """One process's run, stepping in order or (async_scheduling) ahead, as the ranks' run is asked to."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    key = model_dir, device, async_scheduling
    if key not in _BASELINES:
        _BASELINES[key] = run(model_dir, device=device, async_scheduling=async_scheduling)
    return _BASELINES[key]


def assert_same(expected, got):
    for (want_ids, want_lp), (ids, lp) in zip(expected, got, strict=True):
        assert ids == want_ids
        for want_entry, entry in zip(want_lp, lp, strict=True):
            assert list(entry) == list(want_entry)  # the same top tokens, in order
            np.testing.assert_allclose(
                [e.logprob for e in entry.values()], [e.logprob for e in want_entry.values()], atol=1e-4
            )


@pytest.mark.parametrize(
    "name, engine_args",
    [
        ("tiny-3b", dict(tensor_parallel_size=2)),
        ("tiny-7b", dict(tensor_parallel_size=4)),
        ("tiny-3b", dict(tensor_parallel_size=4)),  # its 2-head tower whole on each rank, unasked
        ("tiny-3b", dict(tensor_parallel_size=1, distributed_executor_backend="mp")),
        # steps queued before the previous one's samples are back, which rank 0 hands the other ranks
        ("tiny-3b", dict(tensor_parallel_size=2, async_scheduling=True)),
    ],
    ids=["3b-tp2", "7b-tp4-replicated-kv", "3b-tp4-whole-tower", "3b-group-of-one", "3b-tp2-ahead"],
)
def test_same_tokens_as_one_process(tiny_dirs, name, engine_args):
    from fovea.config.model import ModelConfig
    from fovea.plan import meta_model, plan_memory

    size = engine_args["tensor_parallel_size"]
    # ranks on the CPU (gloo) where the machine has fewer GPUs than ranks, as on CI; a group of one uses the GPU
    device = "cpu" if torch.cuda.device_count() < size else "cuda"
    ahead = engine_args.get("async_scheduling", False)
    expected, base_stats = baseline(tiny_dirs[name], device, ahead)
    got, stats = run(tiny_dirs[name], device=device, **{"async_scheduling": False, **engine_args})
    assert_same(expected, got)
    # the workload did exercise what it is meant to, in both runs alike
    assert stats["preemptions"] == base_stats["preemptions"] > 0
    assert stats["prefix_hits"] == base_stats["prefix_hits"] > 0
    assert stats["steps_ahead"] == base_stats["steps_ahead"] and (stats["steps_ahead"] > 0) == ahead
    # rank 0 holds its share of the KV heads (one replicated head at least), as `fovea plan` says per GPU
    assert stats["ranks"] == size and base_stats["ranks"] == 0  # the distributed path, against the plain one
    kv_heads = {"tiny-3b": 2, "tiny-7b": 1}[name]
    assert stats["kv_bytes_per_token"] == base_stats["kv_bytes_per_token"] * max(1, kv_heads // size) // kv_heads
    plan = plan_memory(tiny_dirs[name], 80, dtype="float32", tensor_parallel_size=size)
    assert stats["kv_bytes_per_token"] == plan.kv_bytes_per_token
    # and its weights (norms and some biases whole on every rank: not counted apart), a whole tower counted whole
    tower = sum(p.numel() * 4 for p in meta_model(ModelConfig.from_dir(tiny_dirs[name])).visual.parameters())
    assert abs(stats["weight_bytes"] - plan.weights_bytes) < tower // 3, (stats["weight_bytes"], plan.weights_bytes)


def test_qwen3_vl_moe_same_tokens_with_experts_split_over_the_ranks(tmp_path_factory):
    """Qwen3-VL-MoE at TP=2: attention, the dense layer, every expert (layers/moe.py: half of each expert's width
    on each rank) and the vision tower split over the ranks, DeepStack features broadcast with the embeddings."""
    from fovea.testing.tiny_qwen3_vl import write_qwen3_vl_checkpoint

    model_dir = write_qwen3_vl_checkpoint(tmp_path_factory.mktemp("moe"), "tiny-qwen3-vl-moe", seed=2)
    device = "cpu" if torch.cuda.device_count() < 2 else "cuda"
    expected, base_stats = run(model_dir, device=device)
    got, stats = run(model_dir, device=device, tensor_parallel_size=2)
    assert stats["ranks"] == 2 and stats["preemptions"] == base_stats["preemptions"] > 0
    assert 2 * stats["expert_bytes"] == base_stats["expert_bytes"] > 0
    assert_same(expected, got)


def test_ray_backend_same_tokens(tiny_dirs):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        expected, _ = baseline(tiny_dirs["tiny-3b"])
        got, _ = run(tiny_dirs["tiny-3b"], tensor_parallel_size=2, distributed_executor_backend="ray")
        assert_same(expected, got)
    finally:
        ray.shutdown()


@pytest.mark.parametrize(
    "name, size, mode, words",
    [
        ("tiny-3b", 3, "weights", "attention heads (4) do not divide over tensor_parallel_size 3"),
        ("tiny-3b", 2, "pipeline", "mm_encoder_tp_mode must be one of weights, data; got 'pipeline'"),
    ],
)
def test_sizes_that_do_not_divide_fail_at_start(tiny_dirs, name, size, mode, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        LLM(str(tiny_dirs[name]), tensor_parallel_size=size, mm_encoder_tp_mode=mode)


def test_experts_whose_width_does_not_divide_fail_at_start(tmp_path):
    from fovea.testing.tiny_qwen3_vl import write_qwen3_vl_checkpoint

    model_dir = write_qwen3_vl_checkpoint(tmp_path / "moe", "tiny-qwen3-vl-moe")
    odd = {"text_config": {"moe_intermediate_size": 25}}
    with pytest.raises(ValueError, match=r"experts' MLP width \(25\) do not divide over tensor_parallel_size 2"):
        LLM(str(model_dir), tensor_parallel_size=2, hf_overrides=odd)


def test_a_vision_tower_that_cannot_split_runs_whole_on_each_rank(tiny_dirs, caplog):
    """tiny-3b's tower has 2 heads: over 4 ranks the engine runs it whole on each (mm_encoder_tp_mode data) and
    says so, where vLLM would pad it with empty heads; over 2 ranks, or asked for data, nothing changes."""
    from fovea.config.engine import EngineConfig

    def mode(size: int, asked: str = "weights") -> str:
        config = EngineConfig.build(tiny_dirs["tiny-3b"], tensor_parallel_size=size, mm_encoder_tp_mode=asked)
        return config.mm_encoder_tp_mode

    logging.getLogger("fovea").addHandler(caplog.handler)  # (the fovea logger does not propagate)
    try:
        assert mode(4) == "data"
        assert "the vision tower (2 heads) cannot be split over 4 ranks" in caplog.text
        caplog.clear()
        assert (mode(2), mode(4, "data"), mode(1)) == ("weights", "data", "weights") and not caplog.text
    finally:
        logging.getLogger("fovea").removeHandler(caplog.handler)


def test_vocabulary_that_does_not_divide_is_padded():
    """Each rank holds ceil(vocab / N) rows, the last one padded: the ranks' embeddings sum to the full lookup
    and their logits side by side, cut to the vocabulary, are the full product. The collectives are left out
    (each rank's forward returns its own part) and done here by hand."""
    import dataclasses

    import torch

    from fovea.distributed import TPGroup, tensor_parallel
    from fovea.layers.basic import ParallelLMHead, VocabParallelEmbedding

    @dataclasses.dataclass(frozen=True)
    class OwnPart(TPGroup):
        def all_reduce(self, x):
            return x

        def all_gather(self, x):
            return x

    vocab, hidden, size = 10, 4, 3
    full = torch.randn(vocab, hidden)
    ids, x = torch.tensor([0, 3, 4, 7, 9]), torch.randn(2, hidden)
    embeds, logits = [], []
    for rank in range(size):
        with tensor_parallel(OwnPart(rank, size, group="no collectives: this test's own")):
            embedding, head = VocabParallelEmbedding(vocab, hidden), ParallelLMHead(vocab, hidden)
        embedding.weight_loader(embedding.weight, full)
        head.weight_loader(head.weight, full)
        assert embedding.weight.shape == (4, hidden)
        embeds.append(embedding(ids))
        logits.append(head(x))
    torch.testing.assert_close(sum(embeds), full[ids])
    gathered = torch.cat(logits, -1)
    torch.testing.assert_close(gathered[:, :vocab], x @ full.t())
    assert gathered.shape[1] == 12 and not gathered[:, vocab:].any()  # the padding scores 0 and is cut off


# Installed in the test's process, and through a sitecustomize module in the processes started with
# FOVEA_TEST_POISON_RANKS set ("all"; "0": not in the workers; "workers": only there, processes or Ray actors): a step holding the POISON token raises in the
# decoder's second layer (after the first one's collectives), and so does the vision tower run over an image of
# POISON_PATCHES patches.
POISON_HOOK = """
import os
import sys

POISON = 4242
POISON_PATCHES = 18 * 14


def install(set_attribute):
    from fovea.models.decoder import DecoderLayer
    from fovea.runner.model_runner import ModelRunner

    state = {"poisoned": False, "layers": 0}
    run_step, layer_forward = ModelRunner.run_step, DecoderLayer.forward

    def poisoned_run_step(self, step, *args):
        state.update(poisoned=POISON in list(step.token_ids), layers=0)
        return run_step(self, step, *args)

    def poisoned_layer(self, *args):
        state["layers"] += 1
        if state["poisoned"] and state["layers"] == 2:
            raise RuntimeError("injected: a step that fails in the second layer")
        return layer_forward(self, *args)

    encode_pixels = ModelRunner._encode_pixels

    def poisoned_encode_pixels(self, items, *args):
        if any(t * h * w == POISON_PATCHES for t, h, w in (item.grid_thw for item in items)):
            raise RuntimeError("injected: a vision tower run that fails")
        return encode_pixels(self, items, *args)

    set_attribute(ModelRunner, "run_step", poisoned_run_step)
    set_attribute(DecoderLayer, "forward", poisoned_layer)
    set_attribute(ModelRunner, "_encode_pixels", poisoned_encode_pixels)


ranks = os.environ.get("FOVEA_TEST_POISON_RANKS")
worker = "fovea.runner.tp_workers" in sys.orig_argv or any(arg.endswith("default_worker.py") for arg in sys.orig_argv)
if ranks == "all" or (ranks == "0" and not worker) or (ranks == "workers" and worker):
    install(setattr)
if worker and os.environ.get("FOVEA_TEST_SETTLE_WAIT_S"):  # a worker's wait for rank 0's word, shortened
    from fovea.runner import tp_workers

    tp_workers.SETTLE_WAIT_S = float(os.environ["FOVEA_TEST_SETTLE_WAIT_S"])
"""


@pytest.fixture
def poison_hook(tmp_path, monkeypatch):
    """`install(on_rank_0, on_workers)`: the hook where asked (the workers: those started after the call)."""
    (tmp_path / "sitecustomize.py").write_text(POISON_HOOK)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    hook: dict = {}
    exec(POISON_HOOK, hook)

    def install(on_rank_0: bool, on_workers: bool) -> None:
        if on_rank_0:
            hook["install"](monkeypatch.setattr)
        if on_workers:  # (only in the workers where rank 0 has not the hook: Ray starts processes of its own too)
            monkeypatch.setenv("FOVEA_TEST_POISON_RANKS", "all" if on_rank_0 else "workers")

    return install


# two requests beside one holding the POISON token, on an engine small enough for three
PROMPTS = {"a": list(range(100, 140)), "poison": [4242, *range(300, 320)], "b": list(range(200, 230))}
POISON_PARAMS = SamplingParams(temperature=0, max_tokens=8, output_kind=RequestOutputKind.FINAL_ONLY)
POISON_OPTIONS = dict(dtype="float32", max_model_len=256, block_size=16, num_gpu_blocks_override=40)


def add_poisoned_requests(llm) -> None:
    for name, prompt in PROMPTS.items():
        request = llm.inputs.make_request(name, llm.inputs.process({"prompt_token_ids": prompt}), POISON_PARAMS)
        llm.engine.add_request(request)


def test_a_step_every_rank_fails_fails_its_request_alone_and_the_ranks_go_on(tiny_dirs, poison_hook):
    """Met by every rank at the same place (a request's failure), a failed step leaves the ranks in step: the
    request fails alone, the others end with the tokens one process gives, and the engine goes on."""
    innocent = {name: prompt for name, prompt in PROMPTS.items() if name != "poison"}
    with LLM(str(tiny_dirs["tiny-3b"]), **POISON_OPTIONS) as alone:
        outputs = alone.generate([{"prompt_token_ids": p} for p in innocent.values()], POISON_PARAMS, use_tqdm=False)
    expected = {name: output.outputs[0].token_ids for name, output in zip(innocent, outputs)}
    assert all(4242 not in tokens for tokens in expected.values())  # only the poison's steps hold the token
    poison_hook(on_rank_0=True, on_workers=True)
    with LLM(str(tiny_dirs["tiny-3b"]), tensor_parallel_size=2, **POISON_OPTIONS) as llm:
        engine, outputs, failed = llm.engine, {}, []
        add_poisoned_requests(llm)
        while engine.has_unfinished_requests():
            try:
                outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            except StepFailed as failure:
                failed.append(failure.request_ids)
        assert failed == [["poison"]] and outputs == expected
        assert_engine_idle(engine)
        again = llm.generate([{"prompt_token_ids": innocent["a"]}], POISON_PARAMS, use_tqdm=False)
        assert again[0].outputs[0].token_ids == expected["a"]


@pytest.mark.parametrize("mode", ["weights", "data"])
def test_a_tower_run_that_fails_fails_the_requests_showing_its_image_alone(tiny_dirs, poison_hook, mode):
    """The vision tower fails for one image: the request showing it fails, the others (one with a larger image,
    encoded in the same run first) end with the tokens one process gives, and later images are encoded. Split
    over the ranks every rank fails; with whole towers (data) the image's rank alone (rank 1 in the first run,
    rank 0 when the poison is encoded again alone), and the gather tells the others."""
    poisoned, other = random_image(252, 196, seed=8), random_image(280, 224, seed=3)
    prompts = {
        "poison": {"prompt": IMAGE + "Describe this picture.", "multi_modal_data": {"image": poisoned}},
        "image": {"prompt": IMAGE + "Describe this picture.", "multi_modal_data": {"image": other}},
        "text": "Hello there, how are",
    }
    with LLM(str(tiny_dirs["tiny-3b"]), **POISON_OPTIONS) as alone:
        outputs = alone.generate([prompts["image"], prompts["text"]], POISON_PARAMS, use_tqdm=False)
    expected = {"image": outputs[0].outputs[0].token_ids, "text": outputs[1].outputs[0].token_ids}
    poison_hook(on_rank_0=True, on_workers=True)
    options = dict(tensor_parallel_size=2, mm_encoder_tp_mode=mode, **POISON_OPTIONS)
    with LLM(str(tiny_dirs["tiny-3b"]), **options) as llm:
        engine, outputs, failed, runs = llm.engine, {}, [], []
        encode_images = engine.runner.encode_images
        engine.image_encoder._encode = lambda items: runs.append(len(items)) or encode_images(items)
        for name, prompt in prompts.items():
            engine.add_request(llm.inputs.make_request(name, llm.inputs.process(prompt), POISON_PARAMS))
        while engine.has_unfinished_requests():
            try:
                outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            except StepFailed as failure:
                failed.append((failure.request_ids, str(failure)))
        assert runs[0] == 2 and [ids for ids, _ in failed] == [["poison"]] and "injected" in failed[0][1]
        assert outputs == expected
        assert_engine_idle(engine)
        llm.reset_mm_cache()
        again = llm.generate([prompts["image"]], POISON_PARAMS, use_tqdm=False)
        assert again[0].outputs[0].token_ids == expected["image"]


def test_a_step_that_fails_on_rank_0_alone_stops_the_engine_at_once(tiny_dirs, poison_hook, monkeypatch):
    """Rank 0 failed in the second layer while the other rank waits in that layer's collective: the next step's
    would be paired with it, so the engine says the ranks are out of step (in SETTLE_TIMEOUT_S, not after the
    collectives' 30-minute timeout) and stops them; in a server the engine process is started again."""
    monkeypatch.setattr(distributed, "SETTLE_TIMEOUT_S", 2.0)
    poison_hook(on_rank_0=True, on_workers=False)
    llm = LLM(str(tiny_dirs["tiny-3b"]), tensor_parallel_size=2, **POISON_OPTIONS)
    worker = llm.engine.workers.processes[0]
    add_poisoned_requests(llm)
    start = time.monotonic()
    with pytest.raises(distributed.RanksOutOfStep, match="injected: a step that fails in the second layer"):
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    assert time.monotonic() - start < 30
    assert worker.wait(timeout=30) is not None  # the other rank was stopped
    llm.close()


@pytest.mark.parametrize(
    "backend, job", [("mp", "step"), ("mp", "vision tower run"), ("ray", "vision tower run")], ids=lambda v: v[:5]
)
def test_a_job_that_fails_on_a_worker_alone_is_out_of_step_not_a_dead_worker(
    tiny_dirs, poison_hook, monkeypatch, backend, job
):
    """The worker failed a step in its second layer (or a tower run, before its collectives) while rank 0 waits in
    a collective: no word comes from rank 0 within SETTLE_WAIT_S (2 s here), so the worker leaves out of step,
    and the engine says RanksOutOfStep (in a server a new engine process starts), not WorkerDied (the server
    would stop). A Ray actor's tower loop is a thread of its own: it says so through the actor's run too."""
    monkeypatch.setenv("FOVEA_TEST_SETTLE_WAIT_S", "2")
    poison_hook(on_rank_0=False, on_workers=True)
    if backend == "ray":  # (after the hook: Ray's worker processes start with it)
        ray = pytest.importorskip("ray")
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        llm = LLM(
            str(tiny_dirs["tiny-3b"]), tensor_parallel_size=2, distributed_executor_backend=backend, **POISON_OPTIONS
        )
        if job == "step":
            add_poisoned_requests(llm)
        else:
            prompt = {"prompt": IMAGE + "Describe this.", "multi_modal_data": {"image": random_image(252, 196)}}
            llm.engine.add_request(llm.inputs.make_request("poison", llm.inputs.process(prompt), POISON_PARAMS))
        start, workers = time.monotonic(), llm.engine.workers
        with pytest.raises(distributed.RanksOutOfStep):
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
        assert time.monotonic() - start < 20
        # how the worker ended, which rank 0's watcher reads (in a server: a new engine, not a stopped server)
        if backend == "mp":
            assert workers.processes[0].wait(timeout=30) == tp_workers.OUT_OF_STEP_EXIT
        else:
            with pytest.raises(distributed.RanksOutOfStep, match=f"a {job} failed on this rank alone"):
                ray.get(next(iter(workers.runs)), timeout=30)
        llm.close()
    finally:
        if backend == "ray":
            ray.shutdown()
