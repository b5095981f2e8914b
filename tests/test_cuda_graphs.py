"""Decode through the CUDA-graph static buffers: padded to a bucket, it must give the tokens an eager step gives.

Without a GPU the buffers and padding run eagerly (capture=False) with our Triton kernels under the interpreter;
on a GPU the graphs are captured and replayed.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import random_image  # noqa: E402

from fovea import LLM, SamplingParams  # noqa: E402
from fovea.runner.cuda_graphs import DecodeGraphs, graph_batch_sizes  # noqa: E402


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert graph_batch_sizes(1000)[-1] == 512


def test_padded_static_buffer_decode_gives_the_eager_tokens(tiny_dirs):
    """5 and 3 sequences decode in buckets of 6 and 4 (padding rows in both); image prompts carry an M-RoPE offset
    into decode positions, so positions that were not copied would change their tokens."""
    image = random_image(84, 56, seed=3)
    conversations = [
        [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "What?"}]}],
        [{"role": "user", "content": "Tell me a story about a boat."}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_pil", "image_pil": random_image(56, 112, seed=4)},
                    {"type": "text", "text": "Describe it in detail please."},
                ],
            }
        ],
        [{"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "A longer question about the sea, the wind and the stars at night?"}],
    ]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    options = dict(dtype="float32", max_model_len=256, max_num_seqs=6, block_size=16, attention_backend="triton")

    eager = LLM(str(tiny_dirs["tiny-7b"]), enforce_eager=True, **options)
    assert eager.engine.runner.graphs is None  # no GPU, or --enforce-eager
    expected = [
        [o.outputs[0].token_ids for o in eager.chat(batch, params, use_tqdm=False)]
        for batch in (conversations, conversations[:3])
    ]

    llm = LLM(str(tiny_dirs["tiny-7b"]), **options)
    runner = llm.engine.runner
    runner.graphs = graphs = DecodeGraphs(
        runner.model, runner.backend, 6, 256, 16, runner.kv_caches, runner.device, capture=torch.cuda.is_available()
    )
    buckets = []
    run = graphs.run
    graphs.run = lambda ids, positions, meta: buckets.append(graphs.bucket(ids.numel())) or run(ids, positions, meta)
    got = [
        [o.outputs[0].token_ids for o in llm.chat(batch, params, use_tqdm=False)]
        for batch in (conversations, conversations[:3])
    ]
    assert {6, 4} <= set(buckets)  # both batches decoded through padded buffers
    assert got == expected
