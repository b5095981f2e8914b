"""One engine step on the device: flatten the scheduled batch, run the model, sample; and, for the ImageEncoder,
the vision tower over a batch of images.

The batch is one flat run of tokens (each sequence's new tokens back to back) with their (3, N) M-RoPE
positions, KV-cache slots and block tables; the attention backend turns that into attention over each
sequence's paged context. Logits are computed only for rows that sample (a sequence's last known token) and
for prompt rows whose log-probabilities were asked for.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from fovea.engine.config import EngineConfig
from fovea.engine.cuda_graphs import DecodeGraphs
from fovea.engine.encoder_buckets import EncoderBuckets
from fovea.engine.encoder_cache import EncoderCache
from fovea.engine.memory_profile import profile_kv_budget
from fovea.engine.sampler import Sampler, SampleRow, SamplerOutput, top_logprobs
from fovea.engine.request import MMItem
from fovea.engine.scheduler import ScheduledBatch
from fovea.layers.paged_attention import AttentionBackend, PagedAttentionMetadata, TorchAttention
from fovea.models.loader import load_model
from fovea.multimodal.image import ImageProcessorConfig
from fovea.multimodal.patchify import patchify

CPU_KV_CACHE_BYTES = 1 << 30  # vLLM's CPU backend sizes its cache by a fixed space too (VLLM_CPU_KVCACHE_SPACE)


def block_table_array(tables: list[list[int]]) -> np.ndarray:
    """The block tables as one (sequences, longest table) int32 array padded with 0, filled in one go."""
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    array = np.zeros((len(tables), int(lengths.max())), dtype=np.int32)
    array[np.arange(array.shape[1])[None, :] < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
    return array


@dataclass
class StepOutput:
    # (batch index, fork number) of each sampled row: fork 0 is the sequence itself, k > 0 its k-th new sample
    row_owners: list[tuple[int, int]] = field(default_factory=list)
    sampled: SamplerOutput | None = None
    # batch index -> (token logprob, rank, top ids, top logprobs) for the prompt tokens this chunk predicted
    prompt_logprobs: dict[int, tuple] = field(default_factory=dict)


def make_attention_backend(config: EngineConfig) -> AttentionBackend:
    if config.resolved_attention_backend == "torch":
        return TorchAttention(config.fp32_softmax, config.device)
    from fovea.kernels.paged_attention import TritonAttention

    text = config.model.text
    return TritonAttention(group=text.num_heads // text.num_kv_heads)


class ModelRunner:
    def __init__(self, config: EngineConfig, backend: AttentionBackend | None = None):
        self.config = config
        self.device = config.device
        self.model, _ = load_model(config.model_dir, dtype=config.dtype, device=config.device)
        self.image_config = ImageProcessorConfig.from_dir(config.model_dir)  # mean, std, patch and merge sizes
        self.backend = backend or make_attention_backend(config)
        for block in self.model.visual.blocks:
            block.attn.fp32_softmax = config.fp32_softmax_vision
        self.layers = [layer.self_attn for layer in self.model.model.layers]
        for attn in self.layers:
            attn.fp32_softmax = config.fp32_softmax  # the uncached path (start-up profile); Triton is always fp32
        gpu_kernels = self.device.type == "cuda" and config.resolved_attention_backend == "triton"
        self.model.visual.use_kernel = gpu_kernels
        self.encoder_buckets = None
        if config.mm_buckets:  # before the memory profile: captured graphs keep their memory
            self.encoder_buckets = EncoderBuckets(self.model.visual, config.mm_buckets, config.dtype, self.device,
                                                  capture=gpu_kernels and not config.enforce_eager)
            if not config.skip_warmup:
                self.encoder_buckets.warm_up()
        self.sampler = Sampler(config.seed)
        self.num_blocks = self._count_kv_blocks()
        text = config.model.text
        shape = (2, self.num_blocks, config.block_size, text.num_kv_heads, text.head_dim)
        # zeros, not empty: padded attention reads masked slots, and 0 * NaN garbage would still be NaN
        self.kv_caches = [torch.zeros(shape, dtype=config.dtype, device=self.device) for _ in self.layers]
        self.kv_cache_bytes = sum(cache.numel() * cache.element_size() for cache in self.kv_caches)
        for attn, cache in zip(self.layers, self.kv_caches):
            attn.kv_cache = cache
        self.logits_buffer = torch.empty(config.max_num_seqs, config.model.text.vocab_size, dtype=config.dtype,
                                         device=self.device)
        self.graphs: DecodeGraphs | None = None
        if gpu_kernels and not config.enforce_eager:
            # the reference backend sizes its tensors from the batch, so only our kernels can be captured
            self.graphs = DecodeGraphs(self.model, self.backend, config.max_num_seqs, config.max_model_len,
                                       config.block_size, self.device, capture=True)

    def _count_kv_blocks(self) -> int:
        cfg, text = self.config, self.config.model.text
        block_bytes = 2 * len(self.layers) * cfg.block_size * text.num_kv_heads * text.head_dim * cfg.dtype.itemsize
        if cfg.num_gpu_blocks_override:
            return cfg.num_gpu_blocks_override
        if cfg.kv_cache_memory_bytes:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = profile_kv_budget(self.model, cfg)
        else:
            budget = min(CPU_KV_CACHE_BYTES, block_bytes * cfg.max_num_seqs * -(-cfg.max_model_len // cfg.block_size))
        blocks = int(budget // block_bytes)
        if blocks < 1:
            raise ValueError("no memory left for the KV cache after the weights and the heaviest step; lower "
                             "max_num_batched_tokens, max_pixels (mm_processor_kwargs) or limit_mm_per_prompt, raise "
                             "gpu_memory_utilization (or kv_cache_memory_bytes), or use more GPUs")
        return blocks

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, encoder_cache: EncoderCache) -> StepOutput:
        for src, dst in batch.block_copies:
            for cache in self.kv_caches:
                cache[:, dst].copy_(cache[:, src])
        ids, positions, meta, mm_embeds, mm_mask, sample_rows, owners, logprob_spans = self._prepare(batch,
                                                                                                    encoder_cache)
        if self.graphs and meta.max_query_len == 1 and mm_embeds is None and self.graphs.bucket(len(batch)):
            hidden = self.graphs.run(ids, positions, meta)
        else:
            self.backend.prepare(meta)
            hidden = self.model(ids, positions, meta, mm_embeds, mm_mask)
        out = StepOutput(row_owners=owners)
        if sample_rows:
            rows = hidden[torch.tensor([r for r, _ in sample_rows], device=self.device)]
            # one buffer for every step's logits: a fresh (256 x 150k) tensor a step costs page faults and a
            # munmap on the CPU (~50 ms at batch 256); the buffer is only read before the next step writes it
            buffer = self.logits_buffer[:len(sample_rows)] if len(sample_rows) <= len(self.logits_buffer) else None
            logits = self.model.compute_logits(rows, out=buffer)
            out.sampled = self.sampler(logits, [row for _, row in sample_rows])
        for index, (offset, count, targets, k) in logprob_spans.items():
            logprobs = self.model.compute_logits(hidden[offset:offset + count]).float().log_softmax(-1)
            out.prompt_logprobs[index] = top_logprobs(logprobs, torch.tensor(targets, device=self.device), k)
        return out

    def encode_images(self, items: list[MMItem]) -> list[torch.Tensor]:
        """The vision tower over several images at once (the ImageEncoder's thread calls it): one (tokens,
        hidden) tensor per image. The uint8 pixels cross to the device; rescaling, normalizing and cutting into
        patches happen there, one frame per still image."""
        patches = torch.cat([patchify(torch.from_numpy(item.pixels).to(self.device), self.image_config)
                             for item in items]).to(self.config.dtype)
        grids = [item.grid_thw for item in items]
        bucket = self.encoder_buckets and self.encoder_buckets.bucket(patches.shape[0])
        if bucket:
            return self.model.split_by_item(self.encoder_buckets.encode(patches, grids, bucket), grids)
        return self.model.encode_images(patches, grids)

    def _prepare(self, batch: ScheduledBatch, encoder_cache: EncoderCache):
        bs = self.config.block_size
        total = batch.num_tokens
        ids: list[int] = []
        positions = np.empty((3, total), dtype=np.int64)
        slots = np.empty(total, dtype=np.int64)
        mm_embeds, mm_mask = [], np.zeros(total, dtype=bool)
        sample_rows, owners, logprob_spans = [], [], {}
        decode_rows, decode_positions, decode_slots = [], [], []  # written into the arrays once, below
        offset = 0
        for index, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            request = seq.request
            ids += seq.token_ids[start:end]
            if n == 1 and start >= seq.num_prompt_tokens:  # decode: the common case, kept cheap
                decode_rows.append(offset)
                decode_positions.append(start + request.mrope_delta)
                decode_slots.append(seq.block_table[start // bs] * bs + start % bs)
            else:
                prompt_end = min(end, seq.num_prompt_tokens)
                positions[:, offset:offset + max(prompt_end - start, 0)] = request.positions[:, start:prompt_end]
                generated = np.arange(max(start, seq.num_prompt_tokens), end)
                positions[:, offset + n - generated.size:offset + n] = generated + request.mrope_delta
                token_index = np.arange(start, end)
                slots[offset:offset + n] = np.asarray(seq.block_table)[token_index // bs] * bs + token_index % bs
                for item in request.mm_items:
                    lo, hi = max(start, item.span.start), min(end, item.end)
                    if lo < hi:
                        rows = encoder_cache.get(item.content_hash)
                        mm_embeds.append(rows[lo - item.span.start:hi - item.span.start])
                        mm_mask[offset + lo - start:offset + hi - start] = True
                if request.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                    # rows start..end-1 predict tokens start+1..end, those inside the prompt are wanted
                    count = min(end, seq.num_prompt_tokens - 1) - start
                    logprob_spans[index] = (offset, count, seq.token_ids[start + 1:start + 1 + count],
                                            seq.params.prompt_logprobs)
            if end == seq.num_tokens:
                for fork in range(1 + seq.pending_forks):
                    generator = request.generators[seq.index + fork]
                    owners.append((index, fork))
                    sample_rows.append((offset + n - 1, SampleRow(seq.params, seq.token_ids, seq.num_prompt_tokens,
                                                                  generator, request.stop_ids)))
            offset += n
        if decode_rows:
            positions[:, decode_rows] = decode_positions
            slots[decode_rows] = decode_slots
        meta = self._metadata(batch, slots, block_table_array([seq.block_table for seq in batch.seqs]))
        return (torch.tensor(ids, device=self.device), torch.from_numpy(positions).to(self.device), meta,
                torch.cat(mm_embeds) if mm_embeds else None, torch.from_numpy(mm_mask).to(self.device),
                sample_rows, owners, logprob_spans)

    def _metadata(self, batch: ScheduledBatch, slots: np.ndarray, tables: np.ndarray) -> PagedAttentionMetadata:
        q_lens = np.asarray(batch.num_new_tokens, dtype=np.int32)
        seq_lens = np.fromiter((s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens)),
                               dtype=np.int32, count=len(batch))
        starts = np.zeros(len(batch) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=starts[1:])
        to = lambda a: torch.from_numpy(a).to(self.device)  # noqa: E731
        return PagedAttentionMetadata(self.backend, to(slots), to(starts), to(seq_lens), to(tables),
                                      int(q_lens.max()), int(seq_lens.max()), self.config.block_size)
