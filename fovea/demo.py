"""Offline demo: one chat turn with an image through the engine, greedy, printed as it is generated."""

from __future__ import annotations

import time

import numpy as np
from PIL import Image


def demo_image(width: int = 448, height: int = 336) -> Image.Image:
    """A synthetic picture (colour gradients and a square), so the demo needs no file or network."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)], axis=-1)
    rgb[height // 4 : height // 2, width // 4 : width // 2] = (230, 40, 40)
    return Image.fromarray(rgb.astype(np.uint8))


def run_demo(model: str | None, image: str | None, prompt: str, max_tokens: int, dtype: str) -> None:
    from fovea.config.engine import EngineConfig
    from fovea.core.sampling_params import RequestOutputKind, SamplingParams
    from fovea.engine.engine import LLMEngine
    from fovea.frontend.input_processor import InputProcessor
    from fovea.frontend.outputs import OutputAssembler
    from fovea.multimodal.prompt import load_tokenizer

    config = EngineConfig.from_args(model, dtype=dtype, max_model_len=4096)
    engine = LLMEngine(config, tokenizer=load_tokenizer(config.model_dir), assembler=OutputAssembler)
    inputs = InputProcessor(engine.config, tokenizer=engine.tokenizer, grammars=engine.grammars)
    picture = (
        {"type": "image_pil", "image_pil": demo_image()}
        if image is None
        else {"type": "image_url", "image_url": {"url": image}}
    )
    messages = [{"role": "user", "content": [picture, {"type": "text", "text": prompt}]}]
    processed = inputs.process_chat(messages)
    grid = processed.images[0].grid_thw
    print(
        f"model: {engine.config.model_dir}\nprompt: {len(processed.token_ids)} tokens, image grid {grid} -> "
        f"{processed.images[0].num_tokens} image tokens\n--- output ---",
        flush=True,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)
    engine.add_request(inputs.make_request("demo", processed, params))
    start, count = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            print(output.outputs[0].text, end="", flush=True)
            count += len(output.outputs[0].token_ids)
    print(f"\n--- {count} tokens in {time.perf_counter() - start:.2f} s ---")
