"""Offline demo: one chat turn with an image through the model, greedy, printed as it is generated.

`generate_greedy` is a deliberately plain loop (the whole sequence is recomputed every step, no KV cache): it is
the simplest correct use of the model's varlen forward and serves as a reference until the engine arrives.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from PIL import Image

from fovea.layers.attention import AttentionMetadata
from fovea.models.mrope_positions import decode_positions
from fovea.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from fovea.multimodal.prompt import ProcessedPrompt


@torch.inference_mode()
def generate_greedy(model: Qwen2_5_VLForConditionalGeneration, prompt: ProcessedPrompt, max_new_tokens: int,
                    stop_token_ids: tuple[int, ...] = ()) -> list[int]:
    device = model.lm_head.weight.device
    mm_embeds = None
    if prompt.images:
        pixels = torch.from_numpy(np.concatenate([im.pixel_values for im in prompt.images])).to(device)
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


def demo_image(width: int = 448, height: int = 336) -> Image.Image:
    """A synthetic picture (colour gradients and a square), so the demo needs no file or network."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)], axis=-1)
    rgb[height // 4: height // 2, width // 4: width // 2] = (230, 40, 40)
    return Image.fromarray(rgb.astype(np.uint8))


def run_demo(model: str | None, image: str | None, prompt: str, max_tokens: int, dtype: str) -> None:
    from fovea.models.loader import load_model
    from fovea.multimodal.prompt import PromptProcessor

    net, model_dir = load_model(model, dtype=dtype)
    processor = PromptProcessor(model_dir, net.config)
    picture = ({"type": "image_pil", "image_pil": demo_image()} if image is None
               else {"type": "image_url", "image_url": {"url": image}})
    messages = [{"role": "user", "content": [picture, {"type": "text", "text": prompt}]}]
    processed = processor.process_chat(messages)
    grid = processed.images[0].grid_thw
    print(f"model: {model_dir}\nprompt: {len(processed.token_ids)} tokens, image grid {grid} -> "
          f"{processed.images[0].num_tokens} image tokens\n--- output ---", flush=True)
    start = time.perf_counter()
    out = generate_greedy(net, processed, max_tokens, net.config.eos_token_ids)
    elapsed = time.perf_counter() - start
    print(processor.tokenizer.decode(out, skip_special_tokens=True))
    print(f"--- {len(out)} tokens in {elapsed:.2f} s ---")
