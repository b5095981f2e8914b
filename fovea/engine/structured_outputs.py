"""Structured outputs: a request's JSON schema, regex, choice or grammar becomes a token mask at every step.

Built on llguidance (Microsoft's grammar engine, one of vLLM's two): a wheel with no dependencies (xgrammar needs
torch, triton and apache-tvm-ffi), and on this CPU the cheaper per step at batch 256 with a 3-field JSON schema
(`python benchmarks/grammar_cpu.py`): masks filled and tokens consumed in 39.6 ms vs xgrammar's 66.9 ms (mean;
xgrammar's median step is cheaper, its string steps are not), masks applied to the logits in 21.7 ms vs 223.8 ms.
Each sample of a request gets its own matcher; the sampler masks its logits row before drawing, then the matcher
consumes the token drawn. JSON is generated compact (no free whitespace), so a model cannot wander in blanks.
"""

from __future__ import annotations

import concurrent.futures
import copy
import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from fovea.core.sampling_params import WHERE, StructuredOutputsParams

logger = logging.getLogger("fovea")

# A grammar may take long to build (a crafted schema: tens of seconds); no request waits longer for its own
COMPILE_TIMEOUT_S = float(os.environ.get("FOVEA_GRAMMAR_TIMEOUT", "10"))
# Compiled matchers kept for requests that repeat a grammar, least recently used first out. Each holds llguidance's
# compiled grammar (a small JSON schema's: ~130 KB), so the count bounds the engine's memory: up to 1,024 kept were
# half the engine's growth over an hour of the soak's traffic (benchmarks/README "Memory under mixed traffic")
COMPILED_KEPT = 64


def too_slow_error() -> ValueError:
    return ValueError(f"{WHERE}: the grammar did not compile within {COMPILE_TIMEOUT_S:g} s (FOVEA_GRAMMAR_TIMEOUT)")


@dataclass
class GrammarBuild:
    """Matchers being built in the compiler's threads. Their time limit counts from the build's start, not from
    the request's arrival: six large grammars at once on a loaded 2-core machine left the last one, queued behind
    the others, under half its limit."""

    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    started: threading.Event = field(default_factory=threading.Event)
    start_time: float = 0.0

    def start(self) -> None:
        self.start_time = time.monotonic()
        self.started.set()

    def overran(self) -> bool:
        return self.started.is_set() and time.monotonic() - self.start_time > COMPILE_TIMEOUT_S


def tokenizer_json(tokenizer) -> str:
    """A transformers fast tokenizer as JSON, without the padding and truncation llguidance refuses (turned off on
    a copy only when set: copying Qwen's vocabulary costs 0.9 s)."""
    backend = tokenizer.backend_tokenizer
    if backend.padding is not None or backend.truncation is not None:
        backend = copy.deepcopy(backend)
        backend.no_padding()
        backend.no_truncation()
    return backend.to_str()


_LL_TOKENIZERS: OrderedDict[tuple, object] = OrderedDict()  # (the JSON's digest, vocabulary, EOS ids) -> tokenizer


def ll_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
    """llguidance's view of a fast tokenizer's JSON (what llguidance.hf.from_tokenizer makes, less its copy of the
    tokenizer and its import of transformers). Made once per process for each vocabulary: reading Qwen's takes about
    a second, and a process may run several engines (offline LLMs, evaluations); llguidance's tokenizer is
    read-only, shared by every matcher made from it."""
    import llguidance

    key = (hashlib.sha1(tokenizer_json.encode()).hexdigest(), vocab_size, tuple(eos_token_ids))
    if key not in _LL_TOKENIZERS:
        _LL_TOKENIZERS[key] = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        if len(_LL_TOKENIZERS) > 4:  # a process going through many checkpoints keeps the latest few
            _LL_TOKENIZERS.popitem(last=False)
    return _LL_TOKENIZERS[key]


def compile_matcher(tokenizer, params: StructuredOutputsParams):
    """A matcher for the request's grammar; ValueError with llguidance's reason if it does not compile."""
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer, params.grammar_text())
    if matcher.is_error():
        raise ValueError(f"{WHERE} does not compile: {matcher.get_error().strip()[:1000]}")
    return matcher


class GrammarCompiler:
    """Turns requests into matchers for one tokenizer; a grammar that does not compile raises ValueError with
    llguidance's reason. A grammar compiles once (about 0.7 ms for a small schema) while it is among the
    COMPILED_KEPT last used; a request's samples get copies of that matcher (microseconds), so admitting requests
    between steps stays cheap. Building runs in two threads of its own (llguidance releases the GIL meanwhile):
    `check` waits at most COMPILE_TIMEOUT_S, and a grammar that overran is refused at once the next time."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer = ll_tokenizer(tokenizer_json(tokenizer), vocab_size, eos_token_ids)
        self._compiled: OrderedDict[tuple, object] = OrderedDict()  # request key -> a fresh matcher, known to compile
        self._kept_lock = threading.Lock()
        self._too_slow: set[tuple] = set()  # request keys whose grammar overran the time limit
        self._builders = concurrent.futures.ThreadPoolExecutor(2, "grammar-build")

    def _fresh(self, params: StructuredOutputsParams):
        key = params.key()
        with self._kept_lock:  # both builder threads come here
            matcher = self._compiled.get(key)
            if matcher is not None:
                self._compiled.move_to_end(key)
                return matcher
        matcher = compile_matcher(self.tokenizer, params)  # outside the lock: it may take long
        with self._kept_lock:
            self._compiled[key] = matcher
            if len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return matcher

    def check(self, params: StructuredOutputsParams) -> None:
        """Raises ValueError unless the grammar compiles within COMPILE_TIMEOUT_S of its build's start (the build
        itself runs on past it: llguidance cannot be interrupted; that grammar is refused at once from then on)."""
        key = params.key()
        if key not in self._too_slow:
            build = self.build(params)
            build.started.wait()  # behind the builds ahead of it, each refused once past its own limit
            try:
                build.future.result(timeout=COMPILE_TIMEOUT_S)
                return
            except concurrent.futures.TimeoutError:
                if len(self._too_slow) > 1024:
                    self._too_slow.clear()
                self._too_slow.add(key)
        raise too_slow_error()

    def build(self, params: StructuredOutputsParams, copies: int = 1) -> GrammarBuild:
        """`copies` fresh matchers, built in the builders' threads (the future raises ValueError if the grammar
        does not compile)."""
        build = GrammarBuild()

        def run():
            build.start()
            return [self.matcher(params) for _ in range(copies)]

        build.future = self._builders.submit(run)
        return build

    def matcher(self, params: StructuredOutputsParams):
        return self._fresh(params).deep_copy()


class Grammars:
    """One tokenizer's grammar engine, shared by whoever needs it in a process: the compiler, made on first use
    (it reads the whole vocabulary: seconds), and the step that applies masks to logits on `device`, which
    llguidance compiles with torch.compile on its first use (`warm_up`: `fovea serve` warms up before it answers,
    an offline engine on its first structured request)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, device):
        self.tokenizer, self.vocab_size, self.eos_token_ids, self.device = tokenizer, vocab_size, eos_token_ids, device
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()  # the preparation pool's threads would each build one (seconds of the GIL)
        self._masks_ready = False

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, list(self.eos_token_ids))
        return self._compiler

    def check(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        """Raises ValueError unless the grammar compiles in time; `params` as they are (as the front end's checks
        return them, converted where they convert)."""
        self.compiler.check(params)
        return params

    def warm_up(self) -> None:
        from fovea.runner.grammar_masks import warm_up_masks

        if self._masks_ready:
            return
        start = time.perf_counter()
        logger.info("structured outputs: starting the grammar engine (once; can take seconds)")
        warm_up_masks(self.compiler, self.vocab_size, self.device)
        self._masks_ready = True
        logger.info("structured outputs: grammar engine ready in %.1f s", time.perf_counter() - start)
