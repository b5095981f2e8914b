"""Our Qwen2.5-VL against transformers' on the same tiny fp32 checkpoints: prompt ids, pixels, logits, greedy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import hf_inputs, hf_model, image_patches, our_model, random_image

from fovea.attention.layer import AttentionMetadata
from fovea.models.mrope_positions import decode_positions

EOS = [151645, 151643]


@torch.inference_mode()
def generate_greedy(model, prompt, max_new_tokens: int, stop_token_ids: tuple[int, ...] = ()) -> list[int]:
    """The plainest correct greedy loop over the model's varlen forward (no KV cache: the whole sequence is
    recomputed every step); the engine's paged path is checked against transformers separately."""
    device = model.lm_head.weight.device
    mm_embeds = None
    if prompt.images:
        pixels = image_patches(prompt.images).to(device)
        mm_embeds = torch.cat(model.encode_images(pixels, [im.grid_thw for im in prompt.images]))
    tokens = list(prompt.token_ids)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        extra = decode_positions(len(prompt.token_ids), len(generated), prompt.mrope_delta)
        positions = torch.from_numpy(np.concatenate([prompt.positions, extra], axis=1)).to(device)
        ids = torch.tensor(tokens, device=device)
        hidden = model(ids, positions, AttentionMetadata.from_lengths([len(tokens)], device), mm_embeds)
        next_token = int(model.compute_logits(hidden[-1:]).argmax(-1))
        generated.append(next_token)
        tokens.append(next_token)
        if next_token in stop_token_ids:
            break
    return generated


def case(name):
    """(messages as HF's template sees them, images, max_pixels override)."""
    text = {"type": "text", "text": "Describe what you see, then count the colours."}
    if name == "text":
        return (
            [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Write a haiku about the sea, please."},
            ],
            [],
            None,
        )
    if name == "one_image":
        return [{"role": "user", "content": [{"type": "image"}, text]}], [random_image(640, 480, 1)], None
    if name == "two_images":
        content = [{"type": "image"}, {"type": "text", "text": "and then"}, {"type": "image"}, text]
        return [{"role": "user", "content": content}], [random_image(224, 168, 2), random_image(300, 420, 3)], None
    if name == "odd_size":
        return [{"role": "user", "content": [text, {"type": "image"}]}], [random_image(333, 517, 4)], None
    if name == "above_max_pixels":
        return [{"role": "user", "content": [{"type": "image"}, text]}], [random_image(900, 700, 5)], 200_000
    if name == "multi_turn":
        return (
            [
                {"role": "user", "content": [{"type": "image"}, text]},
                {"role": "assistant", "content": "A red square."},
                {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image"}]},
            ],
            [random_image(168, 224, 6), random_image(280, 280, 7)],
            None,
        )
    raise KeyError(name)


def our_messages(messages, images):
    """The same conversation with OpenAI-style parts carrying the PIL images, as users pass them to fovea."""
    it = iter(images)
    out = []
    for m in messages:
        if isinstance(m["content"], str):
            out.append(m)
            continue
        parts = [{"type": "image_pil", "image_pil": next(it)} if p["type"] == "image" else p for p in m["content"]]
        out.append({**m, "content": parts})
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def our_logits(model, prompt, extra_tokens=()):
    """Logits of every position of prompt + extra_tokens (the extra ones placed as decode steps)."""
    ids = list(prompt.token_ids) + list(extra_tokens)
    positions = np.concatenate(
        [prompt.positions, decode_positions(len(prompt.token_ids), len(extra_tokens), prompt.mrope_delta)], 1
    )
    mm = None
    if prompt.images:
        mm = torch.cat(model.encode_images(image_patches(prompt.images), [im.grid_thw for im in prompt.images]))
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.from_numpy(positions), AttentionMetadata.from_lengths([len(ids)]), mm)
        return model.compute_logits(hidden)


CASES = ["text", "one_image", "two_images", "odd_size", "above_max_pixels", "multi_turn"]


@pytest.mark.parametrize("config", ["tiny-3b", "tiny-7b"])
@pytest.mark.parametrize("name", CASES)
def test_logits_and_greedy_match_transformers(tiny_dirs, config, name):
    model_dir = tiny_dirs[config]
    messages, images, max_pixels = case(name)
    ref_inputs = hf_inputs(model_dir, messages, images, max_pixels)
    model, processor = our_model(model_dir)
    prompt = processor.process_chat(our_messages(messages, images), {"max_pixels": max_pixels} if max_pixels else None)

    # the prompt we build equals the reference's, token for token and pixel for pixel
    assert prompt.token_ids == ref_inputs["input_ids"][0].tolist()
    if images:
        # bit for bit: uint8 pixels patchified as the engine does, in transformers' two-frame layout
        assert torch.equal(image_patches(prompt.images, frames=2), ref_inputs["pixel_values"])
        assert [list(im.grid_thw) for im in prompt.images] == ref_inputs["image_grid_thw"].tolist()

    hf = hf_model(model_dir)
    with torch.no_grad():
        ref_logits = hf(**ref_inputs).logits[0]
    logits = our_logits(model, prompt)
    assert rel_err(logits, ref_logits) <= 1e-4

    with torch.no_grad():
        ref = hf.generate(**ref_inputs, max_new_tokens=20, output_logits=True, return_dict_in_generate=True)
    ref_tokens = ref.sequences[0, ref_inputs["input_ids"].shape[1] :].tolist()
    ours = generate_greedy(model, prompt, 20, tuple(EOS))
    assert ours == ref_tokens
    # decode-step logits too: catches wrong decode positions even when a random model repeats itself
    step_logits = our_logits(model, prompt, ours[:-1])[len(prompt.token_ids) - 1 :]
    assert rel_err(step_logits, torch.cat(ref.logits)) <= 1e-4


@pytest.mark.parametrize("config", ["tiny-3b", "tiny-7b"])
def test_flattened_varlen_batch_equals_each_prompt_alone(tiny_dirs, config):
    """Several prompts concatenated in one forward (cu_seqlens, (3, N) positions, images encoded together)
    give each prompt the logits it gets alone; those are the ones checked against transformers above."""
    model, processor = our_model(tiny_dirs[config])
    prompts = [processor.process_chat(our_messages(*case(name)[:2])) for name in ("one_image", "text", "two_images")]
    solo = [our_logits(model, p) for p in prompts]
    images = [im for p in prompts for im in p.images]
    mm = torch.cat(model.encode_images(image_patches(images), [im.grid_thw for im in images]))
    ids = torch.tensor([t for p in prompts for t in p.token_ids])
    positions = torch.from_numpy(np.concatenate([p.positions for p in prompts], axis=1))
    meta = AttentionMetadata.from_lengths([len(p.token_ids) for p in prompts])
    with torch.no_grad():
        batched = model.compute_logits(model(ids, positions, meta, mm))
    for rows, alone in zip(batched.split([len(p.token_ids) for p in prompts]), solo):
        assert rel_err(rows, alone) <= 1e-5


@pytest.mark.parametrize("config", ["tiny-3b", "tiny-7b"])
def test_one_frame_embeds_like_two_identical_frames(tiny_dirs, config):
    """A still image crosses as one frame and meets the conv's two temporal halves summed; the checkpoint's
    two-frame input gives the same embeddings (in fp32 up to rounding)."""
    model, processor = our_model(tiny_dirs[config])
    images = processor.process_chat(our_messages(*case("two_images")[:2])).images
    grids = [im.grid_thw for im in images]
    one, two = image_patches(images), image_patches(images, frames=2)
    assert two.shape[1] == 2 * one.shape[1]
    with torch.no_grad():
        assert rel_err(model.visual(one, grids), model.visual(two, grids)) <= 1e-6
