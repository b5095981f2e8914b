"""The async core: concurrent streams, requests added while the engine runs, early exits abort and free."""

from __future__ import annotations

import asyncio
import time

import pytest

from conftest import random_image
from fovea import LLM, SamplingParams
from fovea.engine.async_engine import AsyncLLM
from fovea.engine.sampling_params import RequestOutputKind
from test_engine_vs_hf import LOREM, assert_engine_idle

OPTIONS = dict(dtype="float32", max_model_len=2048, num_gpu_blocks_override=300, max_num_batched_tokens=128)
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


def test_streams_run_concurrently_and_abort_on_early_exit(tiny_dirs):
    model = str(tiny_dirs["tiny-3b"])
    image_chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": random_image(300, 200, 40)},
                                               {"type": "text", "text": "What is it?"}]}]
    engine = AsyncLLM.from_args(model, **OPTIONS)

    async def collect(request_id, stop_after=None, **request):
        tokens, chunks, reason = [], 0, None
        async for out in engine.generate(sampling_params=PARAMS, request_id=request_id, **request):
            tokens += out.outputs[0].token_ids
            chunks += 1
            reason = out.outputs[0].finish_reason
            if stop_after and len(tokens) >= stop_after:
                break
        return tokens, chunks, reason

    async def main():
        first = asyncio.create_task(collect("a", prompt=LOREM * 3))
        await asyncio.sleep(0.2)  # the engine is busy with "a" when the others arrive
        leaving = asyncio.create_task(collect("b", stop_after=4, prompt=LOREM))
        third = asyncio.create_task(collect("c", messages=image_chat))
        with pytest.raises(ValueError, match="a prompt must be"):
            async for _ in engine.generate(prompt=123):
                pass
        return await asyncio.gather(first, leaving, third)

    try:
        (a, a_chunks, a_reason), (b, _, _), (c, _, c_reason) = asyncio.run(main())
        deadline = time.time() + 10
        while engine.engine.requests and time.time() < deadline:  # the abort of "b" is applied by the engine thread
            time.sleep(0.01)
        assert_engine_idle(engine.engine)
    finally:
        engine.shutdown()
    assert a_reason == c_reason == "length" and len(a) == len(c) == 20 and a_chunks > 1
    reference = LLM(model, **OPTIONS)
    greedy = PARAMS.clone(output_kind=RequestOutputKind.CUMULATIVE)
    assert a == reference.generate(LOREM * 3, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert b == reference.generate(LOREM, greedy, use_tqdm=False)[0].outputs[0].token_ids[:len(b)]
    assert c == reference.chat(image_chat, greedy, use_tqdm=False)[0].outputs[0].token_ids
