"""One engine step on the device: run the model over a flattened batch (a StepInput), sample; and, for the
ImageEncoder, the vision tower over a batch of images.

Logits are computed only for rows that sample (a sequence's last known token) and for prompt rows whose
log-probabilities were asked for. Under tensor parallelism every rank has a ModelRunner with its slices of the
weights and of the KV cache (its KV heads): rank 0 builds each step, sends it to the other ranks (TPWorkers) and
runs its own part; the layers' collectives join the ranks; rank 0 alone samples.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from fovea.attention import BACKENDS, features_needed, make_backend
from fovea.attention.backend import PagedAttentionMetadata
from fovea.config.engine import EngineConfig
from fovea.core.host_copy import to_device
from fovea.core.request import MMItem
from fovea.distributed import SINGLE, ParallelGroups
from fovea.layers.lora import lora_rows
from fovea.models.base import ModelOptions
from fovea.models.loader import load_model
from fovea.models.lora import LoadedAdapters
from fovea.multimodal.patchify import batch_patches
from fovea.runner.cuda_graphs import DecodeGraphs
from fovea.runner.encoder_buckets import EncoderBuckets
from fovea.runner.grammar_masks import GrammarMasks
from fovea.runner.input_batch import InputBatch
from fovea.runner.memory_profile import free_memory_at_start, profile_kv_budget, zeroed
from fovea.runner.sampler import Sampler, SamplerOutput, top_logprobs
from fovea.runner.step_input import SamplePlan, ScheduledStep, StepInput, build_step

logger = logging.getLogger("fovea")

CPU_KV_CACHE_BYTES = 1 << 30  # vLLM's CPU backend sizes its cache by a fixed space too (VLLM_CPU_KVCACHE_SPACE)
# prompt log-probabilities are scored this many logits at a time: a whole 8k-token chunk would be a 5 GB fp32
# tensor, and on the CPU an 8k-token echo with logprobs took 29 s of engine steps in one piece, 11 s in blocks
PROMPT_LOGPROB_BLOCK = 1 << 24


@dataclass
class StepOutput:
    plan: SamplePlan  # what was sampled for whom
    sampled: SamplerOutput | None = None
    # batch index -> (token logprob, rank, top ids, top logprobs) for the prompt tokens this chunk predicted
    prompt_logprobs: dict[int, tuple] = field(default_factory=dict)
    # on a GPU: `sampled` copied to pinned host memory behind the step, and the event that says it is there; a
    # plain copy would also wait for the step queued after this one (async scheduling)
    host: SamplerOutput | None = None
    ready: torch.cuda.Event | None = None

    def row_owners(self):
        """(batch index, fork number) of each sampled row: fork 0 is the sequence itself, k > 0 its k-th new one.
        Made as they are read, from the plan's lists of ints (tuples made when the step was built would be cold
        by the time the engine reads them: issue 54)."""
        return zip(self.plan.owners, self.plan.forks)

    def sampled_on_host(self) -> SamplerOutput | None:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host if self.host is not None else self.sampled


def _queue_to_host(sampled: SamplerOutput) -> tuple[SamplerOutput, torch.cuda.Event]:
    def copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)

    host = SamplerOutput(*(copy(getattr(sampled, f.name)) for f in fields(SamplerOutput)))
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


LOGITS_BUFFER_ROWS = 512


class ModelRunner:
    def __init__(self, config: EngineConfig, parallel: ParallelGroups | None = None):
        self.config = config
        self.device = config.device
        self.parallel = parallel
        gpu_kernels = self.device.type == "cuda" and config.resolved_attention_backend == "triton"
        # fp32_softmax: the uncached path (start-up profile); the Triton kernels always are fp32
        options = ModelOptions(
            config.fp32_softmax,
            config.fp32_softmax_vision,
            vision_kernel=gpu_kernels,
            fused_kernels=self.device.type == "cuda",
            tower=not config.mm_encoder_workers,
        )
        self.free_at_start = free_memory_at_start(config) if self.device.type == "cuda" else 0
        self.model, _ = load_model(
            config.model_dir,
            dtype=config.dtype,
            device=config.device,
            lm_tp=parallel.lm if parallel else SINGLE,
            vision_tp=parallel.vision if parallel else SINGLE,
            options=options,
            config=config.model,
        )
        self.image_config = config.model.image  # mean, std, patch and merge sizes
        self.adapters = None
        if config.enable_lora:
            capacity = config.max_cpu_loras or config.max_loras
            self.adapters = LoadedAdapters(self.model, capacity, config.max_lora_rank, config.dtype, self.device)
        first = self.model.model.layers[0].self_attn
        self.num_layers, self.num_kv_heads = config.model.text.num_layers, first.num_kv_heads  # this rank's heads
        backend = config.resolved_attention_backend
        self.backend = make_backend(
            backend,
            first.num_heads // self.num_kv_heads,
            config.fp32_softmax,
            config.device,
            needs=features_needed(self.model) + (("fp8_kv_cache",) if config.kv_cache_dtype != "auto" else ()),
            kv_width=self.num_kv_heads * config.model.text.head_dim,
        )
        # collectives inside CUDA graphs are not set up yet: with several ranks everything runs eagerly
        capture = (
            self.device.type == "cuda"
            and BACKENDS[backend].cuda_graphs
            and not config.enforce_eager
            and not config.distributed
        )
        self.encoder_buckets = None
        if config.mm_buckets and self.model.visual is not None:  # before the memory profile: graphs keep memory
            self.encoder_buckets = EncoderBuckets(
                self.model.visual, config.mm_buckets, config.dtype, self.device, capture=capture
            )
            if not config.skip_warmup:
                self.encoder_buckets.warm_up()
        self.sampler = Sampler(config.seed, logprobs_mode=config.logprobs_mode)
        self.inputs = InputBatch(config.max_model_len, config.block_size)  # rank 0's rows (execute)
        self.num_blocks = self._count_kv_blocks()
        if parallel is not None:  # every rank holds the same blocks: as many as the tightest rank can
            self.num_blocks = parallel.min_over_ranks(self.num_blocks)
        text = config.model.text
        shape = (2, self.num_blocks, config.block_size, self.num_kv_heads, text.head_dim)
        # zeros, not empty: padded attention reads masked slots, and 0 * NaN garbage would still be NaN
        self.kv_caches = [zeroed(shape, config.kv_dtype, self.device) for _ in range(self.num_layers)]
        self.kv_cache_bytes = sum(cache.numel() * cache.element_size() for cache in self.kv_caches)
        rows = min(config.max_num_seqs, LOGITS_BUFFER_ROWS)  # a larger step's logits are allocated for it
        self.logits_buffer = torch.empty(rows, config.model.text.vocab_size, dtype=config.dtype, device=self.device)
        self.graphs: DecodeGraphs | None = None
        if capture and config.model.text.moe is not None:  # the grouped experts read nothing back from the device,
            # but no GPU run has yet recorded them in a graph (benchmarks/README, GPU): decode steps run eagerly
            logger.info("decode CUDA graphs off: the MoE layers run eagerly (fovea/layers/moe.py)")
        elif capture:
            self.graphs = DecodeGraphs(
                self.model,
                self.backend,
                config.max_num_seqs,
                config.max_model_len,
                config.block_size,
                self.kv_caches,
                self.device,
                capture=True,
            )

    def _count_kv_blocks(self) -> int:
        cfg, text = self.config, self.config.model.text
        block_bytes = 2 * self.num_layers * cfg.block_size * self.num_kv_heads * text.head_dim * cfg.kv_dtype.itemsize
        if cfg.num_gpu_blocks_override:
            return cfg.num_gpu_blocks_override
        if cfg.kv_cache_memory_bytes:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = profile_kv_budget(self.model, cfg, self.free_at_start)
        else:
            budget = min(CPU_KV_CACHE_BYTES, block_bytes * cfg.max_num_seqs * -(-cfg.max_model_len // cfg.block_size))
        blocks = int(budget // block_bytes)
        if blocks < 1:
            raise ValueError(
                "no memory left for the KV cache after the weights and the heaviest step; lower "
                "max_num_batched_tokens, max_pixels (mm_processor_kwargs) or limit_mm_per_prompt, raise "
                "gpu_memory_utilization (or kv_cache_memory_bytes), or use more GPUs"
            )
        return blocks

    @torch.inference_mode()
    def execute(
        self, step: ScheduledStep, encoded: Callable[[str], torch.Tensor], previous: StepOutput | None = None
    ) -> StepOutput:
        """Rank 0: builds the step, has every rank run it, samples. `encoded`: an image's embeddings by content
        hash (the engine's encoder cache holds every image the step's chunks show). `previous`: the step still on
        the device, whose samples are the new tokens of the sequences it sampled for (async scheduling)."""
        pending_from = None
        if previous is not None:
            pending_from = np.full(len(self.inputs.seq_ids), -1, dtype=np.int64)
            pending_from[previous.plan.sample_rows] = previous.plan.sample_index
        step_input, mm_embeds, plan, rows = build_step(step, encoded, self.config.block_size, self.inputs, pending_from)
        masks = None
        if self.inputs.num_grammar_rows:
            masks = GrammarMasks.start([row.grammar for row in plan.rows], self.config.model.text.vocab_size)
        if self.parallel is None:
            return self._run(step_input, mm_embeds, plan, masks, previous)
        self.parallel.send(step_input, self.parallel.lm_control)
        with self.parallel.one_step(self.parallel.lm_control, self.parallel.lm):  # failed: are the ranks in step?
            if mm_embeds is not None:
                self.parallel.broadcast(mm_embeds.to(self.config.dtype).contiguous())
            return self._run(step_input, mm_embeds, plan, masks, previous)

    def _run(self, step_input: StepInput, mm_embeds, plan: SamplePlan, masks, previous: StepOutput | None):
        """Rank 0's part of `execute` once the other ranks have the step: forward, samples, prompt logprobs."""
        previous_tokens = None if previous is None or previous.sampled is None else previous.sampled.token_ids
        logits, hidden = self.run_step(step_input, mm_embeds, previous_tokens)
        out = StepOutput(plan)
        # the prompt's log-probabilities first: their logits are gathered from every rank, and a sampler that fails
        # (rank 0's alone) after them leaves the ranks in step
        parts: list[list[tuple]] = [[] for _ in plan.prompt_logprobs]
        for span, offset, logits_rows in self.span_logits(hidden, step_input.logprob_spans):
            _, targets, k = plan.prompt_logprobs[span]
            ids = to_device(targets[offset : offset + len(logits_rows)], torch.long, self.device)
            parts[span].append(top_logprobs(logits_rows.float().log_softmax(-1), ids, k))
        for (index, _, _), blocks in zip(plan.prompt_logprobs, parts):  # the blocks joined field by field
            out.prompt_logprobs[index] = tuple(None if field[0] is None else torch.cat(field) for field in zip(*blocks))
        if logits is not None:
            pending = None
            if plan.pending:
                pending_rows, sources = zip(*plan.pending)
                pending = (list(pending_rows), previous_tokens[to_device(list(sources), torch.long, self.device)])
            out.sampled = self.sampler(logits, plan.rows, masks, pending)
            if self.device.type == "cuda":
                out.host, out.ready = _queue_to_host(out.sampled)
        return out

    def read_samples(self, out: StepOutput) -> SamplerOutput | None:
        """A step's samples on the host (waiting for the device): its sequences' new tokens join their rows. The
        engine reads each step once."""
        sampled = out.sampled_on_host()
        if sampled is not None:
            self.inputs.record(out.plan, sampled.token_ids.numpy())
        return sampled

    def span_logits(self, hidden: torch.Tensor, spans: list[tuple[int, int]]):
        """(span number, offset in the span, logits) of the prompt log-probability spans, a block of rows at a
        time. Every rank runs it: under tensor parallelism each block's logits are gathered from all ranks."""
        rows = max(1, PROMPT_LOGPROB_BLOCK // self.config.model.text.vocab_size)
        for span, (first, count) in enumerate(spans):
            for offset in range(0, count, rows):
                yield (
                    span,
                    offset,
                    self.model.compute_logits(hidden[first + offset : first + min(count, offset + rows)]),
                )

    def run_worker_step(self, step: StepInput) -> None:
        """Ranks above 0: the step rank 0 sent, with the image embeddings it broadcasts after it."""
        mm_embeds = None
        if step.num_mm_rows:
            shape = (step.num_mm_rows, self.config.model.vision.output_width)
            mm_embeds = self.parallel.broadcast(torch.empty(shape, dtype=self.config.dtype, device=self.device))
        with torch.inference_mode():
            _, hidden = self.run_step(step, mm_embeds)
            for _ in self.span_logits(hidden, step.logprob_spans):
                pass

    def run_step(self, step: StepInput, mm_embeds: torch.Tensor | None, previous_tokens: torch.Tensor | None = None):
        """Every rank: the forward pass, the logits of the rows to sample, and the hidden states (whose prompt
        log-probability spans `span_logits` scores). `previous_tokens`: rank 0's samples of the step still on the
        device, which `step.fill_rows` take (async scheduling; rank 0 broadcasts them to the other ranks)."""
        for lora_int_id in step.dropped_loras:
            self.adapters.drop(lora_int_id)
        for src, dst in step.block_copies:
            for cache in self.kv_caches:
                cache[:, dst].copy_(cache[:, src])
        to = lambda a: to_device(a, None, self.device)  # noqa: E731
        ids, positions = to(step.token_ids), to(step.positions)
        if step.fill_rows:
            if previous_tokens is None:  # a rank above 0: rank 0 sampled them
                filled = torch.empty(len(step.fill_rows), dtype=ids.dtype, device=self.device)
            else:
                filled = previous_tokens[to_device(step.fill_from, torch.long, self.device)].to(ids.dtype)
            if self.parallel is not None:
                self.parallel.broadcast(filled)
            ids[to_device(step.fill_rows, torch.long, self.device)] = filled
        meta = PagedAttentionMetadata(
            self.backend,
            to(step.slots),
            to(step.query_starts),
            to(step.seq_lens),
            to(step.block_tables),
            step.max_query_len,
            step.max_seq_len,
            self.config.block_size,
            self.kv_caches,
            bidirectional_spans=step.image_spans if self.config.model.bidirectional_images else {},
            query_starts_host=step.query_starts,
        )
        num_seqs = len(step.seq_lens)
        # the decode graphs hold the base model only: a step with adapters runs eagerly
        adapters = [(self._rows(rows, len(ids)), self.adapters.get(lora)) for rows, lora in step.lora_rows()]
        if (
            self.graphs
            and meta.max_query_len == 1
            and mm_embeds is None
            and not adapters
            and self.graphs.bucket(num_seqs)
        ):
            hidden = self.graphs.run(ids, positions, meta)
        else:
            self.backend.prepare(meta)
            with lora_rows(adapters):
                hidden = self.model(ids, positions, meta, mm_embeds, to(step.mm_mask))
        logits = None
        if step.logits_rows:
            # a decode step scores every row in order: no index (whose copy to the GPU would wait for the forward)
            every_row = step.logits_rows == list(range(hidden.shape[0]))
            rows = hidden if every_row else hidden[to_device(step.logits_rows, torch.long, self.device)]
            # one buffer for every step's logits: a fresh (256 x 150k) tensor a step costs page faults and a
            # munmap on the CPU (~50 ms at batch 256); the buffer is only read before the next step writes it
            count = len(step.logits_rows)
            logits = self.model.compute_logits(
                rows, out=self.logits_buffer[:count] if count <= len(self.logits_buffer) else None
            )
        return logits, hidden

    def _rows(self, rows, total: int) -> torch.Tensor | None:
        return None if len(rows) == total else to_device(rows, None, self.device)

    def encode_images(self, items: list[MMItem]) -> list[torch.Tensor]:
        """The vision tower over several images at once (the ImageEncoder's thread calls it): one (tokens,
        hidden) tensor per image. Under tensor parallelism rank 0 sends the job to the other ranks first."""
        if self.parallel is None:
            return self.encode_shared(items)
        self.parallel.send(items, self.parallel.vision_control)
        with self.parallel.one_step(self.parallel.vision_control, self.parallel.vision_data, "vision tower run"):
            return self.encode_shared(items)

    def encode_shared(self, items: list[MMItem]) -> list[torch.Tensor]:
        """Every rank: a sharded tower runs all the images on every rank; a whole one (mm_encoder_tp_mode data)
        runs each rank's share of them, and the embeddings are gathered."""
        if self.parallel is None or self.parallel.vision.communicates:
            return self._encode(items)
        from fovea.runner.vision_data_parallel import encode_data_parallel

        return encode_data_parallel(items, self._encode, self.parallel.vision_data, self.config)

    def _encode(self, items: list[MMItem]) -> list[torch.Tensor]:
        """The uint8 pixels cross to the device; rescaling, normalizing and cutting into patches happen there,
        one frame per still image (two, itself twice, when a video is in the batch: patches have one width).
        Items given as embeddings (--enable-mm-embeds) skip the tower."""
        given = {
            i: torch.from_numpy(item.pixels).to(self.device, self.config.dtype)
            for i, item in enumerate(items)
            if item.embeds
        }
        if given:
            encoded = iter(self._encode([item for item in items if not item.embeds]))
            return [given[i] if i in given else next(encoded) for i in range(len(items))]
        if any(item.lora for item in items):  # the tower once per adapter that changes it (and once for none)
            encoded = {}
            for lora in dict.fromkeys(item.lora for item in items):
                group = [i for i, item in enumerate(items) if item.lora == lora]
                with lora_rows([] if lora is None else [(None, self.adapters.get(lora))]):
                    encoded.update(zip(group, self._encode_pixels([items[i] for i in group], lora is None)))
            return [encoded[i] for i in range(len(items))]
        return self._encode_pixels(items)

    def _encode_pixels(self, items: list[MMItem], graphs: bool = True) -> list[torch.Tensor]:
        """The tower over the items' pixels; `graphs`: an encoder bucket's CUDA graph may run it (the base
        model's tower only)."""
        if not items:
            return []
        patches = batch_patches([item.pixels for item in items], self.image_config, self.device, self.config.dtype)
        grids = [item.grid_thw for item in items]
        # buckets are captured for one-frame patches: a batch with a video runs eagerly
        one_frame = patches.shape[1] == self.config.model.vision.frame_patch_dim
        bucket = graphs and one_frame and self.encoder_buckets and self.encoder_buckets.bucket(patches.shape[0])
        if bucket:
            return self.model.split_by_item(self.encoder_buckets.encode(patches, grids, bucket), grids)
        return self.model.encode_images(patches, grids)
