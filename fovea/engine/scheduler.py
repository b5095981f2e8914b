"""Which sequences run in the next step, how many tokens each, and which images go to the encoder.

Continuous batching under two budgets: `max_num_batched_tokens` tokens and `max_num_seqs` sequences per step.
Running sequences go first, decodes before prefills, so a long prompt never stalls generation: its prefill is
cut into chunks that fill what the budget leaves. Waiting sequences are admitted in arrival order, starting after
their longest cached prefix. Requests that arrive together with the same image or prefix share it too: in a
step, one sequence fills each block; the others wait a step and take the filled blocks from the cache (also
when they were admitted before it was filled, as all are while their image is being encoded). When KV blocks
run out, the latest-arrived running sequence is preempted: its blocks
are freed and it waits again, to be recomputed (prefix caching usually finds its blocks still there). Arrival order
is `Sequence.order`, which puts a request's priority first (--scheduling-policy priority; 0 under fcfs): the lowest
value is admitted first and preempted last.
The requests of a failed step are suspects (isolate): recomputed, each runs in steps of its own, every other step,
until a step samples for it; the others run in the steps between, without them.
"""

from __future__ import annotations

import bisect
import time

from fovea.config.engine import EngineConfig
from fovea.core.stats import EngineStats, LatencyEvents
from fovea.engine.block_manager import BlockManager, extend_block_hashes
from fovea.engine.encoder_cache import EncoderCache
from fovea.engine.sequence import Request, ScheduledBatch, Sequence, SequenceStatus
from fovea.runner.step_input import ScheduledStep


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, encoder_cache: EncoderCache):
        self.config = config
        self.blocks = block_manager
        self.encoder_cache = encoder_cache
        self.whole_images = config.model.bidirectional_images  # a chunk never ends inside an image
        self.waiting: list[Sequence] = []  # kept in arrival order, preempted sequences included
        self.running: list[Sequence] = []
        self.pending_copies: list[tuple[int, int]] = []
        self.relaid: list[int] = []  # sequences whose runner rows are dropped (ScheduledStep.relaid)
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, found in the cache
        self.suspects: list[Request] = []  # requests of failed steps, run alone (isolate)
        self.isolating = False  # this step runs one suspect request alone (they alternate with the others' steps)

    def stats(self, events: LatencyEvents, num_requests_added: int) -> EngineStats:
        """The gauges and totals of the requests, the KV blocks and the caches this scheduler holds."""
        encoder = self.encoder_cache
        loras = {}
        if self.config.enable_lora:  # read every step: only where there can be adapters
            loras = {
                f"{kind}_loras": tuple(dict.fromkeys(s.request.lora.lora_name for s in seqs if s.request.lora))
                for kind, seqs in (("running", self.running), ("waiting", self.waiting))
            }
        return EngineStats(
            len({seq.request.request_id for seq in self.running}),
            len({seq.request.request_id for seq in self.waiting}),
            self.blocks.num_blocks - self.blocks.num_free_blocks,
            self.blocks.num_blocks,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            encoder.hits + encoder.encoded,
            encoder.hits,
            self.num_preemptions,
            encoder.num_references(),
            events,
            num_requests_added,
            **loras,
            encoder_cache_tokens=encoder.used,
            encoder_cache_capacity=encoder.capacity,
        )

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.order)

    def isolate(self, requests) -> None:
        """The requests of a failed step, which may have caused it: recomputed from their tokens, each alone."""
        for request in sorted(requests, key=lambda r: r.sequences[0].order):  # in arrival order
            if not request.suspect:
                request.suspect = True
                self.suspects.append(request)
            for seq in request.sequences:
                if seq.status == SequenceStatus.RUNNING:
                    self.running.remove(seq)
                    self._reset(seq)

    def cleared(self, request: Request) -> None:
        """A suspect that a step sampled for, or that ended: it runs with the others again."""
        if request.suspect:
            request.suspect = False
            self.suspects.remove(request)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(step=ScheduledStep(block_copies=self.pending_copies))
        self.pending_copies = []
        turns, preempted = self._turns(), True
        # a pass that preempted and ran nothing goes again, every turn: what the preempted sequences held (KV
        # blocks, an image's room in the encoder cache) may be what the sequences before them, or the other turn's
        # (a suspect), waited for. Each pass again preempts one more running sequence or admits, so this ends.
        while preempted and not batch.seqs:
            preempted = False
            for eligible in turns:
                preempted = self._fill(batch, eligible) or preempted
                if batch.seqs:
                    break
        if batch.seqs:
            batch.step.relaid, self.relaid = self.relaid, []
        return batch

    def _turns(self) -> list:
        """Which sequences this step may run, in the order to try (None: all). With suspects about, the first
        suspect request alone and everyone else take turns; a turn with nothing to run gives way to the other."""
        if not self.suspects:
            return [None]
        suspect = self.suspects[0]
        turns = [lambda seq: seq.request is suspect, lambda seq: not seq.request.suspect]
        self.isolating = not self.isolating
        return turns if self.isolating else turns[::-1]

    def _fill(self, batch: ScheduledBatch, eligible) -> bool:
        """Adds what may run to `batch`; whether it preempted a sequence to make room."""
        budget = self.config.max_num_batched_tokens
        block_size = self.blocks.block_size
        preempted = False
        decodes, prefills = [], []
        for seq in self.running:  # (is_prefill, spelled out: a call per property costs at 256 sequences a step)
            pending = len(seq.token_ids) + seq.num_pending - seq.num_computed_tokens
            (prefills if pending > 1 else decodes).append(seq)
        computing: set[bytes] = set()  # hashes of the blocks this step fills: one sequence computes each
        # free blocks promised to the forks of prompts this step completes: they are taken when the step's samples
        # are recorded, so the sequences scheduled after them must leave them free
        reserved = 0
        for seq in decodes + prefills:
            if budget == 0:
                break
            if eligible is not None and not eligible(seq):
                continue
            if seq.status != SequenceStatus.RUNNING or (seq.num_pending and self._ends_with_pending_token(seq)):
                continue  # preempted earlier in this loop, or nothing left to compute
            tokens = seq.num_tokens  # read once: hundreds of sequences a step
            if tokens - seq.num_computed_tokens > 1 and self._shares_blocks(seq):  # a prefill
                self._adopt_cached(seq, reserved)
                if self._block_at(seq, seq.num_computed_tokens) in computing:
                    continue  # another sequence fills that block now; this one takes it next step
            start = seq.num_computed_tokens
            n = min(tokens - start, budget)
            if seq.request.mm_items:
                n = self._fit_encoder(seq, start, n, batch)
                if n == 0:
                    continue
            extra = seq.pending_forks if start + n >= tokens else 0  # (_fork_blocks)
            if extra or len(seq.block_table) * block_size < start + n:  # (a decode mostly has room already)
                while not self.blocks.can_append(seq.block_table, start + n, extra + reserved):
                    victim = self._pick_victim(batch)
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                if seq.status != SequenceStatus.RUNNING:
                    continue
                self.blocks.append_slots(seq.block_table, start + n)
            self._add_to_batch(batch, seq, n)
            if self.blocks.enable_prefix_caching:
                self._note_filled(seq, start, n, computing)
            budget -= n
            reserved += extra
        if not preempted:
            self._admit_waiting(batch, budget, computing, eligible, reserved)
        return preempted

    def _ends_with_pending_token(self, seq: Sequence) -> bool:
        """The tokens steps still on the device sample for it reach max_tokens or max_model_len."""
        max_tokens = seq.params.max_tokens
        return (
            max_tokens is not None and seq.num_output_tokens + seq.num_pending >= max_tokens
        ) or seq.num_tokens >= self.config.max_model_len

    def _shares_blocks(self, seq: Sequence) -> bool:
        """Whether the prefix cache may stand in for this sequence's prompt blocks (prompt log-probabilities
        need every prompt position computed)."""
        logprobs = seq.request.prompt_logprobs
        return self.blocks.enable_prefix_caching and (logprobs is None or len(logprobs) >= seq.num_prompt_tokens)

    def _block_at(self, seq: Sequence, position: int) -> bytes | None:
        """The hash of the full prompt block holding `position` (None past the last full one)."""
        index = position // self.blocks.block_size
        return seq.block_hashes[index] if index < len(seq.block_hashes) else None

    def _note_filled(self, seq: Sequence, start: int, n: int, computing: set[bytes]) -> None:
        if self._shares_blocks(seq):
            computing.update(seq.block_hashes[start // self.blocks.block_size : (start + n) // self.blocks.block_size])

    def _adopt_cached(self, seq: Sequence, reserved: int) -> None:
        """A prefill admitted before another sequence filled the blocks it needs next (requests that came
        together with the same image or prefix) takes those blocks instead of computing them again, leaving
        the `reserved` blocks promised to this step's forks free (the scheduler fuzz's seed 189)."""
        block_size = self.blocks.block_size
        first = seq.num_computed_tokens // block_size
        taken = self.blocks.adopt_cached(seq.block_table, seq.block_hashes, first, seq.num_tokens, reserved)
        if not taken:
            return
        self.relay(seq)  # blocks of its table were swapped
        skipped = (first + taken) * block_size - seq.num_computed_tokens
        seq.num_computed_tokens += skipped
        seq.num_registered_blocks = first + taken
        self.prefix_cache_hits += skipped
        if seq.index == 0 and seq.num_output_tokens == 0:
            seq.request.num_cached_tokens += skipped
        for item in seq.request.mm_items:
            if item.end <= seq.num_computed_tokens:  # an image it no longer needs embeddings of
                self.encoder_cache.release(item.content_hash, seq.seq_id)

    def _admit_waiting(
        self, batch: ScheduledBatch, budget: int, computing: set[bytes], eligible, reserved: int = 0
    ) -> int:
        position = 0  # in the waiting list: sequences deferred by a step stay ahead of later arrivals
        adapters = (
            {s.request.lora.lora_int_id for s in self.running if s.request.lora} if self.config.enable_lora else ()
        )
        # the running prompts' samples still to fork count as running: each takes a place once its prompt is done
        running = len(self.running) + sum(s.pending_forks for s in self.running) if self.waiting else 0
        while position < len(self.waiting) and budget > 0:
            seq = self.waiting[position]
            if running + 1 + seq.pending_forks > self.config.max_num_seqs:
                break
            # preempted with a sample still on the device (async scheduling): it waits for it, since a runner row
            # made now would not know that token (the cross-talk fuzz's seed 702275489 ran its position unsampled)
            if (eligible is not None and not eligible(seq)) or seq.num_pending:
                position += 1
                continue
            request = seq.request
            lora = request.lora
            if lora and lora.lora_int_id not in adapters and len(adapters) >= self.config.max_loras:
                position += 1  # max_loras adapters run already: it waits for one of them to finish
                continue
            extend_block_hashes(
                seq.block_hashes, seq.token_ids, self.blocks.block_size, request.mm_spans, request.hash_salt
            )
            # prompt logprobs need logits at every prompt position, so cached blocks cannot be skipped
            shares = self._shares_blocks(seq)
            prefix = self.blocks.cached_prefix(seq.block_hashes, seq.num_tokens) if shares else []
            start = len(prefix) * self.blocks.block_size
            if shares and self._block_at(seq, start) in computing:
                position += 1  # a sequence fills its next block in this step: admitted next step, it reuses it
                continue
            n = self._fit_encoder(seq, start, min(seq.num_tokens - start, budget), batch)
            forks = self._fork_blocks(seq, start + n)
            if not self.blocks.can_allocate(prefix, start + n, forks + reserved):
                # it waits holding no image: the images it reached stay cached (those the encoder starts on now
                # too) but evictable, or running sequences that need the room would wait for it, and it for
                # their KV blocks (a deadlock the cross-talk fuzz found)
                for item in request.mm_items:
                    self.encoder_cache.release(item.content_hash, seq.seq_id)
                break
            reserved += forks
            self.waiting.pop(position)
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += start
            seq.block_table = self.blocks.allocate(prefix, start + n)
            seq.num_computed_tokens = start
            seq.num_registered_blocks = len(prefix)
            if seq.index == 0 and seq.num_output_tokens == 0:
                seq.request.num_cached_tokens = start
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.order)
            running += 1 + seq.pending_forks
            if lora:
                adapters.add(lora.lora_int_id)
            if n:  # 0: its next token is an image still being encoded; it runs from there once it is ready
                self._add_to_batch(batch, seq, n)
                self._note_filled(seq, start, n, computing)
                budget -= n
        return budget

    def _fork_blocks(self, seq: Sequence, computed_after: int) -> int:
        """Spare blocks to keep for the forks a request with n > 1 makes once its prompt is prefilled."""
        return seq.pending_forks if computed_after >= seq.num_tokens else 0

    def _fit_encoder(self, seq: Sequence, start: int, n: int, batch: ScheduledBatch) -> int:
        """How many of the `n` tokens from `start` can run: the chunk stops before the first image whose
        embeddings are not ready, and (a model whose images are seen both ways) before one it would cut. Every
        image the `n` tokens reach and the cache lacks is handed to the encoder (ScheduledStep.encode), in order, up
        to the first that this step's encoder budget or the cache has no room for; the sequence holds the entries
        until it is past them."""
        cache, cut = self.encoder_cache, n
        for item in seq.request.mm_items:
            if item.end <= start or item.span.start >= start + n:
                continue
            key = item.content_hash
            if key not in seq.queried_images:  # counted once per sequence and image
                seq.queried_images.add(key)
                cache.hits += cache.contains(key)
            if not cache.contains(key):
                planned = sum(i.span.length for i in batch.step.encode)
                if (planned and planned + item.span.length > self.config.encoder_budget) or not cache.can_reserve(
                    item.span.length
                ):
                    # no room now: nor are the images after it held, or a cache full of later images that only
                    # waiting sequences hold would never have room for the images they wait for
                    return min(cut, max(item.span.start - start, 0))
                cache.reserve(key, item.span.length)
                batch.step.encode.append(item)
            cache.acquire(key, seq.seq_id)
            if not cache.ready(key) or (self.whole_images and start + n < item.end):
                cut = min(cut, max(item.span.start - start, 0))  # (an image seen both ways is run whole)
        return cut

    def _add_to_batch(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        mm_items = seq.request.mm_items
        for item in mm_items:  # (usually none)
            if item.span.start < start + n and item.end > start:
                self.encoder_cache.acquire(item.content_hash, seq.seq_id)
        batch.seqs.append(seq)
        blocks = self.blocks
        if mm_items or (blocks.enable_prefix_caching and (start + n) // blocks.block_size > seq.num_registered_blocks):
            batch.filling.append(seq)
        step = batch.step
        step.seq_ids.append(seq.seq_id)
        step.num_new_tokens.append(n)
        if not seq.on_runner:  # (first scheduled, or relaid)
            step.new.append(seq.for_runner())
            metrics = seq.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = time.time()
        elif len(seq.block_table) != seq.blocks_sent:
            step.new_blocks.append((seq.seq_id, seq.block_table[seq.blocks_sent :]))
            seq.blocks_sent = len(seq.block_table)

    def _pick_victim(self, batch: ScheduledBatch) -> Sequence:
        scheduled = {s.seq_id for s in batch.seqs}
        for seq in reversed(self.running):
            if seq.seq_id not in scheduled:
                return seq
        raise RuntimeError("KV cache too small for even one sequence of this batch; raise num_gpu_blocks")

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self._reset(seq)

    def _reset(self, seq: Sequence) -> None:
        """Waits again, to be recomputed from its tokens."""
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        self.add(seq)

    def _free(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        self.relay(seq)
        for item in seq.request.mm_items:
            self.encoder_cache.release(item.content_hash, seq.seq_id)

    def relay(self, seq: Sequence) -> None:
        """Its runner row is dropped before the next step: it is sent again (ScheduledStep.new) when it runs."""
        if seq.on_runner:
            seq.on_runner = False
            self.relaid.append(seq.seq_id)

    def requests_in(self, batch: ScheduledBatch) -> set[Request]:
        """The batch's requests, and those whose forked blocks this step was to copy."""
        copied_to = {dst for _, dst in batch.step.block_copies}
        forks = [seq for seq in self.running if copied_to.intersection(seq.block_table)]
        return {seq.request for seq in batch.seqs + forks}

    def launched(self, batch: ScheduledBatch) -> None:
        """The batch is queued on the device: its tokens count as computed from now on (the next step, scheduled
        before this one is recorded under async scheduling, starts after them), and a sequence whose every token
        is computed has a sample on its way (`num_pending`, until the engine records it)."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == len(seq.token_ids) + seq.num_pending:  # (num_tokens, spelled out)
                seq.num_pending += 1

    def step_done(self, batch: ScheduledBatch) -> None:
        """Records that the batch's KV is written: caches full blocks, drops images the sequences are past. A block
        that fills in a later step scheduled before this one is recorded (async scheduling) is cached then."""
        block_size, caching = self.blocks.block_size, self.blocks.enable_prefix_caching
        for seq in batch.filling:
            if seq.status == SequenceStatus.FINISHED:  # aborted while its step ran: its blocks are gone
                continue
            if caching and seq.num_computed_tokens // block_size > seq.num_registered_blocks:  # a block filled up
                request = seq.request
                extend_block_hashes(seq.block_hashes, seq.token_ids, block_size, request.mm_spans, request.hash_salt)
                seq.num_registered_blocks = self.blocks.mark_computed(
                    seq.block_table, seq.block_hashes, seq.num_computed_tokens, seq.num_registered_blocks
                )
            for item in seq.request.mm_items:
                if item.end <= seq.num_computed_tokens:
                    self.encoder_cache.release(item.content_hash, seq.seq_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` continues from `parent`'s prefilled prompt, sharing its KV blocks."""
        child.block_table, copy = self.blocks.fork(parent.block_table, parent.num_computed_tokens)
        if copy is not None:
            self.pending_copies.append(copy)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks
        child.status = SequenceStatus.RUNNING
        bisect.insort(self.running, child, key=lambda s: s.order)

    def finish(self, seq: Sequence) -> None:
        if seq.status == SequenceStatus.FINISHED:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.request.num_finished_sequences += 1
        if seq.request.finished:
            self.cleared(seq.request)
