"""`fovea bench kernels`: attention kernels side by side, each against the limit of the unit it is bound by.

Decode (batch x context, one query token per sequence) reads the KV cache once: achieved bytes/s against the copy
bandwidth measured in the same run. Prefill (one 8k-token causal prompt) is compute-bound: achieved TFLOP/s
against the measured bf16 matmul rate. The vision tower's attention (a 1280x720 image: 4784 patches, 64-patch
windows and whole-image layers, head_dim 80) likewise. Shapes are Qwen2.5-VL-7B's (28 query heads, 4 KV heads,
head_dim 128, blocks of 16). Implementations: ours (Triton; decode launch settings swept), FlashInfer where it
imports (its kernels compile on first use), PyTorch's SDPA backends (prefill and vision). Timings are medians of
CUDA-event-timed runs (triton.testing.do_bench); without a GPU (--quick) tiny sizes run under the interpreter, to
check this script only.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from fovea.attention.backend import PagedAttentionMetadata

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 28, 4, 128, 16
DECODE_CASES = [(b, c) for b in (1, 16, 64, 256) for c in (1024, 8192, 32768)]
DECODE_SWEEP = [(16, 8192), (256, 1024), (1, 32768)]  # where the launch settings are swept
DECODE_CONFIGS = [(n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]  # block_n, warps, stages


def timed_ms(fn) -> float:
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure_rates(quick: bool) -> dict:
    """bf16 matmul TFLOP/s (8192^3, random data) and device-to-device copy TB/s (bytes read + written)."""
    rates = _rates(quick)
    if torch.cuda.is_available():  # ~13 GB stay cached otherwise: an engine started next (a server) finds them taken
        torch.cuda.empty_cache()
    return rates


def _rates(quick: bool) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = 512 if quick else 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    src = torch.randn(((64 if quick else 4096) << 20) // 2, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    return {
        "matmul_tflops": 2 * n**3 / timed_ms(lambda: a @ b) / 1e9,
        "copy_tb_s": 2 * src.numel() * 2 / timed_ms(lambda: dst.copy_(src)) / 1e9,
    }


def paged_decode_inputs(batch: int, context: int, device: str, dtype=torch.bfloat16):
    """A KV cache of one layer holding `context` tokens per sequence in scattered blocks, and the step metadata."""
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    tables = (torch.randperm(num_blocks - 1, device=device)[: batch * blocks_per_seq] + 1).to(torch.int32)
    tables = tables.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    last = context - 1
    slots = tables[:, last // BLOCK].long() * BLOCK + last % BLOCK  # the new token is the context's last
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=device, dtype=dtype)
    k, v = (torch.randn(batch, KV_HEADS, HEAD_DIM, device=device, dtype=dtype) for _ in range(2))

    def meta(backend):
        return PagedAttentionMetadata(
            backend,
            slots,
            torch.arange(batch + 1, dtype=torch.int32, device=device),
            seq_lens,
            tables,
            1,
            context,
            BLOCK,
            [cache],
        )

    return q, k, v, cache, meta


def ours_decode(config=(64, None, None)):
    from fovea.attention.triton_paged import TritonAttention

    block_n, warps, stages = config
    return TritonAttention(group=Q_HEADS // KV_HEADS, decode_block_n=block_n, decode_warps=warps, decode_stages=stages)


def flashinfer_decode(q, cache, meta_fn):
    import flashinfer

    meta = meta_fn(None)
    batch, blocks = meta.block_tables.shape
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * blocks
    last_page = ((meta.seq_lens - 1) % BLOCK + 1).to(torch.int32)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    wrapper.plan(
        indptr,
        meta.block_tables.flatten(),
        last_page,
        Q_HEADS,
        KV_HEADS,
        HEAD_DIM,
        BLOCK,
        q_data_type=q.dtype,
        kv_data_type=cache.dtype,
    )
    return lambda: wrapper.run(q, (cache[0], cache[1]))


def bench_decode(quick: bool, bandwidth: float, device: str) -> list[dict]:
    rows = []
    for batch, context in [(2, 64)] if quick else DECODE_CASES:
        rows += decode_case(
            batch, context, sweep=not quick and (batch, context) in DECODE_SWEEP, bandwidth=bandwidth, device=device
        )
    return rows


def decode_case(batch: int, context: int, sweep: bool, bandwidth: float, device: str) -> list[dict]:
    q, k, v, cache, meta_fn = paged_decode_inputs(batch, context, device)
    kv_bytes = batch * context * 2 * KV_HEADS * HEAD_DIM * cache.element_size()
    impls = {"ours": ours_decode()}
    if sweep:
        impls.update({f"ours n{n} w{w} s{s}": ours_decode((n, w, s)) for n, w, s in DECODE_CONFIGS})
    rows, reference = [], None
    for name, backend in impls.items():
        meta = meta_fn(backend)

        def run(backend=backend, meta=meta):
            return backend.forward(q, k, v, cache, meta, HEAD_DIM**-0.5)

        out = run()
        reference = out if reference is None else reference
        rows.append(row("decode", name, batch, context, timed_ms(run), kv_bytes, bandwidth, out, reference))
    if device == "cuda":
        try:
            fn = flashinfer_decode(q, cache, meta_fn)
            rows.append(row("decode", "flashinfer", batch, context, timed_ms(fn), kv_bytes, bandwidth, fn(), reference))
        except Exception as exc:  # noqa: BLE001 - not installed, or its compile failed: say so, go on
            rows.append(
                {
                    "kind": "decode",
                    "impl": "flashinfer",
                    "batch": batch,
                    "context": context,
                    "error": f"{type(exc).__name__}: {str(exc)[:200]}",
                }
            )
    return rows


def row(kind, impl, batch, context, ms, work, limit, out, reference) -> dict:
    """work: bytes (decode; limit: bytes/s) or FLOPs (limit: FLOP/s)."""
    achieved = work / (ms / 1e3)
    error = float((out.float() - reference.float()).norm() / reference.float().norm())
    return {
        "kind": kind,
        "impl": impl,
        "batch": batch,
        "context": context,
        "ms": ms,
        "achieved": achieved,
        "of_limit": achieved / limit,
        "rel_diff_vs_first": error,
    }


def bench_prefill(quick: bool, rate: float, device: str) -> list[dict]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fovea.attention.triton_paged import TritonAttention

    length = 128 if quick else 8192
    q, k, v, cache, meta_fn = paged_prefill_inputs(length, device)
    flops = 4 * Q_HEADS * HEAD_DIM * length * length / 2  # causal: half the scores
    rows, reference = [], None
    configs = [(64, 64, None), (128, 64, 8), (128, 32, 4), (128, 128, 8), (64, 32, 4)]
    for prefill_rows, block_n, warps in configs[:1] if quick else configs:
        backend = TritonAttention(
            group=Q_HEADS // KV_HEADS, block_n=block_n, prefill_rows=prefill_rows, prefill_warps=warps
        )
        meta = meta_fn(backend)
        backend.prepare(meta)
        fn = lambda: backend.forward(q, k, v, cache, meta, HEAD_DIM**-0.5)  # noqa: E731
        out = fn()
        reference = out if reference is None else reference
        rows.append(
            row(
                "prefill",
                f"ours rows{prefill_rows} n{block_n} w{warps}",
                1,
                length,
                timed_ms(fn),
                flops,
                rate,
                out,
                reference,
            )
        )
    group = Q_HEADS // KV_HEADS  # K and V expanded to every query head once, outside the timing
    qt, kt, vt = (x.repeat_interleave(h, 1).transpose(0, 1)[None] for x, h in ((q, 1), (k, group), (v, group)))
    for name, kernel in (
        ("sdpa flash", SDPBackend.FLASH_ATTENTION),
        ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
        ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):
        try:
            with sdpa_kernel(kernel):
                fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)  # noqa: E731
                out = fn()[0].transpose(0, 1)
                rows.append(row("prefill", name, 1, length, timed_ms(fn), flops, rate, out, reference))
        except Exception as exc:  # noqa: BLE001
            rows.append({"kind": "prefill", "impl": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    if device == "cuda":
        try:
            import flashinfer

            fn = lambda: flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True)  # noqa: E731
            rows.append(row("prefill", "flashinfer", 1, length, timed_ms(fn), flops, rate, fn(), reference))
        except Exception as exc:  # noqa: BLE001
            rows.append({"kind": "prefill", "impl": "flashinfer", "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    return rows


def paged_prefill_inputs(length: int, device: str):
    blocks = -(-length // BLOCK)
    cache = torch.zeros(2, blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    tables = (torch.arange(blocks, dtype=torch.int32, device=device) + 1)[None]
    slots = torch.arange(length, device=device) + BLOCK
    q = torch.randn(length, Q_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(length, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in range(2))
    starts = torch.tensor([0, length], dtype=torch.int32, device=device)
    lens = torch.tensor([length], dtype=torch.int32, device=device)

    def meta(backend):
        return PagedAttentionMetadata(backend, slots, starts, lens, tables, length, length, BLOCK, [cache])

    return q, k, v, cache, meta


def bench_vision(quick: bool, rate: float, device: str) -> list[dict]:
    """One 1280x720 image's window layer (64-patch windows) and full layer, 16 heads of 80."""
    from fovea.attention.layer import AttentionMetadata, varlen_attention
    from fovea.attention.triton_varlen import tile_table, varlen_attention_triton

    patches, heads, dim = (256, 2, 80) if quick else (4784, 16, 80)
    rows = []
    for layer, lengths in (("window", [64] * (patches // 64) + [patches % 64]), ("full", [patches])):
        lengths = [n for n in lengths if n]
        qkv = torch.randn(patches, 3, heads, dim, device=device, dtype=torch.bfloat16)
        q, k, v = qkv.unbind(1)
        meta = AttentionMetadata.from_lengths(lengths, device)
        flops = sum(4 * heads * dim * n * n for n in lengths)
        tiles = tile_table(lengths).to(device)
        impls = {
            "ours": lambda q=q, k=k, v=v, tiles=tiles: varlen_attention_triton(q, k, v, tiles, dim**-0.5),
            "sdpa (grouped by length)": lambda q=q, k=k, v=v, meta=meta: varlen_attention(
                q, k, v, meta.cu_seqlens, meta.max_seqlen, False, dim**-0.5, lengths=meta.lengths
            ),
        }
        reference = None
        for name, fn in impls.items():
            out = fn()
            reference = out if reference is None else reference
            rows.append(row(f"vision {layer}", name, len(lengths), patches, timed_ms(fn), flops, rate, out, reference))
    return rows


def bench_kernels(out: str | None, quick: bool) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rates = measure_rates(quick)
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "rates": rates,
        "rows": bench_decode(quick, rates["copy_tb_s"] * 1e12, device)
        + bench_prefill(quick, rates["matmul_tflops"] * 1e12, device)
        + bench_vision(quick, rates["matmul_tflops"] * 1e12, device),
    }
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))
    print(f"{result['device']}: matmul {rates['matmul_tflops']:.0f} TFLOP/s, copy {rates['copy_tb_s']:.2f} TB/s")
    print("| kind | impl | batch | context | ms | achieved | of limit | rel diff |\n|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        if "error" in r:
            print(f"| {r['kind']} | {r['impl']} | {r.get('batch', '')} | {r.get('context', '')} | {r['error']} |")
            continue
        unit = f"{r['achieved'] / 1e12:.2f} TB/s" if r["kind"] == "decode" else f"{r['achieved'] / 1e12:.0f} TF/s"
        print(
            f"| {r['kind']} | {r['impl']} | {r['batch']} | {r['context']} | {r['ms']:.3f} | {unit} | "
            f"{r['of_limit']:.0%} | {r['rel_diff_vs_first']:.1e} |"
        )
    return result
