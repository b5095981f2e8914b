"""LoRA adapters against PEFT: fovea's greedy tokens with an adapter equal transformers' on the base model with that
adapter merged into it (PEFT's merge_and_unload), for several adapters and the base model in one batch, with text
and images (adapter "a" names gate/up/down_proj, which Qwen2.5-VL's vision blocks have too, so it changes the
vision tower). The prefix cache and the encoder cache keep each adapter's entries apart."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from conftest import hf_inputs, random_image

from fovea import LLM, LoRARequest, SamplingParams
from fovea.core.sampling_params import RequestOutputKind
from fovea.engine.block_manager import block_hashes
from fovea.engine.engine import StepFailed
from fovea.models.loader import load_model
from fovea.models.lora import AdapterCheck, LoRAError, load_adapter

peft = pytest.importorskip("peft", reason="PEFT (the reference for LoRA) is in the test extras")

MAX_TOKENS = 8
TARGETS = {
    "a": ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],  # language model and vision MLPs
    "b": ["q_proj", "k_proj", "v_proj", "qkv"],  # the vision tower's fused qkv too
}


def write_adapter(base_dir, out_dir, targets, seed: int, rank: int = 8, **config):
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(base_dir), dtype=torch.float32)
    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **config)
    peft.get_peft_model(model, lora).save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="module")
def adapters(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = tiny_dirs["tiny-3b"]
    return {
        name: LoRARequest(name, i + 1, str(write_adapter(base, root / name, targets, seed=10 + i)))
        for i, (name, targets) in enumerate(TARGETS.items())
    }


_MERGED: dict = {}


def merged_model(base_dir, lora: LoRARequest | None):
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    key = lora.lora_name if lora else "base"
    if key not in _MERGED:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            str(base_dir), dtype=torch.float32, attn_implementation="eager"
        )
        if lora is not None:
            model = peft.PeftModel.from_pretrained(model, lora.lora_path).merge_and_unload()
        model.generation_config = GenerationConfig(do_sample=False, pad_token_id=151643)
        _MERGED[key] = model.eval()
    return _MERGED[key]


def reference(base_dir, lora, messages, images) -> list[int]:
    inputs = hf_inputs(base_dir, messages, images)
    out = merged_model(base_dir, lora).generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def chat(text: str, image=None) -> list[dict]:
    content = ([{"type": "image"}] if image is not None else []) + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def with_pil(messages, images):
    it = iter(images)
    return [
        {**m, "content": [{"type": "image_pil", "image_pil": next(it)} if p["type"] == "image" else p for p in m["content"]]}
        for m in messages
    ]  # fmt: skip


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    with LLM(str(tiny_dirs["tiny-3b"]), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16) as llm:
        yield llm


def check_mixed_batch(base_dir, adapters, llm):
    """Text and image prompts for the base model and both adapters, all in one batch, against PEFT merged."""
    image = random_image(84, 56, seed=3)
    cases = [
        (chat("Tell me about rivers."), []),
        (chat("What is in this picture?", image), [image]),
    ]
    loras = [None, adapters["a"], adapters["b"]]
    requests = [(case, lora) for lora in loras for case in cases]
    outputs = llm.chat(
        [with_pil(*case) for case, _ in requests], GREEDY, use_tqdm=False, lora_request=[lora for _, lora in requests]
    )
    got = [o.outputs[0].token_ids for o in outputs]
    for ((messages, images), lora), tokens in zip(requests, got):
        assert tokens == reference(base_dir, lora, messages, images), (lora and lora.lora_name, messages)
    by_adapter = [tuple(map(tuple, got[i : i + len(cases)])) for i in range(0, len(got), len(cases))]
    assert len(set(by_adapter)) == len(loras), "the adapters must change the answers for the test to mean anything"


def test_two_adapters_and_the_base_model_in_one_batch_equal_peft_merged(tiny_dirs, adapters, llm):
    check_mixed_batch(tiny_dirs["tiny-3b"], adapters, llm)


def test_tensor_parallel_ranks_hold_their_share_of_each_adapter(tiny_dirs, adapters):
    """TP=2 on the CPU: row-parallel layers split A's inputs, column-parallel ones B's outputs (q, k, v pieces and
    the vision tower's fused qkv each by its own heads); every rank loads the step's adapters itself."""
    device = "cpu" if torch.cuda.device_count() < 2 else "cuda"
    with LLM(
        str(tiny_dirs["tiny-3b"]), dtype="float32", device=device, tensor_parallel_size=2, enable_lora=True, max_loras=2
    ) as split:
        check_mixed_batch(tiny_dirs["tiny-3b"], adapters, split)


def test_adapter_a_changes_the_vision_tower_and_its_image_embeddings_are_cached_apart(tiny_dirs, adapters, llm):
    model, _ = load_model(tiny_dirs["tiny-3b"], dtype="float32")
    weights = load_adapter(model, adapters["a"], 16, torch.float32, "cpu")
    vision = [name for name, module in model.visual.named_modules() if module in weights.pairs]
    check = AdapterCheck(model.config, 16)  # what the front end keys the adapter's image embeddings by
    assert vision and check(adapters["a"])[1], "adapter a holds the vision blocks' MLPs"
    image = random_image(84, 56, seed=4)
    conversation = with_pil(chat("Describe it.", image), [image])
    base, adapted = (
        llm.chat(conversation, GREEDY, use_tqdm=False, lora_request=lora)[0] for lora in (None, adapters["a"])
    )
    assert adapted.num_cached_tokens == 0  # neither the base model's KV blocks nor its image embeddings
    assert adapted.outputs[0].token_ids == reference(
        tiny_dirs["tiny-3b"], adapters["a"], chat("Describe it.", image), [image]
    )
    assert base.outputs[0].token_ids != adapted.outputs[0].token_ids


def test_prefix_cache_is_keyed_by_adapter(tiny_dirs, adapters, llm):
    prompt = "Rivers of the world and the seas they reach: " * 6
    first_b, again_b = (llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapters["b"])[0] for _ in range(2))
    other = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapters["a"])[0]
    base = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    block = llm.engine.config.block_size
    assert first_b.num_cached_tokens == 0 and again_b.num_cached_tokens >= block  # its own blocks, found again
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0  # not b's blocks
    assert first_b.outputs[0].token_ids == again_b.outputs[0].token_ids
    ids = list(range(64))
    assert block_hashes(ids, 16, salt=b"lora:1") != block_hashes(ids, 16) != block_hashes(ids, 16, salt=b"lora:2")


def test_an_unloaded_adapter_leaves_the_engine_after_its_last_request(adapters, llm):
    """Unloaded while a request still runs with it, an adapter keeps its weights until that request ends (not
    read again from disk every step); then the next step frees them."""
    engine, held = llm.engine, llm.engine.runner.adapters
    lora = LoRARequest("a-again", 99, adapters["a"].lora_path)  # an id of its own: the module's LLM keeps a's
    params = GREEDY.clone(max_tokens=6, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request(llm.inputs.make_request("kept", llm.inputs.process("Count to ten.", None), params, lora=lora))
    engine.step()
    weights = held.get(lora)
    engine.remove_lora(99)
    outputs = engine.step()
    assert held.get(lora) is weights and not outputs  # still running, on the weights it had
    while engine.has_unfinished_requests():
        engine.step()
    llm.generate("Hello", GREEDY, use_tqdm=False)
    assert 99 not in held


def test_more_adapters_than_max_loras_take_turns(tiny_dirs, adapters):
    """max_loras=1: the second adapter's requests wait until the first's are done; all answers stay right."""
    with LLM(str(tiny_dirs["tiny-3b"]), dtype="float32", enable_lora=True, max_loras=1) as one:
        loras = [adapters["a"], adapters["b"], None, adapters["a"]]
        outputs = one.chat([chat("Count to five.")] * 4, GREEDY, use_tqdm=False, lora_request=loras)
    for lora, out in zip(loras, outputs):
        assert out.outputs[0].token_ids == reference(tiny_dirs["tiny-3b"], lora, chat("Count to five."), [])


# every linear layer's name in these families, towers and projectors included
EVERY_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "gate_proj", "up_proj", "down_proj", "fc1", "fc2"]


@pytest.mark.parametrize("family", ["gemma3", "llava", "internvl"])
def test_every_family_with_an_adapter_equals_peft_merged(family_dirs, family, tmp_path):
    """An adapter PEFT made on each family's transformers model, changing every linear layer of the decoder and
    the tower, gives the merged model's greedy tokens, with an image and without. LLaVA's features come from its
    tower's second-to-last layer: PEFT adapts the last one too, to no effect, and fovea (which never builds that
    layer) skips it (before, it refused the adapter)."""
    from test_families import conversation, llava_template, reference_inputs
    from test_families import with_pil as family_pil
    from transformers import AutoModelForImageTextToText, GenerationConfig

    model_dir = family_dirs[family]
    torch.manual_seed(11)
    model = AutoModelForImageTextToText.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    )
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=EVERY_LINEAR, init_lora_weights=False)
    adapted = peft.get_peft_model(model, config)
    adapted.save_pretrained(str(tmp_path / "adapter"))
    merged = adapted.merge_and_unload().eval()
    merged.generation_config = GenerationConfig(do_sample=False)  # plain greedy: no checkpoint defaults
    lora = LoRARequest("every-linear", 1, str(tmp_path / "adapter"))
    template = llava_template(model_dir) if family == "llava" else None
    with LLM(str(model_dir), dtype="float32", enable_lora=True, max_lora_rank=8, max_model_len=1536) as llm:
        for kind in ("text", "one_image"):
            messages, images = conversation(kind)
            with_adapter, base = (
                llm.chat([family_pil(messages, images)], GREEDY, use_tqdm=False, chat_template=template, lora_request=r)
                for r in (lora, None)
            )
            inputs = reference_inputs(family, model_dir, messages, images)
            with torch.no_grad():
                expected = merged.generate(
                    **inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False
                )
            assert with_adapter[0].outputs[0].token_ids == expected[0, inputs["input_ids"].shape[1] :].tolist(), kind
            assert with_adapter[0].outputs[0].token_ids != base[0].outputs[0].token_ids  # the adapter shows


def test_bad_adapters_fail_naming_the_problem(tiny_dirs, adapters, llm, tmp_path):
    base = tiny_dirs["tiny-3b"]
    wide = LoRARequest("wide", 9, str(write_adapter(base, tmp_path / "wide", ["q_proj"], seed=1, rank=32)))
    with pytest.raises(ValueError, match="rank 32, more than max_lora_rank 16"):
        llm.generate("hi", GREEDY, lora_request=wide)
    dora = LoRARequest("dora", 10, str(write_adapter(base, tmp_path / "dora", ["q_proj"], seed=1, use_dora=True)))
    with pytest.raises(ValueError, match="DoRA"):
        llm.generate("hi", GREEDY, lora_request=dora)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("missing", 11, str(tmp_path / "nowhere")))
    head = LoRARequest("head", 12, str(write_adapter(base, tmp_path / "head", ["lm_head"], seed=1)))
    with pytest.raises(ValueError, match="lm_head.*not supported"):
        llm.generate("hi", GREEDY, lora_request=head)
    bent = tmp_path / "bent"
    bent.mkdir()
    (bent / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 8}))
    from safetensors.torch import save_file

    prefix = "base_model.model.model.language_model.layers.0.self_attn.q_proj"
    save_file(
        {f"{prefix}.lora_A.weight": torch.ones(8, 7), f"{prefix}.lora_B.weight": torch.ones(128, 8)},
        bent / "adapter_model.safetensors",
    )
    with pytest.raises(LoRAError, match=r"q_proj has A \(8, 7\)"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("bent", 13, str(bent)))
    assert llm.generate("hi", GREEDY, use_tqdm=False)[0].finished  # the engine goes on


def test_adapters_whose_numbers_or_settings_cannot_be_served_are_refused_by_name(tiny_dirs, adapters, llm, tmp_path):
    """NaN weights, a NaN or 1e300 lora_alpha, int64 weights of 1e18, adapter_config.json as a list or with a
    string alpha, a rank of 0, a 1-D lora_A: each a LoRAError (a 400 when served) naming it, never another
    exception; and an adapter whose files change after its check is refused by the engine, not loaded."""
    from safetensors.torch import load_file, save_file

    source = Path(adapters["b"].lora_path)
    weights, config = (
        load_file(source / "adapter_model.safetensors"),
        json.loads((source / "adapter_config.json").read_text()),
    )
    name_a = next(n for n in weights if n.endswith("lora_A.weight"))
    name_b = name_a.replace("lora_A", "lora_B")

    def variant(name, tensors=None, settings=None, raw_settings=None):
        folder = tmp_path / name
        folder.mkdir()
        save_file({**weights, **(tensors or {})}, folder / "adapter_model.safetensors")
        text = raw_settings if raw_settings is not None else json.dumps({**config, **(settings or {})})
        (folder / "adapter_config.json").write_text(text)
        return str(folder)

    cases = [
        (variant("nan", {name_a: weights[name_a] * float("nan")}), "lora_A .*beyond"),
        (variant("alpha-nan", settings={"lora_alpha": float("nan")}), "lora_alpha must be a number"),
        (variant("alpha-huge", settings={"lora_alpha": 1e300}), "lora_alpha must be a number"),
        (variant("alpha-text", settings={"lora_alpha": "16"}), "lora_alpha must be a number"),
        (variant("ints", {name_b: torch.full(weights[name_b].shape, 10**18, dtype=torch.int64)}), "not floating"),
        (variant("list", raw_settings="[]"), "must hold an object, not list"),
        (
            variant(
                "rank0",
                {name_a: torch.zeros(0, weights[name_a].shape[1]), name_b: torch.zeros(weights[name_b].shape[0], 0)},
            ),
            "rank at least 1",
        ),
        (variant("flat", {name_a: weights[name_a].reshape(-1)}), "rank at least 1"),
    ]
    for i, (path, words) in enumerate(cases):
        with pytest.raises(LoRAError, match=words):
            llm.generate("hi", GREEDY, lora_request=LoRARequest(f"bad-{i}", 30 + i, path), use_tqdm=False)
    changing = LoRARequest("changing", 50, variant("changing"))
    llm.inputs.check_lora(changing)  # checked (as a server does when the adapter is loaded) ...
    save_file({**weights, name_b: weights[name_b] * 2}, Path(changing.lora_path) / "adapter_model.safetensors")
    with pytest.raises(StepFailed, match="changed since it was loaded"):  # ... then its file is replaced
        llm.generate("hi", GREEDY, lora_request=changing, use_tqdm=False)
    assert llm.generate("hi", GREEDY, use_tqdm=False)[0].finished  # the engine goes on


def test_an_adapter_without_enable_lora_is_refused(tiny_dirs, adapters):
    with LLM(str(tiny_dirs["tiny-3b"]), dtype="float32") as plain:
        with pytest.raises(ValueError, match="LoRA is off"):
            plain.generate("hi", GREEDY, lora_request=adapters["a"])


def test_served_adapters_load_unload_and_answer_as_offline(tiny_dirs, adapters, llm, tmp_path):
    """`fovea serve --enable-lora --lora-modules`: adapters are models in /v1/models, a request's `model` picks
    one (several in flight at once), and the runtime endpoints add and remove them (VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    An unloaded adapter's weights leave the engine with its next step (room for four: no eviction hides it)."""
    import concurrent.futures

    import httpx
    import openai
    from serving import metric, running_server

    a, b = adapters["a"], adapters["b"]
    b_json = json.dumps({"name": "b", "path": b.lora_path})
    flags = [
        "--dtype",
        "float32",
        "--served-model-name",
        "tiny",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "4",
    ]
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    with running_server(tiny_dirs["tiny-3b"], *flags, "--lora-modules", f"a={a.lora_path}", b_json, env=env) as (
        base,
        _,
    ):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        cards = {m.id: m for m in client.models.list().data}
        assert list(cards) == ["tiny", "a", "b"]
        assert (cards["a"].parent, cards["a"].root, cards["tiny"].parent) == ("tiny", a.lora_path, None)
        params = llm.get_default_sampling_params().clone(temperature=0, max_tokens=MAX_TOKENS)  # the server's defaults

        def answer(model: str) -> str:
            reply = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Name a colour."}],
                temperature=0,
                max_tokens=MAX_TOKENS,
            )
            return reply.choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            got = list(pool.map(answer, ["a", "b", "tiny"] * 2))
        expected = {
            name: llm.chat(chat("Name a colour."), params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
            for name, lora in (("a", a), ("b", b), ("tiny", None))
        }
        assert got == [expected[name] for name in ["a", "b", "tiny"] * 2]
        assert len(set(expected.values())) == 3
        completion = client.completions.create(model="b", prompt="Once upon", temperature=0, max_tokens=MAX_TOKENS)
        offline = llm.generate("Once upon", params, use_tqdm=False, lora_request=b)[0].outputs[0].text
        assert completion.choices[0].text == offline
        with pytest.raises(openai.NotFoundError, match="The model `c` does not exist"):
            answer("c")

        def held() -> float:
            time.sleep(0.2)  # the gauges come with the engine's next report after the step
            return metric(base, "fovea:lora_adapters_held")

        assert held() == 2  # a and b, used above
        load = lambda **body: httpx.post(base + "/v1/load_lora_adapter", json=body, timeout=60)  # noqa: E731
        unload = lambda **body: httpx.post(base + "/v1/unload_lora_adapter", json=body, timeout=60)  # noqa: E731
        reply = load(lora_name="c", lora_path=a.lora_path)
        assert reply.status_code == 200 and "added successfully" in reply.text
        assert answer("c") == expected["a"]
        assert load(lora_name="c", lora_path=a.lora_path).json()["error"]["message"] == (
            "The lora adapter 'c' has already been loaded."
        )
        wide = write_adapter(tiny_dirs["tiny-3b"], tmp_path / "wide", ["q_proj"], seed=1, rank=32)
        refused = load(lora_name="wide", lora_path=str(wide))
        assert refused.status_code == 400 and "max_lora_rank 16" in refused.json()["error"]["message"]
        assert load(lora_name="d").status_code == 400
        assert unload(lora_name="c").status_code == 200
        assert [m.id for m in client.models.list().data] == ["tiny", "a", "b"]
        with pytest.raises(openai.NotFoundError):
            answer("c")
        assert unload(lora_name="c").json()["error"]["type"] == "NotFoundError"
        assert answer("a") == expected["a"]
        assert held() == 2  # a and b: c went with the step that answered
        assert unload(lora_name="b").status_code == 200
        answer("tiny")
        assert held() == 1


def test_runtime_adapter_routes_need_the_variable(monkeypatch):
    from fovea.server.lora_routes import routes

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert routes() == []
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert [path for path, _, _ in routes()] == ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]


def test_lora_modules_flag_forms():
    import argparse

    from fovea.config.flags import LoRAModule, lora_module_arg

    assert lora_module_arg("sql=/adapters/sql") == LoRAModule("sql", "/adapters/sql")
    given = '{"name": "sql", "path": "/a", "base_model_name": "qwen"}'
    assert lora_module_arg(given) == LoRAModule("sql", "/a", "qwen")
    for bad in ("sql", "=/a", '{"name": "sql"}'):
        with pytest.raises(argparse.ArgumentTypeError):
            lora_module_arg(bad)
