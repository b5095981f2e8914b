"""LLaVA-1.5, Qwen2-VL, Qwen3-VL (dense and MoE), Gemma 3 and InternVL against transformers on tiny fp32 checkpoints:
preprocessing, logits, and greedy tokens through the whole engine (chunked prefill, prefix caching, preemption)
with text, one image and two images."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import hf_inputs, hf_tokenizer, internvl_inputs, random_image

from fovea import LLM, SamplingParams
from fovea.attention.layer import AttentionMetadata
from fovea.models.base import ModelOptions
from fovea.models.loader import load_model
from fovea.models.mrope_positions import decode_positions
from fovea.multimodal.patchify import patchify
from fovea.multimodal.prompt import PromptProcessor

FAMILIES = ["llava", "qwen2-vl", "qwen3-vl", "qwen3-vl-moe"]
# logits and engine tokens; their own checks: tests/test_gemma3.py, tests/test_internvl.py
PARITY_FAMILIES = [*FAMILIES, "gemma3", "internvl"]
MAX_TOKENS = 10


_HF: dict = {}


def hf_model(model_dir, dtype=torch.float32):
    from transformers import AutoModelForImageTextToText, GenerationConfig

    key = (str(model_dir), dtype)
    if key not in _HF:
        # float64: MoE experts as a loop (grouped matmuls take no float64)
        experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
        model = AutoModelForImageTextToText.from_pretrained(
            str(model_dir), dtype=dtype, attn_implementation="eager", **experts
        ).eval()
        model.generation_config = GenerationConfig(do_sample=False)  # plain greedy, no stop token
        _HF[key] = model
    return _HF[key]


def forget_hf_models(model_dir) -> None:
    for key in [key for key in _HF if key[0] == str(model_dir)]:
        del _HF[key]


def llava_template(model_dir) -> str:
    return json.loads((model_dir / "chat_template.json").read_text())["chat_template"]


def hf_llava_inputs(model_dir, messages, images):
    """transformers only: its tokenizer with the template, CLIPImageProcessorPil, 576 <image> tokens per image."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = hf_tokenizer(model_dir)
    text = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=llava_template(model_dir)
    )
    out = {}
    if images:
        out["pixel_values"] = CLIPImageProcessorPil.from_pretrained(str(model_dir))(images=images, return_tensors="pt")[
            "pixel_values"
        ]
        text = text.replace("<image>", "<image>" * 576)
    out["input_ids"] = torch.tensor([tok.encode(text, add_special_tokens=False)])
    return out


def hf_processor_inputs(model_dir, messages, images):
    """transformers' own processor (Gemma 3's: its chat template, image processor and placeholder expansion)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(model_dir))
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return dict(processor(text=text, images=images or None, return_tensors="pt", add_special_tokens=False))


def reference_inputs(family, model_dir, messages, images, videos=()):
    if family == "gemma3":
        return hf_processor_inputs(model_dir, messages, images)
    if family == "internvl":
        return internvl_inputs(model_dir, messages, images, videos)
    return hf_llava_inputs(model_dir, messages, images) if family == "llava" else hf_inputs(model_dir, messages, images)


def conversation(kind: str):
    """(messages as the template sees them, images)."""
    text = {"type": "text", "text": "Describe the colours, then count the objects."}
    if kind == "text":
        return [{"role": "user", "content": "Write a haiku about the sea, please."}], []
    if kind == "one_image":
        return [{"role": "user", "content": [{"type": "image"}, text]}], [random_image(500, 375, 21)]
    content = [{"type": "image"}, {"type": "text", "text": "and then"}, {"type": "image"}, text]
    return [{"role": "user", "content": content}], [random_image(200, 333, 22), random_image(351, 349, 23)]


def with_pil(messages, images):
    it = iter(images)
    return [
        {
            **m,
            "content": m["content"]
            if isinstance(m["content"], str)
            else [{"type": "image_pil", "image_pil": next(it)} if p["type"] == "image" else p for p in m["content"]],
        }
        for m in messages
    ]


@pytest.mark.parametrize("size", [(640, 480), (333, 517), (336, 336), (200, 90), (1000, 336)])
def test_llava_pixels_equal_clip_image_processor(family_dirs, size):
    """Shortest side to 336 (bicubic on uint8), centre crop, rescale and normalise: bit for bit."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    model_dir = family_dirs["llava"]
    image = random_image(*size, seed=sum(size))
    processor = PromptProcessor(model_dir, load_model(model_dir, dtype="float32")[0].config).image_processor
    processed = processor(image)
    assert processed.grid_thw == (1, 24, 24) and processed.num_tokens == 576
    ours = patchify(torch.from_numpy(processed.pixels), processor.config)  # (576, 3 * 14 * 14), row-major patches
    ref = CLIPImageProcessorPil.from_pretrained(str(model_dir))(images=[image], return_tensors="pt")["pixel_values"]
    ref = ref[0].reshape(3, 24, 14, 24, 14).permute(1, 3, 0, 2, 4).reshape(576, -1)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("family", PARITY_FAMILIES)
@pytest.mark.parametrize("kind", ["text", "one_image", "two_images"])
def test_logits_match_transformers(family_dirs, family, kind):
    gap, same_argmax = logits_gap(family, family_dirs[family], family_dirs[family], kind)
    assert gap <= 1e-4 and same_argmax


def logits_gap(family: str, our_dir, reference_dir, kind: str, mutate=None) -> tuple[float, bool]:
    """(largest |ours - transformers'| over the prompt and three decode steps, same argmax everywhere) for one
    conversation; ours read from `our_dir` (the reference's, or a copy with a rule broken) and `mutate`d (a rule
    broken in code: tests/test_config_fuzz.py). The prompts' token ids must be the same."""
    ours = our_logits(family, our_dir, kind, mutate)
    theirs = reference_logits(family, reference_dir, kind)
    return (ours - theirs).abs().max().item(), torch.equal(ours.argmax(-1), theirs.argmax(-1))


EXTRA = [5, 17, 9]  # decode steps after the prompt: positions continue by the model's rule


def our_logits(family: str, model_dir, kind: str, mutate=None) -> torch.Tensor:
    """Our model's fp32 logits over `kind`'s prompt and EXTRA; the prompt's token ids must be transformers'."""
    model, prompts = our_model_and_prompts(family, model_dir)
    if mutate is not None:
        mutate(model)
    messages, images = conversation(kind)
    prompt = prompts.process_chat(with_pil(messages, images))
    assert prompt.token_ids == reference_inputs(family, model_dir, messages, images)["input_ids"][0].tolist()
    return prompt_logits(model, prompt)


def our_model_and_prompts(family: str, model_dir):
    model, _ = load_model(model_dir, dtype="float32")
    template = llava_template(model_dir) if family == "llava" else None
    return model, PromptProcessor(model_dir, model.config, chat_template=template)


def prompt_logits(model, prompt) -> torch.Tensor:
    """Logits over a processed prompt and EXTRA, images and videos encoded, in one pass."""
    ids = prompt.token_ids + EXTRA
    positions = np.concatenate(
        [prompt.positions, decode_positions(len(prompt.token_ids), len(EXTRA), prompt.mrope_delta)], 1
    )
    with torch.no_grad():
        mm = None
        if prompt.images:  # one at a time: an image's patches hold one frame, a video's two
            pixels = [patchify(torch.from_numpy(im.pixels), model.config.image) for im in prompt.images]
            mm = torch.cat([model.encode_images(p, [im.grid_thw])[0] for p, im in zip(pixels, prompt.images)])
        spans = {0: image_runs(ids, model.config.image_token_id)} if model.config.bidirectional_images else None
        meta = AttentionMetadata.from_lengths([len(ids)], bidirectional_spans=spans)
        hidden = model(torch.tensor(ids), torch.from_numpy(positions), meta, mm)
        return model.compute_logits(hidden)


def image_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(first, end) of each run of `token`: an image's tokens, which see each other both ways (Gemma 3)."""
    starts = [i for i, t in enumerate(ids) if t == token and (i == 0 or ids[i - 1] != token)]
    return [(start, next((i for i in range(start, len(ids)) if ids[i] != token), len(ids))) for start in starts]


def reference_logits(family: str, model_dir, kind: str, dtype=torch.float32) -> torch.Tensor:
    return hf_logits(model_dir, reference_inputs(family, model_dir, *conversation(kind)), dtype)


def hf_logits(model_dir, inputs: dict, dtype=torch.float32) -> torch.Tensor:
    """transformers' logits over `inputs`' prompt and EXTRA, its model run in `dtype`."""
    inputs = dict(inputs, input_ids=torch.cat([inputs["input_ids"], torch.tensor([EXTRA])], 1))
    for name in ("mm_token_type_ids", "token_type_ids"):  # (Gemma 3's processor names them the latter)
        if name in inputs:
            inputs[name] = torch.nn.functional.pad(inputs[name], (0, len(EXTRA)))
    if "attention_mask" in inputs:
        inputs["attention_mask"] = torch.nn.functional.pad(inputs["attention_mask"], (0, len(EXTRA)), value=1)
    for name in ("pixel_values", "pixel_values_videos"):
        if name in inputs:
            inputs[name] = inputs[name].to(dtype)
    with torch.no_grad():
        return hf_model(model_dir, dtype)(**inputs).logits[0]


def hf_greedy(family, model_dir, messages, images) -> list[int]:
    return hf_generate(model_dir, reference_inputs(family, model_dir, messages, images))


def hf_generate(model_dir, inputs: dict) -> list[int]:
    with torch.no_grad():
        out = hf_model(model_dir).generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("family", PARITY_FAMILIES)
def test_engine_greedy_matches_transformers(family_dirs, family):
    """Budgets small enough that long prompts are prefilled in chunks, sequences are preempted, and repeated
    system prompts and images come from the prefix cache."""
    model_dir = family_dirs[family]
    system = "You are a careful assistant. Name colours precisely and count objects. " * 4
    cases = []
    for kind in ("text", "one_image", "two_images", "one_image", "two_images"):
        messages, images = conversation(kind)
        cases.append(([{"role": "system", "content": system}] + messages, images))
    cases.append(conversation("one_image"))  # the same image again: encoder cache and prefix cache
    per_image = 576 if family == "llava" else None
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=256,
        block_size=16,
        num_gpu_blocks_override={"llava": 120, "gemma3": 26, "internvl": 30}.get(family, 40),  # fewer tokens an image
        max_model_len={"llava": 1536, "gemma3": 336, "internvl": 480}.get(family, 640),
        encoder_cache_size=4 * 576,
    )
    # every image encoded first and kept in the encoder cache: how many sequences grow together (and so whether
    # they preempt) then no longer depends on how fast the vision tower's thread keeps up with the steps (a slow
    # machine ran them one after another, with no preemption)
    llm.chat(
        [with_pil(*conversation(kind)) for kind in ("one_image", "two_images")],
        SamplingParams(max_tokens=1),
        use_tqdm=False,
    )
    outputs = llm.chat(
        [with_pil(m, i) for m, i in cases],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    engine = llm.engine
    assert max(len(o.prompt_token_ids) for o in outputs) > engine.config.max_num_batched_tokens  # chunked
    assert engine.scheduler.num_preemptions > 0
    assert sum(o.num_cached_tokens > 0 for o in outputs) >= 2
    if per_image:
        assert outputs[1].prompt_token_ids.count(engine.config.model.image_token_id) == per_image
    for (messages, images), out in zip(cases, outputs):
        assert out.outputs[0].token_ids == hf_greedy(family, model_dir, messages, images), messages


def test_llava_encoder_buckets_per_image_count(family_dirs):
    """A fixed-size encoder's buckets count whole images: two images in a four-image bucket (two blank fillers,
    each its own attention segment) give the unpadded embeddings, and the engine's tokens do not change."""
    from fovea.config.engine import parse_buckets
    from fovea.runner.encoder_buckets import EncoderBuckets

    model_dir = family_dirs["llava"]
    model, _ = load_model(model_dir, dtype="float32")
    processor = PromptProcessor(model_dir, model.config).image_processor
    images = [processor(random_image(300, 200, seed=31)), processor(random_image(200, 300, seed=32))]
    pixels = torch.cat([patchify(torch.from_numpy(im.pixels), model.config.image) for im in images])
    grids = [im.grid_thw for im in images]
    with pytest.raises(ValueError, match="multiples of 576"):
        parse_buckets("576,1000", model.config.image.encoder_unit)
    buckets = EncoderBuckets(model.visual, [576, 2304], torch.float32, torch.device("cpu"), capture=False)
    assert buckets.bucket(1152) == 2304
    with torch.no_grad():
        torch.testing.assert_close(
            buckets.encode(pixels, grids, 2304), model.visual(pixels, grids), rtol=1e-5, atol=1e-5
        )
    # our Triton attention (on the GPU, or under its interpreter without one): the tile table padded to the
    # bucket's fixed size
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernel, _ = load_model(model_dir, dtype="float32", device=device, options=ModelOptions(vision_kernel=True))
    kernel_buckets = EncoderBuckets(kernel.visual, [1152], torch.float32, device, capture=False)
    with torch.no_grad():
        torch.testing.assert_close(
            kernel_buckets.encode(pixels[:576].to(device), grids[:1], 1152).cpu(),
            model.visual(pixels[:576], grids[:1]),
            rtol=1e-4,
            atol=1e-4,
        )
    messages, pictures = conversation("two_images")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = LLM(str(model_dir), dtype="float32", max_model_len=1536).chat(
        [with_pil(messages, pictures)], params, use_tqdm=False
    )
    llm = LLM(str(model_dir), dtype="float32", max_model_len=1536, mm_buckets=[576, 1152])
    assert llm.engine.runner.encoder_buckets.buckets == [576, 1152]
    bucketed = llm.chat([with_pil(messages, pictures)], params, use_tqdm=False)
    assert bucketed[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_llava_layouts_and_plan(family_dirs, tmp_path):
    """The llava-hf names and the transformers-5 ones (sharded) load to the same model; `fovea plan` sizes it with
    576 tokens for every image and no video rows."""
    from fovea.plan import format_plan, plan_memory
    from fovea.testing.tiny_llava import write_llava_checkpoint

    published = write_llava_checkpoint(tmp_path / "a", seed=7)
    tf5 = write_llava_checkpoint(tmp_path / "b", seed=7, layout="transformers5", shards=2)
    assert any(
        name.startswith("model.language_model.")
        for name in json.loads((tf5 / "model.safetensors.index.json").read_text())["weight_map"]
    )
    a, b = load_model(published, dtype="float32")[0], load_model(tf5, dtype="float32")[0]
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert len(a.visual.layers) == 2  # three CLIP layers, feature layer -2: the last one is not built
    plan = plan_memory(published, 80, max_model_len=4096)
    assert {tokens for _, _, tokens, _ in plan.images} == {576} and plan.videos == []
    assert "video" not in format_plan(plan, "tiny-llava")


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen2-vl", "llava"])
def test_what_installed_transformers_saves_loads(family_dirs, tiny_dirs, family, tmp_path):
    """Each family loads the checkpoint that the installed transformers' save_pretrained writes (its config and
    weight layout, whatever its version), to the same weights as the published layout and to transformers' logits;
    LLaVA also without `vision_model.` in its tower's keys (what transformers 5.23 wrote)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    source = tiny_dirs["tiny-3b"] if family == "qwen2.5-vl" else family_dirs[family]
    reference = AutoModelForImageTextToText.from_pretrained(
        str(source), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    saved = tmp_path / "saved"
    reference.save_pretrained(saved)
    for extra in source.iterdir():  # tokenizer and preprocessor files: save_pretrained writes the model only
        if not (saved / extra.name).exists() and not extra.name.endswith((".safetensors", ".json.index")):
            shutil.copy(extra, saved / extra.name)
    layouts = [saved]
    if family == "llava":
        stripped = tmp_path / "no-vision-model"
        shutil.copytree(saved, stripped)
        for shard in stripped.glob("*.safetensors"):
            save_file(
                {k.replace("vision_tower.vision_model.", "vision_tower."): v for k, v in load_file(shard).items()},
                shard,
                metadata={"format": "pt"},
            )
        layouts.append(stripped)
    published = load_model(source, dtype="float32")[0].state_dict()
    ids = torch.tensor([[9707, 11, 1879, 0, 151, 17, 4, 33]]) % reference.config.get_text_config().vocab_size
    with torch.no_grad():
        expected = reference(input_ids=ids).logits[0]
    for layout in layouts:
        ours = load_model(layout, dtype="float32")[0]
        assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), published.values())), layout
        with torch.no_grad():
            positions = torch.arange(ids.shape[1]).expand(3, -1)
            logits = ours.compute_logits(ours(ids[0], positions, AttentionMetadata.from_lengths([ids.shape[1]])))
        assert (logits - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", ["qwen2.5-vl", *FAMILIES])
def test_eos_token_id_as_null_int_list_or_missing(family_dirs, tiny_dirs, family, tmp_path):
    """config.json's eos_token_id at the top or under text_config, as an int, a list, null or left out (transformers
    5.24 writes a null): the ids given, else generation_config.json's, else the tokenizer's eos_token. A null once
    became (None,): the grammar engine refused to start and generation never stopped at EOS."""
    import shutil

    from fovea.config.model import ModelConfig

    source = tiny_dirs["tiny-3b"] if family == "qwen2.5-vl" else family_dirs[family]
    folder = tmp_path / family
    shutil.copytree(source, folder)
    raw = json.loads((source / "config.json").read_text())
    tokenizer_eos = {"llava": 2}.get(family, 151645)  # </s>, <|im_end|>
    generation = folder / "generation_config.json"
    saved = json.loads(generation.read_text()) if generation.is_file() else {}

    def resolved(value, where: str, generation_eos="absent") -> tuple[int, ...]:
        config = json.loads(json.dumps(raw))
        for part in (config, config.get("text_config") or {}):
            part.pop("eos_token_id", None)
        target = config.get("text_config") if where == "text_config" else config
        if value != "missing":
            target["eos_token_id"] = value
        (folder / "config.json").write_text(json.dumps(config))
        settings = {k: v for k, v in saved.items() if k != "eos_token_id"}
        if generation_eos != "absent":
            settings["eos_token_id"] = generation_eos
        generation.write_text(json.dumps(settings))
        return ModelConfig.from_dir(folder).eos_token_ids

    places = ["top"] + (["text_config"] if "text_config" in raw else [])
    for where in places:
        assert resolved(7, where) == (7,)
        assert resolved([7, 8], where) == (7, 8)
        for value in (None, "missing", []):
            assert resolved(value, where, generation_eos=[9, 10]) == (9, 10), (where, value)
            assert resolved(value, where, generation_eos=None) == (tokenizer_eos,), (where, value)
            assert resolved(value, where) == (tokenizer_eos,), (where, value)
    if "text_config" in raw:  # a null under text_config leaves the top level's value
        config = json.loads(json.dumps(raw))
        config["eos_token_id"], config["text_config"]["eos_token_id"] = 11, None
        (folder / "config.json").write_text(json.dumps(config))
        assert ModelConfig.from_dir(folder).eos_token_ids == (11,)
