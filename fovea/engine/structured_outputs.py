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
import json
import os
import re
from dataclasses import dataclass

WHERE = "structured_outputs"


@dataclass(frozen=True, eq=False)
class StructuredOutputsParams:
    """vLLM's names: exactly one of json (a schema, as a dict or a JSON string), regex, choice, grammar (Lark,
    llguidance's dialect) or json_object (any JSON object)."""
    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"{WHERE} takes exactly one of json, regex, choice, grammar, json_object; got "
                             f"{given or 'none'}")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"{WHERE}.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    def key(self) -> tuple:
        """Hashable and equal for equal requests (a schema dict is not hashable)."""
        schema = self.json if not isinstance(self.json, dict) else json.dumps(self.json, sort_keys=True)
        return schema, self.regex, self.choice, self.grammar, self.json_object

    def grammar_text(self) -> str:
        """The request as an llguidance grammar."""
        from llguidance import LLMatcher

        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in self.choice))
        if self.grammar is not None:
            return LLMatcher.grammar_from_lark(self.grammar)
        schema = {"type": "object"} if self.json_object else self.json
        text = schema if isinstance(schema, str) else json.dumps(schema)
        try:
            return LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        except ValueError as error:  # not JSON at all
            raise ValueError(f"{WHERE}.json is not a JSON schema: {error}") from None


# A grammar may take long to build (a crafted schema: tens of seconds); no request waits longer for its own
COMPILE_TIMEOUT_S = float(os.environ.get("FOVEA_GRAMMAR_TIMEOUT", "10"))


class GrammarCompiler:
    """Turns requests into matchers for one tokenizer; a grammar that does not compile raises ValueError with
    llguidance's reason. Each distinct request compiles once (about 0.7 ms for a small schema); its samples get
    copies of that matcher (microseconds), so admitting requests between steps stays cheap. Building runs in two
    threads of its own (llguidance releases the GIL meanwhile): `check` waits at most COMPILE_TIMEOUT_S, and a
    grammar that overran is refused at once the next time."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._compiled: dict[tuple, object] = {}  # request key -> a fresh matcher, known to compile
        self._too_slow: set[tuple] = set()  # request keys whose grammar overran the time limit
        self._builders = concurrent.futures.ThreadPoolExecutor(2, "grammar-build")

    def _fresh(self, params: StructuredOutputsParams):
        from llguidance import LLMatcher

        key = params.key()
        matcher = self._compiled.get(key)
        if matcher is None:
            matcher = LLMatcher(self.tokenizer, params.grammar_text())
            if matcher.is_error():
                raise ValueError(f"{WHERE} does not compile: {matcher.get_error().strip()[:1000]}")
            if len(self._compiled) > 1024:  # many distinct schemas: keep the cache bounded
                self._compiled.clear()
            self._compiled[key] = matcher
        return matcher

    def check(self, params: StructuredOutputsParams) -> None:
        """Raises ValueError unless the grammar compiles within COMPILE_TIMEOUT_S (the build itself runs on past
        it: llguidance cannot be interrupted; that grammar is refused at once from then on)."""
        key = params.key()
        if key not in self._too_slow:
            try:
                self.build(params).result(timeout=COMPILE_TIMEOUT_S)
                return
            except concurrent.futures.TimeoutError:
                if len(self._too_slow) > 1024:
                    self._too_slow.clear()
                self._too_slow.add(key)
        raise ValueError(f"{WHERE}: the grammar did not compile within {COMPILE_TIMEOUT_S:g} s "
                         "(FOVEA_GRAMMAR_TIMEOUT)")

    def build(self, params: StructuredOutputsParams, copies: int = 1) -> concurrent.futures.Future:
        """`copies` fresh matchers, built in the builders' threads (the future raises ValueError if the grammar
        does not compile)."""
        return self._builders.submit(lambda: [self.matcher(params) for _ in range(copies)])

    def matcher(self, params: StructuredOutputsParams):
        return self._fresh(params).deep_copy()


_threads = None  # (llguidance's pool, which fills a batch's masks in parallel outside the GIL; a starter thread)


def _fill_threads():
    global _threads
    if _threads is None:
        import llguidance

        _threads = llguidance.LLExecutor(), concurrent.futures.ThreadPoolExecutor(1, "grammar-masks")
    return _threads


class GrammarMasks:
    """The next-token masks of a step's constrained rows. Filling starts when the step is built and runs in
    llguidance's threads (they release the GIL) while the model runs: on a GPU the CPU work hides behind the
    forward pass; the sampler waits for them only once it has the logits, then applies them on the device."""

    def __init__(self, rows: list[int], matchers: list, vocab_size: int):
        import llguidance.torch as lt

        self.rows = rows
        self.bitmask = lt.allocate_token_bitmask(len(rows), vocab_size)
        pool, starter = _fill_threads()
        self._filled = starter.submit(lt.fill_next_token_bitmask_par, pool, list(zip(matchers, range(len(rows)))),
                                      self.bitmask)

    @classmethod
    def start(cls, grammars: list, vocab_size: int) -> GrammarMasks | None:
        """Masks for the rows whose grammar (matcher) is not None; None when no row has one."""
        rows = [i for i, grammar in enumerate(grammars) if grammar is not None]
        return cls(rows, [grammars[i] for i in rows], vocab_size) if rows else None

    def apply(self, logits) -> None:
        """Sets to -inf, in place, every token that a constrained row's grammar does not allow next."""
        import llguidance.torch as lt
        import torch

        self._filled.result()
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        if self.rows == list(range(logits.shape[0])):  # every row constrained: no gather and scatter
            lt.apply_token_bitmask_inplace(logits, bitmask)
            return
        index = torch.tensor(self.rows, device=logits.device)
        masked = logits[index]
        lt.apply_token_bitmask_inplace(masked, bitmask)
        logits[index] = masked


def warm_up_masks(compiler: GrammarCompiler, vocab_size: int, device) -> None:
    """One mask applied to one row of logits on `device`: llguidance compiles that step (torch.compile) on its
    first use, seconds that would otherwise fall on the first structured request."""
    import torch

    masks = GrammarMasks.start([compiler.matcher(StructuredOutputsParams(choice=["a"]))], vocab_size)
    masks.apply(torch.zeros(1, vocab_size, device=device))
