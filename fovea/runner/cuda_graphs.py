"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket, captured at start-up.

A decode step of a 7B model is ~28 layers x ~10 kernels of a few microseconds each: launching them from Python
costs more than running them. A graph records the launches once per batch size and replays them with one call.
Replays read their inputs from static buffers, so a step copies its token ids, M-RoPE positions (all three axes),
KV slots, context lengths and block tables into the first rows of those buffers and pads the batch up to the
nearest captured size: padding rows write nowhere (slot -1) and attend to one key; their outputs are dropped.
Prefill steps, steps with images and batches larger than the largest bucket run eagerly.

Without a GPU (`capture=False`) the same buffers and padding run the forward eagerly, which is how CI checks that
a padded static-buffer step gives the tokens an eager step gives.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from fovea.attention.backend import AttentionBackend, PagedAttentionMetadata

logger = logging.getLogger("fovea")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_num_seqs (capped at 512), and max_num_seqs itself."""
    top = min(max_num_seqs, 512)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    return sorted(set(sizes) | {top})


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        kv_caches: list[torch.Tensor],
        device: torch.device,
        capture: bool,
    ):
        self.model, self.backend, self.block_size, self.kv_caches = model, backend, block_size, kv_caches
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        n = self.sizes[-1]
        long = dict(dtype=torch.long, device=device)
        self.ids = torch.zeros(n, **long)
        self.positions = torch.zeros(3, n, **long)
        self.slots = torch.full((n,), -1, **long)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)  # one query per sequence
        self.block_tables = torch.zeros(n, -(-max_model_len // block_size), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def bucket(self, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def _forward(self, size: int) -> torch.Tensor:
        meta = PagedAttentionMetadata(
            self.backend,
            self.slots[:size],
            self.query_start[: size + 1],
            self.seq_lens[:size],
            self.block_tables[:size],
            1,
            self.max_model_len,
            self.block_size,
            self.kv_caches,
        )
        self.backend.prepare(meta)
        return self.model.text_forward(self.ids[:size], self.positions[:, :size], meta)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            self._forward(size)  # compiles the kernels and settles the allocator before recording
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - start,
        )

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
        """A decode step (one new token per sequence) of at most the largest bucket -> hidden states (n, hidden)."""
        n = ids.numel()
        size = self.bucket(n)
        self.ids[:n].copy_(ids)
        self.positions[:, :n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:size].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:size].fill_(1)
        # padding rows keep an earlier step's table: any block id there is a valid one to read one key from
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward(size)[:n]
