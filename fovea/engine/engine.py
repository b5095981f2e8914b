"""The engine: requests in, one batched step at a time, outputs back.

step_deltas() = schedule -> run the model -> for each sampled token: record it (forking n > 1 requests after
their prompt), check stop conditions (text only for requests with stop strings or a reasoning end tag), free
finished sequences -> report what the callers asked for (RequestDelta tuples: ids and finish, no text). The front
end makes the RequestOutputs of them (frontend/outputs.py); step() does it here for an in-process caller (LLM),
with the assembler it was given.
A step that raises fails only the requests it ran: one alone (StepFailed names it); several are recomputed, each in
steps of its own (Scheduler.isolate), so that only the one that fails again alone is failed. A request whose
logits the model gave as NaN or infinity fails alone. The engine stays consistent and goes on.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections.abc import Callable

import torch

from fovea.config.engine import EngineConfig
from fovea.core.request import RequestDelta, RequestInput, RequestOutput
from fovea.core.sampling_params import WHERE
from fovea.core.stats import EngineStats, LatencyEvents, record_token_time
from fovea.engine.block_manager import BlockManager
from fovea.engine.encoder_cache import EncoderCache
from fovea.engine.outputs import (
    IncrementalDetokenizer,
    append_token,
    record_prompt_logprobs,
    report_due,
    request_delta,
)
from fovea.engine.scheduler import Scheduler
from fovea.engine.sequence import Request, ScheduledBatch, Sequence, SequenceStatus
from fovea.engine.structured_outputs import GrammarBuild, Grammars, too_slow_error
from fovea.engine.tokenizer import load_engine_tokenizer
from fovea.runner.image_encoder import ImageEncoder
from fovea.runner.memory_profile import fit_max_model_len
from fovea.runner.model_runner import ModelRunner, StepOutput
from fovea.runner.tp_workers import RanksOutOfStep, start_workers

logger = logging.getLogger("fovea")
IDLE_WAIT_S = 0.01  # a step with nothing to run but images being encoded waits this long for them
MAX_FAILED_STEPS = 3  # a request in this many failed steps fails, even if it never failed alone
NONFINITE = ("the model's logits for this request were NaN or infinite", False)  # (why, the client's fault)
# a request's settings that can leave its grammar no token: the tokens they ban may be all the grammar allows
GRAMMAR_RIVALS = ("allowed_token_ids", "bad_words", "min_tokens")


def grammar_broken(seq: Sequence, grammar) -> tuple[str, bool]:
    """Why a sampled token broke the request's grammar, and whether the request is to blame: its own settings
    left no token the grammar allows (the sampler then draws from nothing), or, with none of those, a fault of
    ours."""
    params = seq.params
    rivals = [name for name in GRAMMAR_RIVALS if getattr(params, name)]
    if rivals:
        after = seq.num_output_tokens - 1  # (the token that broke it is appended)
        rivals_allow = f"{', '.join(rivals)} allow after {after} output token(s)"
        return f"{WHERE}: no token is left that both the grammar and {rivals_allow}: they contradict each other", True
    return f"{WHERE}: the output cannot follow the grammar ({grammar.get_error()[:300]})", False


class StepFailed(RuntimeError):
    """Requests failed, by a step that raised or by their own images, grammar or row, and were freed (the cause is
    chained); the engine goes on. `refused`: the requests' own settings contradict each other (the client's fault,
    a 4xx), not a failure."""

    def __init__(self, request_ids: list[str], message: str, refused: bool = False):
        super().__init__(message)
        self.request_ids, self.refused = request_ids, refused


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner | None = None,
        on_worker_failure: Callable[[Exception], None] | None = None,
        tokenizer=None,
        assembler: Callable | None = None,
    ):
        """`tokenizer`: a front end's in the same process (transformers'), else the engine loads its own.
        `assembler`: an in-process caller's (LLM) maker of RequestOutputs, frontend/outputs.py's OutputAssembler:
        `step` returns outputs made with it. An engine process sends `step_deltas` to its front end instead."""
        self.config = config
        self.workers = None  # tensor-parallel ranks 1..N-1
        if runner is None and config.distributed:
            self.workers = start_workers(config, on_worker_failure)
        try:
            self.runner = runner or ModelRunner(config, self.workers.parallel if self.workers else None)
        except BaseException as error:
            self.close()
            if self.workers is not None and self.workers.died():
                raise self.workers.stopped() from error
            raise
        # max_model_len lowered to what the KV cache holds, when it was the model's
        self.config = config = fit_max_model_len(
            config, self.runner.num_blocks * config.block_size, self.runner.kv_cache_bytes
        )
        # the engine's own needs: the text its checks read (stop strings, a reasoning end tag) and the grammars of
        # structured outputs; the front end (AsyncLLM, or LLM in this process) has the input processor and makes
        # the outputs' text and logprob entries
        self.tokenizer = tokenizer or load_engine_tokenizer(config.model_dir)
        self.grammars = Grammars(
            self.tokenizer, config.model.text.vocab_size, config.model.eos_token_ids, config.device
        )
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.encoder_cache = EncoderCache(config.encoder_cache_size)
        self.scheduler = Scheduler(config, self.blocks, self.encoder_cache)
        # on the CPU a step waiting for images has this thread encode half of them: not under tensor parallelism
        # (ranks encode in step with rank 0's encoder thread) nor LoRA (adapters are switched around the tower)
        helps = config.device.type == "cpu" and self.workers is None and not config.enable_lora
        if config.mm_encoder_workers:  # the tower in processes or Ray actors of its own: one thread waits on each
            from fovea.runner.encoder_workers import RemoteTower

            self.remote_tower = RemoteTower(config)
            workers = config.mm_encoder_workers
            self.image_encoder = ImageEncoder(self.remote_tower, config.device, shares=workers, threads=workers)
        else:
            self.image_encoder = ImageEncoder(self.runner.encode_images, config.device, shares=2 if helps else 1)
        self.requests: dict[str, Request] = {}
        self.compiling: list[tuple[Request, GrammarBuild]] = []  # requests whose matchers are being built
        self.num_requests_added = 0
        self.finished_outputs: list[tuple] = []  # aborts (RequestDelta tuples), reported with the next step
        self.unloaded_loras: set[int] = set()  # adapters whose weights every rank drops once no request uses them
        self.assembler = assembler
        self.assemblers: dict[str, Callable] = {}  # by request id, with an assembler
        self._seq_ids = itertools.count()
        self.events: LatencyEvents | None = None  # recorded once someone asks for stats()
        self.in_flight: tuple[ScheduledBatch, StepOutput] | None = None  # queued on the device, not yet recorded
        # failed requests (a step, an image, a grammar, a row), raised one per step_deltas call after its outputs:
        # each failure must reach its callers, also when several come in one call and nothing else runs
        self.failures: list[StepFailed] = []
        # on a GPU the step's kernels run while the host goes on: the host builds the outputs of one step while the
        # device computes the next. Under tensor parallelism too: the other ranks queue each step's kernels as
        # soon as rank 0 sends it, behind the one their devices still run.
        overlap = config.overlap_outputs
        self.overlap = config.device.type == "cuda" if overlap is None else overlap
        self.overlap |= config.schedules_ahead  # scheduling ahead needs a step in flight between calls

    # ------------------------------------------------------------------------------------------- requests

    def add_request(self, input: RequestInput) -> None:
        input.take_shared_pixels()  # first: pixels in shared memory are freed whatever happens next
        request = Request(input)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        if request.params.use_beam_search:
            raise ValueError("beam search runs in the front end (LLM, the server), not as one engine request")
        if request.lora is not None and not self.config.enable_lora:
            raise ValueError(f"request {request.request_id} asks for a LoRA adapter, but LoRA is off (enable_lora)")
        # the front end checked the parameters (InputProcessor.check_params); the KV cache's size is known here only
        blocks = self.blocks.blocks_needed(len(request.prompt_token_ids) + 1) + request.params.n - 1
        if blocks > self.blocks.num_blocks:
            raise ValueError(
                f"the prompt with n={request.params.n} needs {blocks} KV blocks but the cache has "
                f"{self.blocks.num_blocks}"
            )
        # One RNG per sample when seeded (sample i draws from seed + i), so its tokens do not depend on the batch.
        request.generators = [
            None
            if request.params.seed is None
            else torch.Generator(device=self.config.device).manual_seed(request.params.seed + i)
            for i in range(request.params.n)
        ]
        self.requests[request.request_id] = request
        if self.assembler is not None:
            self.assemblers[request.request_id] = self.assembler(self.tokenizer, input)
        self.num_requests_added += 1
        if request.params.structured_outputs is not None:  # one grammar state per sample, built off the step loop
            self.grammars.warm_up()
            build = self.grammars.compiler.build(request.params.structured_outputs, request.params.n)
            self.compiling.append((request, build))
            return  # scheduled once its grammar is built (_admit_compiled)
        self._schedule_first_sample(request)

    def _admit_compiled(self) -> None:
        """Requests whose grammars are built go to the scheduler; those whose grammar failed, or overran the time
        limit, fail alone. A crafted schema costs its own request time, not everyone's steps."""
        for entry in list(self.compiling):
            request, build = entry
            if request.request_id not in self.requests:  # aborted while its grammar was being built
                self.compiling.remove(entry)
            elif build.future.done():
                self.compiling.remove(entry)
                try:
                    request.grammars = build.future.result()
                except ValueError as error:
                    self._fail_later({request}, error)
                    continue
                self._schedule_first_sample(request)
            elif build.overran():
                self.compiling.remove(entry)
                self._fail_later({request}, too_slow_error())

    def _schedule_first_sample(self, request: Request) -> None:
        seq = self._new_sequence(request, 0)
        request.sequences.append(seq)
        self.scheduler.add(seq)

    def _new_sequence(self, request: Request, index: int) -> Sequence:
        """Sample `index` of `request`, listed in the request by the caller once the scheduler holds it."""
        seq = Sequence(next(self._seq_ids), request, index, self.config.max_model_len)
        params = request.params
        if params.detokenize and (params.stop_strings or request.input.grammar_after is not None):  # text checked
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                request.params.skip_special_tokens,
                request.params.spaces_between_special_tokens,
            )
        return seq

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            request.aborted = True
            for seq in request.sequences:
                if seq.status != SequenceStatus.FINISHED:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)  # its KV blocks are free from now on
            request.metrics.finished_time = time.time()
            self.finished_outputs.append(request_delta(request, final=True))
            self._retire(request)

    def remove_lora(self, lora_int_id: int) -> None:
        """An adapter the server unloaded: its weights go with the first step after its last request (they travel
        with a step so that every tensor-parallel rank drops them; an idle engine holds them until the next)."""
        self.unloaded_loras.add(lora_int_id)

    def _droppable_loras(self) -> list[int]:
        in_use = {request.lora.lora_int_id for request in self.requests.values() if request.lora is not None}
        dropped = self.unloaded_loras - in_use
        self.unloaded_loras -= dropped
        return sorted(dropped)

    def close(self) -> None:
        """Stops the image encoder's thread and the tensor-parallel workers."""
        if hasattr(self, "image_encoder"):
            self.image_encoder.close()
        if hasattr(self, "remote_tower"):
            self.remote_tower.close()
        if self.workers is not None:
            self.workers.close()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.finished_outputs or self.failures) or self.in_flight is not None

    def held_request_ids(self) -> set[str]:
        """The requests this engine has not answered yet: running, their last report or their failure pending."""
        failing = (request_id for failure in self.failures for request_id in failure.request_ids)
        return {*self.requests, *(delta[0] for delta in self.finished_outputs), *failing}

    # ----------------------------------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """`step_deltas`, made into the outputs callers see (an engine given an `assembler`)."""
        if self.assembler is None:
            raise RuntimeError("this engine was given no assembler: its caller reads step_deltas()")
        outputs = []
        for delta in map(RequestDelta._make, self.step_deltas()):
            assembler = self.assemblers.get(delta.request_id)
            if assembler is not None:
                outputs.append(assembler(delta))
                if delta.finished:
                    del self.assemblers[delta.request_id]
        return outputs

    def step_deltas(self) -> list[tuple]:
        """Queues a step on the device, records one, reports what the recorded step produced. In order (a CPU
        engine): queue a step, record it. Overlapped (a GPU engine): record the step in flight, queue the next;
        its outputs are built, and sent by the engine process, while the device computes. Ahead (async
        scheduling): queue the next step before the one in flight is back (its new tokens are read from that
        step's samples on the device), then record the one in flight."""
        if self.workers is not None:
            self.workers.check()
        outputs, self.finished_outputs = self.finished_outputs, []
        touched: set[Request] = set()
        previous, self.in_flight = self.in_flight, None
        try:
            if previous is not None and self._schedules_ahead(previous):
                try:
                    self._launch(ahead=previous)
                finally:
                    touched = self._record(previous)
            elif self.overlap:
                touched = self._record(previous)
                self._launch()
            else:
                self._launch()
                launched, self.in_flight = self.in_flight, None
                touched = self._record(launched)
        except BaseException:
            self.finished_outputs = outputs + self._report(touched) + self.finished_outputs
            raise
        outputs += self._report(touched)
        if self.failures:  # the others' outputs come with the next step
            self.finished_outputs = outputs + self.finished_outputs
            raise self.failures.pop(0)
        return outputs

    def _schedules_ahead(self, previous: tuple[ScheduledBatch, StepOutput]) -> bool:
        """Whether the next step may be scheduled before `previous` is back: not when the host must see one of
        its samples first (a grammar consumes it, min_tokens counts it, a bad word's last token is banned after it,
        a request forks after it)."""
        if not self.config.schedules_ahead:
            return False
        batch, result = previous
        for index, fork in result.row_owners():
            seq = batch.seqs[index]
            request = seq.request
            if fork or request.grammars or request.reads_last_tokens or seq.params.min_tokens > seq.num_output_tokens:
                return False
        return True

    def _launch(self, ahead: tuple[ScheduledBatch, StepOutput] | None = None) -> None:
        """Schedules a step and queues it on the device (`in_flight`); with nothing to run, waits briefly for the
        images or grammars it waits for. `ahead`: the step still on the device, whose samples are tokens of
        this one."""
        self._collect_images()
        self._admit_compiled()
        batch = self.scheduler.schedule()
        if batch.step.encode:
            self.image_encoder.submit(batch.step.encode)  # encoded beside this and the next steps
        if not batch.seqs:
            if self.image_encoder.in_flight:  # everything waits for images: wait for the encoder, briefly
                self._collect_images(wait_s=IDLE_WAIT_S)
            elif self.compiling:  # everything waits for grammars: wait for one, briefly
                concurrent.futures.wait(
                    [build.future for _, build in self.compiling],
                    timeout=IDLE_WAIT_S,
                    return_when=concurrent.futures.FIRST_COMPLETED,
                )
            elif ahead is None and (self.scheduler.waiting or self.scheduler.running):
                # cannot happen after admission checks (ahead: the running ones end on a token in flight)
                stuck = (self.scheduler.running or self.scheduler.waiting)[0].request
                self._fail_later({stuck}, RuntimeError("the request cannot be scheduled even with the engine idle"))
            return
        if self.unloaded_loras:
            batch.step.dropped_loras = self._droppable_loras()
        try:
            result = self.runner.execute(batch.step, self.encoder_cache.get, None if ahead is None else ahead[1])
        except Exception as error:  # noqa: BLE001 - a bug or a device error: fail what this step ran, go on
            self._step_failed(batch, error)
            return
        self.scheduler.launched(batch)
        self.in_flight = (batch, result)

    def _record(self, launched: tuple[ScheduledBatch, StepOutput] | None) -> set[Request]:
        """The tokens of a launched step (waiting for the device), into its sequences; the requests with something
        to report."""
        if launched is None:
            return set()
        batch, result = launched
        for index, fork in result.row_owners():
            if not fork:
                batch.seqs[index].num_pending -= 1  # in token_ids from here on
        try:
            if self.events is not None:
                self.events.iteration_tokens.append(batch.num_tokens)
            self.scheduler.step_done(batch)
            record_prompt_logprobs(batch, result.prompt_logprobs)
            sampled, to_report = self._record_samples(batch, result)
        except Exception as error:  # noqa: BLE001
            self._step_failed(batch, error)
            return self.scheduler.requests_in(batch)  # those that ended before it failed are reported
        if result.plan.owners and len(sampled) == 1:
            self.scheduler.cleared(next(iter(sampled)))
        return to_report

    def _step_failed(self, batch: ScheduledBatch, error: Exception) -> None:
        """A failed step's requests go on alone (Scheduler.isolate); the one request it ran, or those in
        MAX_FAILED_STEPS failed steps, fail (`failures`)."""
        if self.workers is not None and self.workers.died():
            self.close()
            raise self.workers.stopped() from error
        self._stop_if_out_of_step(error)
        if self.config.device.type == "cuda":
            torch.cuda.synchronize(self.config.device)  # a broken device raises here: no request is to blame
        # (a step run ahead can hold rows of requests that have left the engine since: not theirs to answer for)
        requests = {
            r for r in self.scheduler.requests_in(batch) if not r.finished and self.requests.get(r.request_id) is r
        }
        for request in requests:
            request.failed_steps += 1
        if len(requests) > 1:
            logger.warning("a step of %d requests failed (%r): each runs alone now", len(requests), error)
            dropped = {r for r in requests if r.failed_steps >= MAX_FAILED_STEPS}
            self.scheduler.isolate(requests - dropped)
            requests = dropped
        self._fail_later(requests, error)

    def _stop_if_out_of_step(self, error: Exception) -> None:
        """Raises RanksOutOfStep: no step or tower run can happen on these ranks again, a new engine must start."""
        if isinstance(error, RanksOutOfStep):
            self.workers.failure = str(error)  # (not told to stop: they are not listening)
            self.close()
            raise error

    def _report(self, touched: set[Request]) -> list[tuple]:
        """The outputs callers asked for of the requests a step touched. A request failed or aborted since is
        left out: it was reported then."""
        outputs = []
        for request in touched:
            if self.requests.get(request.request_id) is not request:
                continue
            finished = request.finished
            if finished or (request.streams and report_due(request, self.config.stream_interval)):
                outputs.append(request_delta(request, final=finished))
            if finished:
                self.requests.pop(request.request_id)
                self._retire(request)
        return outputs

    def _fail(self, requests: set[Request], error: Exception, refused: bool = False) -> StepFailed:
        """Frees `requests` (finish reason "error") and forgets half-made encoder outputs."""
        if refused:
            logger.info("refusing %d request(s): %s", len(requests), error)
        else:
            logger.error("a step failed; failing its %d request(s)", len(requests), exc_info=error)
        for request in requests:
            self.requests.pop(request.request_id, None)
            self.assemblers.pop(request.request_id, None)
            for seq in request.sequences:
                if seq.status != SequenceStatus.FINISHED:
                    seq.finish_reason = "error"
                    self.scheduler.finish(seq)
            request.metrics.finished_time = time.time()
            self._retire(request)
        self.encoder_cache.drop_unfilled(keep=self.image_encoder.in_flight)
        message = str(error) if refused else f"{type(error).__name__}: {error}"[:500]
        failure = StepFailed(sorted(r.request_id for r in requests), message, refused)
        failure.__cause__ = error
        return failure

    def _fail_later(self, requests: set[Request], error: Exception, refused: bool = False) -> None:
        """Fails `requests` now; step_deltas raises it once its outputs are kept (`failures`)."""
        if requests:
            self.failures.append(self._fail(requests, error, refused))

    def _collect_images(self, wait_s: float = 0.0) -> None:
        """Puts what the encoder finished into the encoder cache; an encoding that failed fails the requests
        showing those images."""
        for result in self.image_encoder.collect(wait_s):
            if result.error is None:
                for item, rows in zip(result.items, result.embeddings):
                    self.encoder_cache.put(item.content_hash, rows)
                continue
            self._stop_if_out_of_step(result.error)
            keys = {item.content_hash for item in result.items}
            requests = {r for r in self.requests.values() if keys.intersection(i.content_hash for i in r.mm_items)}
            self._fail_later(requests, result.error)
            if not requests:  # (those that showed the image have left: its entry is nobody's)
                self.encoder_cache.drop_unfilled(keep=self.image_encoder.in_flight)

    def _record_samples(self, batch: ScheduledBatch, result: StepOutput) -> tuple[set[Request], set[Request]]:
        """The requests that sampled (looked for only while there are suspects: Scheduler.isolate), and the ones
        with something to report: finished, or asking for every step's output. Picked here, where each request is at
        hand: a later pass over 256 requests costs a cache miss each on the CPU (benchmarks/README, issue 54)."""
        to_report = set()
        if result.sampled is None:
            return set(), to_report
        sampled = self.runner.read_samples(result)
        tokens = sampled.token_ids.tolist()
        finite = sampled.finite.tolist() if sampled.finite is not None else [True] * len(tokens)
        if sampled.logprobs is not None:  # computed for the whole batch; kept only where asked
            logprobs, ranks = sampled.logprobs.tolist(), sampled.ranks.tolist()
            no_top = [[] for _ in tokens]  # every row asked for logprobs=0: no top tokens were computed
            top_ids = sampled.top_ids.tolist() if sampled.top_ids is not None else no_top
            top_values = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else no_top
        # forks first: a parent that finishes on this very token must still hold the blocks its samples share
        row_seqs = []
        for index, fork in result.row_owners():
            seq = batch.seqs[index]
            if seq.status == SequenceStatus.FINISHED:  # aborted while its step ran
                row_seqs.append(None)
                continue
            if fork:
                seq.pending_forks = 0  # (its own row, fork 0, is in this step too)
                child = self._new_sequence(seq.request, seq.index + fork)
                self.scheduler.fork(seq, child)
                seq.request.sequences.append(child)  # (only now: a fork that failed leaves no sample in no list)
                seq = child
            row_seqs.append(seq)
        now = time.time()
        # requests that fail alone, and why: logits the model gave as NaN or infinity, a grammar the output broke
        broken = {}
        if not all(finite):
            broken = {seq.request: NONFINITE for seq, ok in zip(row_seqs, finite) if seq is not None and not ok}
        events = self.events
        inter_token = events.inter_token if events is not None else None
        for row, (seq, token) in enumerate(zip(row_seqs, tokens)):
            if seq is None:
                continue
            request = seq.request
            if broken and request in broken:
                continue
            metrics, last = request.metrics, seq.last_token_time
            if last is None or metrics.first_token_time is None:  # a request's first token, or a fork's
                record_token_time(seq, now, events)
            else:  # (record_token_time's other case, spelled out: it is every decode's)
                metrics.last_token_time = seq.last_token_time = now
                if inter_token is not None:
                    inter_token.append(now - last)
            if request.streams:
                to_report.add(request)
            entry, logprob = None, 0.0
            if seq.logprobs is not None:
                logprob, k = logprobs[row], seq.params.logprobs
                # (a LogprobRow) of tuples: a request keeps one per token, and tuples of numbers leave the garbage
                # collector's passes, where lists would be walked by every full one
                entry = (token, logprob, ranks[row], tuple(top_ids[row][:k]), tuple(top_values[row][:k]))
            if seq.plain:  # most decodes: no text checks, grammar or min_tokens (append_token's checks)
                seq.token_ids.append(token)
                if entry is not None:
                    seq.cumulative_logprob += logprob
                    seq.logprobs.append(entry)
                if token in request.stop_set:
                    self._finish(seq, "stop", None if token in request.eos_token_ids else token)
                    to_report.add(request)
                elif len(seq.token_ids) >= seq.length_limit:
                    self._finish(seq, "length", None)
                    to_report.add(request)
                continue
            waiting = seq.grammar_waiting
            finished = append_token(seq, token, entry, logprob)
            if waiting and not seq.grammar_waiting:
                self.scheduler.relay(seq)  # its runner row is made again, with the grammar
            grammar = seq.request.grammars[seq.index] if seq.request.grammars and not seq.grammar_waiting else None
            if grammar is not None and grammar.is_error():  # never a silent violation
                broken[seq.request] = grammar_broken(seq, grammar)
            elif finished:
                self._finish(seq, *finished)
                to_report.add(request)
        for why, refused in dict.fromkeys(broken.values()):
            failed = {request for request, reason in broken.items() if reason == (why, refused)}
            self._fail_later(failed, ValueError(why), refused)
        sampled_requests = {seq.request for seq in row_seqs if seq is not None} if self.scheduler.suspects else set()
        return sampled_requests - broken.keys(), to_report - broken.keys()

    def _retire(self, request: Request) -> None:
        """The request has left the engine: its latency events are recorded, it is no suspect (one that failed
        before all its samples forked would stay first in line: Scheduler._turns), and the references between it
        and its samples are cut. Each points to the other; left so, the pair and all they hold (the request's
        pixels, its grammars) would wait for the cyclic garbage collector, which runs rarely in a process of this
        size: under image traffic the live heap grew by hundreds of MB in between (benchmarks/README, issue 56)."""
        if self.events is not None:
            self.events.add_finished(request)
        self.scheduler.cleared(request)
        request.sequences = []

    def stats(self) -> EngineStats:
        """The engine's state now, and the latency events since the previous call (the first call starts
        the recording)."""
        events, self.events = self.events or LatencyEvents(), LatencyEvents()
        stats = self.scheduler.stats(events, self.num_requests_added)
        if self.runner.adapters is not None:
            stats.loras_held = len(self.runner.adapters)
        return stats

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)
        if seq.request.finished:
            seq.request.metrics.finished_time = time.time()
