"""The attention-backend registry (fovea/attention/__init__.py) and the features its interface expresses: the
PyTorch reference's sliding windows and bidirectional spans against attention written out densely, position by
position; a backend without a feature the model needs is refused by name."""

from __future__ import annotations

import pytest
import torch
from test_kernels import MIXED, ragged_batch, run

from fovea.attention import BACKENDS, features_needed, make_backend
from fovea.attention.backend import TorchAttention
from fovea.attention.layer import Attention
from fovea.config.flags import BY_NAME


def dense_reference(q, k_cache, meta, specs, window, spans, scale, sinks=None):
    """Each query against every key of its sequence that it may see, from the cache after the step's writes;
    `sinks`: each head's sink logit, an extra score whose value is 0 (GPT-OSS's eager attention)."""
    _, _, block_size, kv_heads, _ = k_cache.shape
    flat = k_cache.view(2, -1, kv_heads, k_cache.shape[-1])
    group = q.shape[1] // kv_heads
    out, row = torch.empty_like(q), 0
    for index, (cached, new) in enumerate(specs):
        length = cached + new
        slots = [int(meta.block_tables[index, p // block_size]) * block_size + p % block_size for p in range(length)]
        keys, values = flat[0][slots].repeat_interleave(group, 1), flat[1][slots].repeat_interleave(group, 1)
        for position in range(cached, length):
            allowed = torch.tensor(
                [
                    (
                        j <= position
                        or any(first <= position < end and first <= j < end for first, end in spans.get(index, []))
                    )
                    and (window is None or j > position - window)
                    for j in range(length)
                ],
                device=q.device,
            )
            scores = torch.einsum("hd,khd->hk", q[row], keys) * scale
            scores = scores.masked_fill(~allowed, float("-inf"))
            if sinks is not None:
                scores = torch.cat([scores, sinks[:, None]], 1)
            weights = scores.softmax(-1)[:, :length]
            out[row] = torch.einsum("hk,khd->hd", weights, values)
            row += 1
    return out


@pytest.mark.parametrize(
    "window, spans",
    [
        (None, {}),
        (4, {}),  # shorter than every chunk
        (40, {}),  # reaches into the cached prefix of the chunked sequences
        (None, {0: [(3, 11), (20, 30)], 3: [(18, 25)]}),  # image-like spans in a fresh prompt and in a later chunk
        # both at once: a sliding layer's image token sees its image's later tokens, and its earlier ones only
        # inside the window (transformers' Gemma 3: window AND (causal OR same image); tests/test_gemma3.py)
        (6, {0: [(3, 11)], 5: [(71, 75)]}),
    ],
)
@pytest.mark.parametrize("budget", [None, 2048, 24], ids=["one-group", "default", "groups-and-key-chunks"])
def test_reference_windows_and_bidirectional_spans(window, spans, budget):
    """`budget`: decode rows gathered all at once, in the default groups, or in groups of at most 24 keys (every
    decode alone, its context in chunks whose softmaxes are joined)."""
    specs = MIXED
    q, k, v, cache, make_meta = ragged_batch(specs, 4, 2, 16, 16, torch.float32)
    backend = TorchAttention(decode_group_tokens=budget)
    meta = make_meta(backend)
    meta.bidirectional_spans = spans
    written = cache.clone()
    backend.prepare(meta)
    got = backend.forward(q, k, v, written, meta, scale=0.25, window=window)
    expected = dense_reference(q, written, meta, specs, window, spans, scale=0.25)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    if window is None and not spans:  # the plain path agrees with the kernels' reference runs
        torch.testing.assert_close(got, run(TorchAttention(), q, k, v, cache, make_meta)[0])


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("budget", [None, 2048, 24], ids=["one-group", "default", "groups-and-key-chunks"])
def test_reference_attention_sinks(window, budget):
    """GPT-OSS's sinks, one logit per query head in every softmax's denominator: prompts, a chunk over a cached
    prefix and decodes (their contexts in one chunk or several) against the dense reference; large sinks take
    most of the weight, so they are there to see."""
    q, k, v, cache, make_meta = ragged_batch(MIXED, 4, 2, 16, 16, torch.float32)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    backend = TorchAttention(decode_group_tokens=budget)
    meta = make_meta(backend)
    written = cache.clone()
    backend.prepare(meta)
    got = backend.forward(q, k, v, written, meta, scale=0.25, window=window, sinks=sinks)
    expected = dense_reference(q, written, meta, MIXED, window, {}, scale=0.25, sinks=sinks)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    plain = dense_reference(q, written, meta, MIXED, window, {}, scale=0.25)
    assert (plain - expected).abs().max().item() > 0.1


@pytest.mark.parametrize("budget", [None, 24], ids=["one-group", "key-chunks"])
def test_reference_decodes_ignore_what_lies_past_a_sequences_end(budget):
    """A decode reads its sequence's blocks whole: the slots past its end (a freed sequence's leftovers, here inf
    and nan, as an overflowing fp16 model leaves) and block 0, which pads a shorter sequence's table, must not
    reach its output (0 x inf is nan)."""
    specs = MIXED
    q, k, v, cache, make_meta = ragged_batch(specs, 4, 2, 16, 16, torch.float32)
    backend = TorchAttention(decode_group_tokens=budget)
    meta = make_meta(backend)
    for index, (cached, new) in enumerate(specs):
        length = cached + new
        last = int(meta.block_tables[index, (length - 1) // 16])
        cache[:, last, length % 16 or 16 :] = torch.tensor([torch.inf, torch.nan]).view(2, 1, 1, 1)
    cache[:, 0] = torch.nan
    backend.prepare(meta)
    written = cache.clone()
    got = backend.forward(q, k, v, written, meta, scale=0.25)
    expected = dense_reference(q, written, meta, specs, None, {}, scale=0.25)
    assert got.isfinite().all()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_reference_decode_groups_are_sized_by_the_bytes_of_a_models_keys():
    """2 MiB of fp32 keys and values a group: 2048 keys of 2 KV heads x 64 (where benchmarks/cpu_attention.py
    measured the budget), 8192 of the demo model's 2 x 16; a backend built without a width keeps 2048."""
    cpu = torch.device("cpu")
    assert make_backend("torch", 2, False, cpu, kv_width=128).decode_group_tokens == 2048
    assert make_backend("torch", 2, False, cpu, kv_width=32).decode_group_tokens == 8192
    assert make_backend("torch", 2, False, cpu).decode_group_tokens == 2048


def test_registry_builds_by_name_and_refuses_missing_features(monkeypatch):
    """Both backends have every feature a model needs; a backend without one (registered here) is refused at
    start, naming the feature and the backends that have it."""
    import dataclasses

    assert set(BY_NAME["attention_backend"].choices) == {"auto", *BACKENDS}  # the flag offers what is registered
    assert isinstance(make_backend("torch", 2, False, torch.device("cpu"), needs=("sliding_window",)), TorchAttention)
    plain = dataclasses.replace(BACKENDS["torch"], sliding_window=False, bidirectional_spans=False)
    monkeypatch.setitem(BACKENDS, "plain", plain)
    with pytest.raises(
        ValueError,
        match="needs sliding_window attention, which the plain backend does not have; "
        r"backends that do: \['torch', 'triton'\]",
    ):
        make_backend("plain", 2, False, torch.device("cpu"), needs=("sliding_window",))
    with pytest.raises(ValueError, match="attention backend 'flash' is not one of torch, triton"):
        make_backend("flash", 2, False, torch.device("cpu"))
    assert BACKENDS["triton"].cuda_graphs and not BACKENDS["torch"].cuda_graphs


def test_a_model_with_sliding_window_layers_needs_a_backend_that_has_them(monkeypatch):
    import dataclasses

    from fovea.attention.triton_paged import TritonAttention

    plain = torch.nn.ModuleList([Attention(16, causal=True, layer_index=0), Attention(16, causal=False)])
    windowed = torch.nn.ModuleList(
        [Attention(16, causal=True, layer_index=0), Attention(16, causal=True, layer_index=1, sliding_window=512)]
    )
    assert features_needed(plain) == () and features_needed(windowed) == ("sliding_window",)
    assert isinstance(
        make_backend("triton", 2, False, torch.device("cpu"), needs=features_needed(windowed)), TritonAttention
    )
    monkeypatch.setitem(BACKENDS, "plain", dataclasses.replace(BACKENDS["triton"], sliding_window=False))
    with pytest.raises(ValueError, match="needs sliding_window attention"):
        make_backend("plain", 2, False, torch.device("cpu"), needs=features_needed(windowed))
    sinks = torch.nn.ModuleList([Attention(16, causal=True, layer_index=0, sink_heads=4)])
    assert features_needed(sinks) == ("attention_sinks",)
    monkeypatch.setitem(BACKENDS, "sinkless", dataclasses.replace(BACKENDS["torch"], attention_sinks=False))
    with pytest.raises(ValueError, match="needs attention_sinks attention"):
        make_backend("sinkless", 2, False, torch.device("cpu"), needs=features_needed(sinks))


def test_fp8_kv_cache_is_attention_over_fp8_rounded_keys_and_values():
    """A float8 cache holds value / scale in e4m3 and reads back stored x scale: attention over it equals the
    reference over keys and values rounded that way, the cached prefixes and the step's new tokens alike; and the
    rounding is there to see (the exact cache gives other outputs)."""
    fp8 = torch.float8_e4m3fn
    q, k, v, cache, make_meta = ragged_batch(MIXED, 4, 2, 16, 16, torch.float32)
    k_scale, v_scale = torch.tensor(0.5), torch.tensor(2.0)

    def rounded(x, scale):
        return (x / scale).to(fp8).float() * scale

    backend = TorchAttention()
    meta = make_meta(backend)
    backend.prepare(meta)
    stored = torch.stack([(cache[0] / k_scale).to(fp8), (cache[1] / v_scale).to(fp8)])
    got = backend.forward(q, k, v, stored, meta, scale=0.25, kv_scales=(k_scale, v_scale))
    assert stored.dtype == fp8
    reference = torch.stack([rounded(cache[0], k_scale), rounded(cache[1], v_scale)])
    expected = backend.forward(q, rounded(k, k_scale), rounded(v, v_scale), reference, meta, scale=0.25)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        stored.float() * torch.tensor([0.5, 2.0], device=stored.device).view(2, 1, 1, 1, 1), reference
    )
    exact = backend.forward(q, k, v, cache.clone(), meta, scale=0.25)
    assert (got - exact).abs().max().item() > 1e-3


def test_varlen_attention_keeps_segments_apart_back_to_back_or_not():
    """Segments of one length are attended together: back to back (a tower's windows) as views of the rows,
    apart (another length between them) gathered; either way each segment sees only itself."""
    from fovea.attention.layer import AttentionMetadata, varlen_attention

    lengths = [16, 16, 16, 5, 16, 9, 5]  # 16 back to back then apart; 5 apart
    generator = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(3, sum(lengths), 4, 8, generator=generator).unbind(0)
    meta = AttentionMetadata.from_lengths(lengths)
    got = varlen_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen, causal=False, scale=0.3)
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        alone = torch.nn.functional.scaled_dot_product_attention(
            *(x[rows].transpose(0, 1) for x in (q, k, v)), scale=0.3
        )
        torch.testing.assert_close(got[rows], alone.transpose(0, 1), atol=1e-6, rtol=1e-6)
        start += length
