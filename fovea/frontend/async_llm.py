"""The engine as a server uses it: the engine steps in its own process while asyncio callers add, stream and
abort requests from this one.

`generate()` prepares the request here, in a small pool of worker threads (chat template, tokenization, image
decoding and resizing; one job per API request, so a request with many prompts takes one thread, not all), then
ships the ready RequestInput to the engine process and yields its outputs as they come back. Leaving the iteration
early (a client disconnects) aborts the request, which frees its KV blocks.

Failures stay as small as they can: a request the engine refuses raises ValueError in its own stream; a request
a step fails raises RequestFailed in its stream; if the engine process dies, every stream in flight on it gets
EngineDeadError and a new process is started (at most `max_restarts` in `RESTART_WINDOW_S`). Callers see short
messages; tracebacks go to the log.

With data_parallel_size N there are N engine processes (replicas, each tensor_parallel_size GPUs): a request
goes to the live one with the fewest requests in flight (or, with images, to the one that encoded them last, while
it is not much busier: pick_replica) and the stats are summed. A replica that dies (with Ray,
also because its node was lost) fails only its own streams and is started again under the same budget while the
others serve (503 while none does). Only when no replica can be started again is `on_fatal` called, so that the
server can exit instead of answering 503 forever.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable

import torch

from fovea.config.engine import EngineConfig
from fovea.core.messages import (
    AbortRequests,
    FromEngine,
    HeldRequests,
    Rejected,
    RemoveLoRA,
    RequestsFailed,
    ResetCache,
    StepOutputs,
    ToEngine,
)
from fovea.core.request import LoRARequest, RequestDelta, RequestInput, RequestOutput
from fovea.core.sampling_params import RequestOutputKind, SamplingParams, default_sampling_params
from fovea.core.stats import EngineStats, combine
from fovea.frontend.beam_search import BeamSearch, served_beam_search
from fovea.frontend.engine_process import EngineProcess
from fovea.frontend.grammar_checks import GrammarChecks
from fovea.frontend.input_processor import InputProcessor
from fovea.frontend.outputs import LogprobEntries, OutputAssembler, joined
from fovea.frontend.replica_routing import pick_replica
from fovea.multimodal.image_workers import ImageWorkers, default_workers, release_shared
from fovea.multimodal.prompt import ChatOptions, load_tokenizer

logger = logging.getLogger("fovea")
RESTART_WINDOW_S = 600.0


def replica_config(config: EngineConfig, replica: int) -> EngineConfig:
    """Replica i of a data-parallel server takes GPUs i*tp .. (i+1)*tp-1; a Ray actor sees only its own GPU."""
    if config.device.type != "cuda":
        return config
    if config.distributed_executor_backend == "ray":
        return dataclasses.replace(config, device=torch.device("cuda", 0))
    if config.data_parallel_size == 1:
        return config
    return dataclasses.replace(config, device=torch.device("cuda", replica * config.tensor_parallel_size))


def load_front_end(config: EngineConfig) -> tuple[object, GrammarChecks]:
    """The tokenizer, and the checks of requests' grammars (their child process started by the first)."""
    tokenizer = load_tokenizer(config.model_dir)
    return tokenizer, GrammarChecks(tokenizer, config.model.text.vocab_size, config.model.eos_token_ids)


class EngineDeadError(RuntimeError):
    """The engine is not running (it died and is restarting, or gave up): 503."""


class RequestFailed(RuntimeError):
    """The engine hit an error while running this request (a bug or a device error): 500."""


class RequestRefused(ValueError):
    """The engine refused this request, at admission or while running it (its own settings contradict each
    other): 400, also in the middle of a stream, where any other error is the server's."""


def put_each(puts: list[tuple[str, asyncio.Queue, object]]) -> None:
    for _, outputs, item in puts:
        outputs.put_nowait(item)


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        on_stats: Callable[[EngineStats], None] | None = None,
        startup_timeout: float = 600.0,
        max_restarts: int = 3,
        prepare_threads: int | None = None,
    ):
        self._start_config, self._startup_timeout = config, startup_timeout
        # first: a bad --override-generation-config fails before anything starts
        self.default_params = default_sampling_params(
            config.model_dir, config.generation_config, config.override_generation_config
        )
        self.stats = EngineStats()
        self.on_stats = on_stats
        self.on_fatal: Callable[[], None] | None = None  # the engine cannot be brought back
        self.log_outputs = 0  # --enable-log-outputs: log each finished request's text, up to this many characters
        self.error: str | None = None  # why the engine is not serving now, in words for clients
        self.max_restarts = max_restarts
        self.restarts: list[list[float]] = [[] for _ in range(config.data_parallel_size)]  # per replica
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._assemblers: dict[str, OutputAssembler] = {}  # request id -> its outputs, made from the engine's reports
        self._ids = itertools.count()
        # Python's default pool size: decoding and resizing images release the GIL, so threads help up to the cores
        threads = prepare_threads or min(32, (os.cpu_count() or 1) + 4)
        self._prepare_pool = concurrent.futures.ThreadPoolExecutor(threads, "fovea-prepare")
        self._stopped = False
        self._replica_stats = [EngineStats() for _ in range(config.data_parallel_size)]
        self._in_flight = [0] * config.data_parallel_size  # requests per replica
        self._image_homes: collections.OrderedDict[str, int] = collections.OrderedDict()  # see pick_replica
        self._replica_of: dict[str, int] = {}  # request id -> the replica running it
        self._sent_pixels: dict[str, list] = {}  # request id -> its shared pixels, freed here if its engine dies
        # request id -> [its engine, its place among the requests sent there, whether its last output or error is
        # in its stream]: what tells a request the engine lost (_fail_forgotten)
        self._sent_as: dict[str, list] = {}
        self.replicas_down: set[int] = set()  # replicas that died: being restarted, or given up
        self.replicas_given_up: set[int] = set()  # past their restart budget, or stopped for good (fatal)
        # the front end's own start (tokenizer, decoding processes, and the grammar compiler that checks requests'
        # structured outputs, which reads the whole vocabulary) runs while the engine process starts, which leaves
        # this process waiting: seconds of every server start
        loaded = self._prepare_pool.submit(load_front_end, config)
        workers = default_workers() if config.mm_processor_workers is None else config.mm_processor_workers
        self.image_workers = ImageWorkers(workers) if workers else None  # else: decoded in the preparation pool
        # everything the engine's messages touch exists before it starts: they may come at once
        self._engines: list[EngineProcess] = []
        self.encoder_actors = None
        try:
            if config.mm_encoder_workers and config.distributed_executor_backend == "ray":
                # one set of encoder actors for all replicas, owned here: a replica's death leaves them serving
                from fovea.runner.encoder_workers import RayEncoders

                self.encoder_actors = RayEncoders.start(config, named=True)
                self._start_config = dataclasses.replace(config, mm_encoder_actors=self.encoder_actors.names)
            for replica in range(config.data_parallel_size):
                self._engines.append(self._start(replica))
        except BaseException:
            self._stop_processes()
            raise
        # runs before multiprocessing's own exit handler ends the engine process, which would look like a death
        atexit.register(self.shutdown)
        self.config = self._engines[0].config  # max_model_len may have shrunk to the KV cache
        tokenizer, self.grammar_checks = loaded.result()
        self.inputs = InputProcessor(self.config, self.image_workers, tokenizer, self.grammar_checks)
        self.tokenizer = self.inputs.tokenizer
        self._logprob_entries = LogprobEntries(self.tokenizer)  # the receiving thread's, for every request

    @classmethod
    def from_args(cls, model: str | None = None, on_stats=None, max_restarts: int = 3, **engine_args) -> AsyncLLM:
        return cls(EngineConfig.from_args(model, **engine_args), on_stats, max_restarts=max_restarts)

    def _start(self, replica: int) -> EngineProcess:
        return EngineProcess(
            replica_config(self._start_config, replica),
            lambda m: self._on_message(m, replica),
            self._on_exit,
            self._startup_timeout,
        )

    @property
    def num_requests_in_flight(self) -> int:
        """Requests sent to an engine and not yet finished or aborted (vLLM's /load)."""
        return sum(self._in_flight)

    @property
    def process(self):
        return self._engines[0].process

    @property
    def processes(self) -> list:
        return [engine.process for engine in self._engines]

    async def run_in_pool(self, fn, *args):
        """Runs front-end preparation work (templating, tokenizing, decoding images) in the bounded pool."""
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, fn, *args)

    async def generate(
        self,
        prompt=None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        messages: list[dict] | None = None,
        mm_processor_kwargs: dict | None = None,
        chat: ChatOptions | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the outputs of one request: `prompt` in any form LLM.generate takes, or chat `messages`.
        Bad input raises ValueError here, before anything reaches the engine. `priority`: vLLM's (lower runs
        first; needs --scheduling-policy priority)."""
        self._check_alive()
        arrival = time.time()  # latencies count the preparation below
        request = await self.run_in_pool(
            self.make_request,
            request_id or f"req-{next(self._ids)}",
            prompt,
            messages,
            sampling_params,
            mm_processor_kwargs,
            chat,
            arrival,
            0,
            lora_request,
            priority,
        )
        async for output in self.stream(request):
            yield output

    async def prepare_many(
        self,
        prompts: list,
        sampling_params: SamplingParams,
        request_id: str,
        mm_processor_kwargs: dict | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> list[RequestInput]:
        """Requests `{request_id}-{i}` for several prompts, prepared in one pool job; prompt i waits behind the
        first prompts of requests that arrive later (fair_rank)."""
        self._check_alive()
        arrival = time.time()

        def make_all():
            return [
                self.make_request(
                    f"{request_id}-{i}",
                    prompt,
                    None,
                    sampling_params,
                    mm_processor_kwargs,
                    None,
                    arrival,
                    i,
                    lora_request,
                    priority,
                )
                for i, prompt in enumerate(prompts)
            ]

        return await self.run_in_pool(make_all)

    def make_request(
        self,
        request_id,
        prompt,
        messages,
        params,
        mm_processor_kwargs,
        chat,
        arrival,
        fair_rank=0,
        lora=None,
        priority=0,
    ) -> RequestInput:
        """A prompt (any form LLM.generate takes) or chat `messages` made into the engine's request: the template,
        tokens, images and every admission check. Blocking: the preparation pool's work (generate, or a route's
        own pool job); `stream` sends the request it returns."""
        params = params or self.default_params
        truncate = params.truncate_prompt_tokens
        processed = (
            self.inputs.process_chat(messages, mm_processor_kwargs, chat, truncate)
            if messages is not None
            else self.inputs.process(prompt, mm_processor_kwargs, truncate)
        )
        return self.inputs.make_request(request_id, processed, params, arrival, fair_rank, lora, priority)

    async def stream(self, request: RequestInput) -> AsyncIterator[RequestOutput]:
        """Sends a prepared request to the engine and yields its outputs; leaving early aborts it. A beam search
        yields its one final output."""
        if request.params.use_beam_search:
            output = await served_beam_search(
                BeamSearch(request, self.config.max_model_len, lend_pixels=True), self._stream, self.tokenizer
            )
            if self.log_outputs:
                self._log_outputs(request.request_id, [(o.index, o.finish_reason, o.text) for o in output.outputs])
            yield output
            return
        async for output in self._stream(request):
            yield output

    async def _stream(self, request: RequestInput) -> AsyncIterator[RequestOutput]:
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        outputs: asyncio.Queue = asyncio.Queue()
        self._assemblers[request_id] = OutputAssembler(self.tokenizer, request, self._logprob_entries)
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        finished = False
        live = [r for r in range(len(self._engines)) if r not in self.replicas_down] or [0]  # none: _check_alive
        hashes = [item.content_hash for item in request.mm_items] if len(self._engines) > 1 else []
        replica = pick_replica(live, self._in_flight, self._image_homes, hashes)
        self._replica_of[request_id] = replica
        self._in_flight[replica] += 1
        engine = self._engines[replica]
        try:
            # in this order: a death noticed before the registration makes the check fail, one after it reaches
            # this stream; and the request goes to the engine that is current after the check
            self._check_alive()
            engine = self._engines[replica]
            if request.release_unsent is not None:  # its shared pixels are the engine's to free now
                _, _, (self._sent_pixels[request_id],), _ = request.release_unsent.detach()
                request.release_unsent = None
            # registered first, its place unknown (never counted as lost) until the send has one: an answer that
            # comes before `add` returns must find it
            sent = self._sent_as[request_id] = [engine, math.inf, False]
            sent[1] = engine.add(request)
            incremental, held = request.params.output_kind == RequestOutputKind.DELTA, None
            while not finished:
                item = await outputs.get()
                if not isinstance(item, BaseException) and not outputs.empty():  # this reader fell behind
                    queued = [item]
                    while not outputs.empty():
                        later = outputs.get_nowait()
                        if isinstance(later, BaseException):
                            held = later  # raised once what came before it is out
                            break
                        queued.append(later)
                    item = joined(queued, incremental)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if finished and self.log_outputs and request.params.detokenize:
                    samples = self._assemblers[request_id].samples
                    self._log_outputs(
                        request_id, [(o.index, o.finish_reason, samples[o.index].text) for o in item.outputs]
                    )
                yield item
                if held is not None and not finished:
                    raise held
        finally:
            self._in_flight[replica] -= 1
            self._streams.pop(request_id, None)
            self._assemblers.pop(request_id, None)
            self._replica_of.pop(request_id, None)
            self._sent_pixels.pop(request_id, None)
            self._sent_as.pop(request_id, None)
            if not finished:
                engine.send(AbortRequests([request_id]))  # harmless if the engine never had it

    def _log_outputs(self, request_id: str, texts: list[tuple[int, str | None, str]]) -> None:
        """--enable-log-outputs: each sample's (index, finish reason, whole text), up to log_outputs characters."""
        for index, finish, text in texts:
            logger.info("request %s output %d (%s): %r", request_id, index, finish, text[: self.log_outputs])

    def tell_engines(self, message: ToEngine) -> None:
        """A command for every engine, taken between its steps (core/messages.py)."""
        for engine in self._engines:
            engine.send(message)

    def abort(self, request_id: str) -> None:
        self.tell_engines(AbortRequests([request_id]))

    def remove_lora(self, lora_int_id: int) -> None:
        """An unloaded adapter: every engine frees its weights once its requests are done."""
        self.tell_engines(RemoveLoRA(lora_int_id))

    def reset_cache(self, kind: str) -> None:
        """ "prefix": every engine forgets its cached KV blocks after its current step (not while requests hold
        blocks); "mm": the decoded images kept here and the encoder outputs no running request needs."""
        if kind == "mm" and self.inputs.processor_cache is not None:
            self.inputs.processor_cache.clear()
        self.tell_engines(ResetCache(kind))

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(self.error)

    def shutdown(self) -> None:
        """Aborts what is running and stops the engine process."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_processes()
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)
        if hasattr(self, "grammar_checks"):
            self.grammar_checks.close()

    def _stop_processes(self) -> None:
        for engine in self._engines:
            engine.stop()
        if self.encoder_actors is not None:
            self.encoder_actors.close()
        if self.image_workers is not None:
            self.image_workers.close()

    # ------------------------------------------------------------------- messages from the engine process

    def _on_message(self, message: FromEngine, replica: int = 0) -> None:
        match message:
            case StepOutputs(outputs, stats, held):
                self._replica_stats[replica] = stats
                self.stats = combine(self._replica_stats, stats.events) if len(self._replica_stats) > 1 else stats
                ready = []
                for delta in map(RequestDelta._make, outputs):  # detokenized here: not in the engine's step loop
                    assembler = self._assemblers.get(delta.request_id)
                    if assembler is not None:
                        try:
                            ready.append((delta.request_id, assembler(delta)))
                        except Exception as error:  # noqa: BLE001 - a bug met by this request's output alone
                            ready.append((delta.request_id, self._output_failed(delta.request_id, error)))
                self._deliver_all(ready)
                if held is not None:
                    self._fail_forgotten(replica, held)
                if self.on_stats is not None:
                    try:
                        self.on_stats(self.stats)
                    except Exception:  # noqa: BLE001 - metrics must never stop the outputs
                        logger.exception("the stats callback failed")
            case Rejected(request_id, reason):
                self._deliver(request_id, RequestRefused(reason))
            case RequestsFailed(request_ids, reason):
                for request_id in request_ids:
                    self._deliver(
                        request_id,
                        RequestFailed(f"the engine failed while running this request ({reason}); see the server log"),
                    )

    def _fail_forgotten(self, replica: int, held: HeldRequests) -> None:
        """A request the engine had read, does not hold and never answered is one it lost (a bug): its client
        gets an error now instead of waiting until it gives up."""
        engine = self._engines[replica]
        forgotten = [
            request_id
            for request_id, (owner, place, answered) in list(self._sent_as.items())
            if owner is engine and place <= held.requests_read and not answered and request_id not in held.request_ids
        ]
        if forgotten:
            logger.error("the engine lost requests %s, never answered (a bug): failing them", forgotten)
            error = RequestFailed("the engine lost this request (a bug); see the server log")
            self._deliver_all([(request_id, error) for request_id in forgotten])

    def _output_failed(self, request_id: str, error: Exception) -> RequestFailed:
        """What the stream of a request whose output could not be made gets (its stream's end aborts it in the
        engine); the others of the step get theirs."""
        logger.error("making the output of request %s failed", request_id, exc_info=error)
        self._assemblers.pop(request_id, None)  # its later reports are dropped
        return RequestFailed(f"making this request's output failed ({type(error).__name__}: {error}); see the log")

    def _on_exit(self, engine: EngineProcess, reason: str, fatal: bool = False) -> None:
        """Runs in the dead engine's receive thread: fails the streams in flight on it, then starts it again
        (not after a fatal stop, nor past its budget). Its requests are not retried elsewhere: the engine may have
        run them in part, and their streams began."""
        if engine not in self._engines or self._stopped:
            return
        replica = self._engines.index(engine)
        name = "the engine process" if len(self._engines) == 1 else f"data-parallel replica {replica}"
        logger.error("%s stopped: %s", name, reason)
        self.replicas_down.add(replica)
        if len(self.replicas_down) == len(self._engines):
            self.error = f"{name} stopped unexpectedly and is restarting; retry shortly"
        others = "" if len(self._engines) == 1 else " (its process or host was lost); the other replicas serve: retry"
        error = EngineDeadError(f"{name} stopped unexpectedly{others}; this request was not completed")
        for request_id, owner in list(self._replica_of.items()):
            if owner == replica:
                release_shared(self._sent_pixels.pop(request_id, []))  # those it had not taken yet are ours again
                self._deliver(request_id, error)
        self._on_message(StepOutputs([], EngineStats(serving=False)), replica)  # nothing runs there now
        now = time.monotonic()
        self.restarts[replica] = [t for t in self.restarts[replica] if now - t < RESTART_WINDOW_S]
        if fatal or len(self.restarts[replica]) >= self.max_restarts:
            why = reason if fatal else f"it stopped {len(self.restarts[replica]) + 1} times in {RESTART_WINDOW_S:.0f} s"
            return self._stay_down(replica, f"{name} is not restarted: {why}")
        self.restarts[replica].append(now)
        try:
            engine = self._start(replica)
        except Exception:  # noqa: BLE001 - logged; the others may serve
            logger.exception("%s could not be restarted", name)
            return self._stay_down(replica, f"{name} could not be restarted")
        if self._stopped:  # shut down while the new engine was starting
            return engine.stop()
        self._engines[replica] = engine
        self.replicas_down.discard(replica)
        self.error = None
        self._on_message(StepOutputs([], EngineStats()), replica)  # its gauges: serving, idle
        restarts = len(self.restarts[replica])
        logger.warning("%s restarted (%d of at most %d in %.0f s)", name, restarts, self.max_restarts, RESTART_WINDOW_S)

    def _stay_down(self, replica: int, why: str) -> None:
        """The server exits once no replica can serve."""
        self.replicas_given_up.add(replica)
        if len(self.replicas_given_up) == len(self._engines):
            return self._give_up(why)
        logger.error("%s; the other replicas serve", why)

    def _give_up(self, why: str) -> None:
        logger.error("%s; giving up", why)
        self.error = f"the engine is not running ({why}); the server is shutting down"
        if self.on_fatal is not None:
            self.on_fatal()

    def _deliver(self, request_id: str, item) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """Puts each item in its request's stream: one wake-up per event loop, not one per item (a step's 256
        streamed outputs made 256 writes to the loop's wake-up socket: a third of this thread's time)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            sent = self._sent_as.get(request_id)
            if sent is not None and (isinstance(item, BaseException) or item.finished):
                sent[2] = True
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((request_id, stream[1], item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(put_each, puts)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
                for request_id, _, _ in puts:
                    self._streams.pop(request_id, None)
