"""Our Triton paged-attention backend against the PyTorch reference backend, on random ragged batches.

Without a GPU the kernels run under Triton's interpreter (set before triton is imported); on a GPU the same tests
run the compiled kernels.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fovea.attention.backend import PagedAttentionMetadata, TorchAttention  # noqa: E402
from fovea.attention.triton_paged import TritonAttention, _tiles, span_limits  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def ragged_batch(specs, q_heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """specs: (cached tokens, new tokens) per sequence. Blocks are handed out in a shuffled order, so every
    block table jumps around the cache (holes between a sequence's blocks), and rows are padded with block 0."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [cached + new for cached, new in specs]
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 5
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(specs), max(blocks_needed) + 1, dtype=torch.int32)
    slots = []
    for i, ((cached, new), need) in enumerate(zip(specs, blocks_needed)):
        tables[i, :need] = torch.tensor([order.pop() for _ in range(need)], dtype=torch.int32)
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(cached, cached + new)]
    query_lens = [new for _, new in specs]
    starts = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    n = sum(query_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    cache = rand(2, num_blocks, block_size, kv_heads, head_dim)  # the cached prefixes hold random K/V
    q, k, v = rand(n, q_heads, head_dim), rand(n, kv_heads, head_dim), rand(n, kv_heads, head_dim)

    def meta(backend):
        return PagedAttentionMetadata(
            backend,
            torch.tensor(slots, dtype=torch.int64, device=DEVICE),
            starts.to(DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            tables.to(DEVICE),
            max(query_lens),
            max(seq_lens),
            block_size,
        )

    return q, k, v, cache, meta


def run(backend, q, k, v, cache, meta):
    cache = cache.clone()
    m = meta(backend)
    backend.prepare(m)
    return backend.forward(q, k, v, cache, m, scale=q.shape[-1] ** -0.5), cache


MIXED = [(0, 37), (20, 1), (45, 1), (16, 17), (0, 1), (70, 5)]  # prefill, decode, chunk over a cached prefix


@pytest.mark.parametrize(
    "q_heads, kv_heads, head_dim, block_size",
    [
        (4, 2, 16, 16),  # like tiny-3b
        (4, 1, 24, 32),  # like tiny-7b: head_dim not a power of two
        (14, 2, 32, 16),  # 7 query heads per KV head, as in Qwen2.5-VL-7B
        (8, 8, 16, 48),  # no GQA; block_size a multiple of 16 but not a power of two
    ],
)
def test_triton_attention_matches_reference_fp32(q_heads, kv_heads, head_dim, block_size):
    q, k, v, cache, meta = ragged_batch(MIXED, q_heads, kv_heads, head_dim, block_size, torch.float32)
    expected, expected_cache = run(TorchAttention(), q, k, v, cache, meta)
    got, got_cache = run(TritonAttention(), q, k, v, cache, meta)
    torch.testing.assert_close(got_cache, expected_cache, rtol=0, atol=0)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "specs", [[(30, 1), (0, 1), (63, 1), (5, 1)], [(0, 50)], [(33, 31), (0, 2)]], ids=["decode", "prefill", "chunked"]
)
def test_triton_attention_bf16_within_bf16_tolerance(specs):
    q, k, v, cache, meta = ragged_batch(specs, 4, 2, 32, 16, torch.bfloat16, seed=1)
    expected, _ = run(TorchAttention(), q.float(), k.float(), v.float(), cache.float(), meta)
    got, got_cache = run(TritonAttention(), q, k, v, cache, meta)
    assert got.dtype == torch.bfloat16 and got_cache.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("programs", [1, 12, 200])
def test_decode_splits_the_context_and_combines_exactly(dtype, tol, programs):
    """Decode-only steps take the split-context kernel: 1 split (written directly), a few, and more splits than a
    short sequence has tiles (empty splits must not count); contexts cross block and tile edges; 7 query heads per
    KV head as in Qwen2.5-VL-7B."""
    from fovea.attention.triton_paged import decode_splits

    specs = [(300, 1), (15, 1), (64, 1), (129, 1), (0, 1)]
    q, k, v, cache, meta = ragged_batch(specs, 14, 2, 32, 16, dtype, seed=programs)
    splits = decode_splits(len(specs), 2, 301, 16, programs)
    assert splits == {1: 1, 12: 2, 200: 19}[programs]
    expected, expected_cache = run(TorchAttention(), q.float(), k.float(), v.float(), cache.float(), meta)
    got, got_cache = run(TritonAttention(group=7, decode_block_n=16, decode_programs=programs), q, k, v, cache, meta)
    assert got.dtype == dtype
    torch.testing.assert_close(got_cache.float(), expected_cache, rtol=0, atol=0)
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "specs, programs", [(MIXED, 8), ([(300, 1), (15, 1), (129, 1)], 12)], ids=["mixed", "decode-splits"]
)
def test_fp8_kv_cache_matches_the_reference(specs, programs):
    """A float8 e4m3 cache (--kv-cache-dtype fp8) with per-layer k and v scales: the same bytes stored and the same
    attention as the PyTorch reference, prompt chunks and split decodes alike."""
    fp8 = torch.float8_e4m3fn
    q, k, v, cache, meta = ragged_batch(specs, 14, 2, 32, 16, torch.float32, seed=3)
    scales = (torch.tensor(0.5, device=DEVICE), torch.tensor(1.5, device=DEVICE))
    stored = torch.stack([(cache[0] / scales[0]).to(fp8), (cache[1] / scales[1]).to(fp8)])

    def attend(backend):
        written = stored.clone()
        m = meta(backend)
        backend.prepare(m)
        return backend.forward(q, k, v, written, m, scale=32**-0.5, kv_scales=scales), written

    expected, expected_cache = attend(TorchAttention())
    got, got_cache = attend(TritonAttention(group=7, decode_block_n=16, decode_programs=programs))
    assert got_cache.dtype == fp8 and torch.equal(got_cache.view(torch.uint8), expected_cache.view(torch.uint8))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    exact, _ = run(TorchAttention(), q, k, v, cache, meta)
    assert (got - exact).abs().max().item() > 1e-3  # the cache's rounding is there to see


# (first, end) positions of each sequence's bidirectional spans, inside its new tokens (MIXED's sequences 0, 3, 5)
MIXED_SPANS = {0: [(5, 20), (24, 30)], 3: [(18, 30)], 5: [(71, 74)]}


@pytest.mark.parametrize("window", [None, 1, 5, 16, 40])
@pytest.mark.parametrize("spans", [False, True], ids=["causal", "spans"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_windows_and_bidirectional_spans_match_the_reference(window, spans, dtype, tol):
    """Sliding windows (one key: a query sees itself; shorter and longer than a tile of keys) and image spans
    whose tokens see their later tokens too (Gemma 3's rule: window AND (causal OR same span)), in a step with
    prompts, a chunk over a cached prefix and decode rows; then a decode-only step whose context splits."""
    q, k, v, cache, meta = ragged_batch(MIXED, 4, 2, 32, 16, dtype, seed=4)

    def attend(backend, batch, q, k, v, cache, named_spans):
        written = cache.clone()
        m = batch(backend)
        m.bidirectional_spans = named_spans
        backend.prepare(m)
        return backend.forward(q, k, v, written, m, scale=32**-0.5, window=window)

    named = MIXED_SPANS if spans else {}
    expected = attend(TorchAttention(), meta, q.float(), k.float(), v.float(), cache.float(), named)
    got = attend(TritonAttention(block_n=16), meta, q, k, v, cache, named)
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)
    if spans:  # the spans change what a query sees
        plain = attend(TorchAttention(), meta, q.float(), k.float(), v.float(), cache.float(), {})
        assert (plain - expected).abs().max().item() > 1e-2
        return  # the decode-only step below has no spans: checked once per window and dtype, in the causal case
    decodes = [(300, 1), (15, 1), (64, 1), (129, 1), (0, 1)]
    q, k, v, cache, meta = ragged_batch(decodes, 4, 2, 32, 16, dtype, seed=5)
    expected = attend(TorchAttention(), meta, q.float(), k.float(), v.float(), cache.float(), {})
    for programs in (1, 40):
        backend = TritonAttention(group=2, decode_block_n=16, decode_programs=programs)
        got = attend(backend, meta, q, k, v, cache, {})
        torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_attention_sinks_match_the_reference(window, dtype, tol):
    """GPT-OSS's sink logits (one per query head, in every softmax's denominator) in the prefill kernel, in a
    decode that runs in one program per sequence and head, and in one whose context splits (the combine adds
    them); large ones, that take most of the weight, and one below every score."""
    sinks = torch.tensor([-30.0, 0.5, 3.0, 8.0], device=DEVICE)

    def attend(backend, batch, q, k, v, cache, sinks):
        m = batch(backend)
        backend.prepare(m)
        return backend.forward(q, k, v, cache.clone(), m, scale=32**-0.5, window=window, sinks=sinks)

    for specs, programs in ((MIXED, 8), ([(300, 1), (15, 1), (64, 1), (0, 1)], 1), ([(300, 1), (129, 1)], 40)):
        q, k, v, cache, meta = ragged_batch(specs, 4, 2, 32, 16, dtype, seed=6)
        expected = attend(TorchAttention(), meta, q.float(), k.float(), v.float(), cache.float(), sinks)
        backend = TritonAttention(group=2, block_n=16, decode_block_n=16, decode_programs=programs)
        got = attend(backend, meta, q, k, v, cache, sinks.to(dtype))
        torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)
        plain = attend(TorchAttention(), meta, q.float(), k.float(), v.float(), cache.float(), None)
        assert (plain - expected).abs().max().item() > 0.1


def test_a_steps_prefill_plans_are_built_without_reading_the_device():
    """The tiles' count is the prefill kernel's grid, and the spans' limits are one per new token: both are planned
    from what the host knows (the step's query starts, its slot count). Read off a GPU, the host would wait for
    all the work queued before the step (py-spy, random-mm on an H200: 15 % of the engine's thread). Here the
    step's tensors are on PyTorch's meta device, which holds no values: reading one raises."""
    import numpy as np

    starts = np.array([0, 1, 70, 200, 201], dtype=np.int32)  # a decode row, two prefill chunks, a decode row
    on_meta = lambda *shape, dtype=torch.int32: torch.empty(shape, dtype=dtype, device="meta")  # noqa: E731
    meta = PagedAttentionMetadata(
        TorchAttention(),
        on_meta(201, dtype=torch.int64),
        on_meta(5),
        on_meta(4),
        on_meta(4, 16),
        130,
        400,
        16,
        bidirectional_spans={2: [(10, 20)]},
        query_starts_host=starts,
    )
    tile_seq, tile_first = _tiles(meta, 32)  # tiles of 1, 69, 130 and 1 new tokens: 1, 3, 5 and 1
    assert tile_seq.tolist() == [0, 1, 1, 1, 2, 2, 2, 2, 2, 3]
    assert tile_first.tolist() == [0, 0, 32, 64, 0, 32, 64, 96, 128, 0]
    assert span_limits(meta).shape == (201,)
    with pytest.raises(Exception):  # the check can fail: the device's copy is what it would otherwise read
        _tiles(dataclasses.replace(meta, query_starts_host=None), 32)


def test_padding_slots_are_not_written():
    q, k, v, cache, meta = ragged_batch([(0, 3)], 2, 1, 16, 16, torch.float32)
    m = meta(TritonAttention())
    padded = int(m.slot_mapping[1])
    m.slot_mapping[1] = -1  # a CUDA-graph batch pads with such tokens
    written = cache.clone()
    TritonAttention().forward(q, k, v, written, m, scale=0.25)
    flat = written.view(2, -1, 1, 16)
    assert torch.equal(flat[0, int(m.slot_mapping[0])], k[0]) and torch.equal(flat[1, int(m.slot_mapping[2])], v[2])
    changed_slots = (written != cache).view(2, -1, 16).any(-1)  # (K or V, slot)
    assert changed_slots.sum() == 4 and not changed_slots[:, padded].any()  # tokens 0 and 2 only


def test_engine_with_triton_backend_generates_the_reference_tokens(tiny_dirs):
    """Whole engine: prefill, chunked prefill (small token budget), prefix-cache hits and decode, text and image
    prompts, GQA (tiny-3b) and one KV head (tiny-7b, head_dim 24)."""
    from conftest import random_image

    from fovea import LLM, SamplingParams

    image = random_image(84, 56, seed=3)
    conversations = [
        [{"role": "user", "content": "Tell me a story about a boat."}],
        [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "What?"}]}],
        [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "Why?"}]}],
    ]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for name in ("tiny-3b", "tiny-7b"):
        outputs = {}
        for backend in ("torch", "triton"):
            llm = LLM(
                str(tiny_dirs[name]),
                dtype="float32",
                max_model_len=512,
                max_num_batched_tokens=32,
                attention_backend=backend,
                block_size=16,
            )
            expected_type = TorchAttention if backend == "torch" else TritonAttention
            assert type(llm.engine.runner.backend) is expected_type
            outputs[backend] = [o.outputs[0].token_ids for o in llm.chat(conversations, params, use_tqdm=False)]
        assert outputs["triton"] == outputs["torch"], name


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_vision_varlen_kernel_matches_reference(dtype, tol):
    """Windows of 64, a ragged edge window, a 4-patch segment and a whole image longer than one tile; q/k/v are
    strided views of one qkv tensor as in the model; the tile table has unused zero-length rows."""
    from fovea.attention.layer import AttentionMetadata, varlen_attention
    from fovea.attention.triton_varlen import tile_table, varlen_attention_triton

    lengths = [64, 64, 36, 4, 140]
    n, heads, head_dim = sum(lengths), 3, 20
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(n, 3, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.unbind(1)
    meta = AttentionMetadata.from_lengths(lengths, DEVICE)
    expected = varlen_attention(
        q.float(), k.float(), v.float(), meta.cu_seqlens, meta.max_seqlen, causal=False, scale=0.3
    )
    tiles = tile_table(lengths, 12).to(DEVICE)
    assert int((tiles[:, 1] > 0).sum()) == 7  # one tile each, 3 for the 140; 5 rows left empty
    got = varlen_attention_triton(q, k, v, tiles, scale=0.3)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="do not fit"):
        tile_table(lengths, 6)


def test_the_reference_builds_no_queries_by_keys_mask(monkeypatch):
    """Decode rows are two matmuls per group with a (sequences x keys) mask of padding, no SDPA; prefill chunks
    run alone through SDPA, causal (lower-right over a cached prefix: PyTorch's bias on a GPU, one sequence's mask
    on the CPU): no (queries x keys) mask for a batch."""
    import types

    import torch.nn.functional as F
    from torch.nn.attention.bias import CausalBias

    import fovea.attention.backend as reference

    masks = []

    def spy(*args, **kwargs):
        masks.append(kwargs.get("attn_mask"))
        return F.scaled_dot_product_attention(*args, **kwargs)

    monkeypatch.setattr(reference, "F", types.SimpleNamespace(scaled_dot_product_attention=spy))
    batch = ragged_batch(MIXED, 4, 2, 16, 16, torch.float32)
    run(TorchAttention(device=DEVICE), *batch)
    assert len(masks) == 3  # each of the three prefill chunks
    chunk_over_prefix = [
        mask for mask in masks if mask is not None and (isinstance(mask, CausalBias) or mask.shape[-2] > 1)
    ]
    assert len(chunk_over_prefix) == 2  # 17 tokens over 16 cached, 5 over 70; the 37-token prefill needs none
    for mask in masks:
        assert mask is None or isinstance(mask, CausalBias) or mask.dim() == 2, mask.shape
    assert all(isinstance(mask, CausalBias) for mask in chunk_over_prefix) == (DEVICE == "cuda")
