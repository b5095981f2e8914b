"""How to pick tokens and when to stop: the same fields, defaults and meaning as vLLM's SamplingParams."""

from __future__ import annotations

import enum
import json
import math
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

INT64_MAX = 2**63 - 1  # OpenAI's and vLLM's range of seeds, also other integers here
# Bounds that keep the sampler's float32 arithmetic finite for any finite logits, well inside what requests use:
# a penalty of 1e-300 is 0 in float32 and turns every seen token's logit into infinity
MAX_TEMPERATURE = 1e4
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range; the server clamps to it, as vLLM does
MIN_TOP_P = 1e-8  # a smaller top_p keeps the best token alone, as this one does: taken as this one


WHERE = "structured_outputs"
# what a grammar library may be handed (it recurses natively: a $ref chain 2,500 long overflowed its stack)
MAX_GRAMMAR_CHARS = 4 << 20  # 100,000 choices of 14 characters compile in about a second
MAX_SCHEMA_DEPTH = 64  # nested objects and arrays, and $ref jumps, on any path from the root
# GBNF becomes Lark in llguidance's Python converter, whose time grows as the square of the rules (benchmarks/README)
MAX_GBNF_RULES = 1000
MAX_SALT_CHARS = 1024  # a request's cache_salt


FORMS = ("json", "regex", "choice", "grammar", "structural_tag")  # structured outputs' forms, but json_object


def loaded(given, where: str, what: str):
    """`given`, read from JSON when it is a string."""
    if not isinstance(given, str):
        return given
    try:
        return json.loads(given)
    except ValueError as error:
        raise ValueError(f"{where} is not {what}: {error}") from None
    except RecursionError:
        raise ValueError(f"{where} nests deeper than {MAX_SCHEMA_DEPTH} levels") from None


def checked_schema(given, where: str) -> dict | bool:
    """A JSON schema (a dict, a boolean, or either as JSON text), refused if it nests too deep for the compiler."""
    schema = loaded(given, where, "a JSON schema")
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{where} must be a JSON schema (an object), got {type(schema).__name__}")
    if isinstance(schema, dict) and schema_depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{where} nests deeper than {MAX_SCHEMA_DEPTH} levels (objects, arrays, $ref jumps)")
    return schema


def lark_grammar(text: str) -> str:
    """A grammar as Lark (llguidance's dialect): GBNF, llama.cpp's `root ::= ...` that vLLM's docs and xgrammar
    take, is converted as llguidance converts it."""
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

    if is_lark_syntax(text):
        return text
    rules = text.count("::=")
    if rules > MAX_GBNF_RULES:
        raise ValueError(f"{WHERE}.grammar has {rules} GBNF rules; at most {MAX_GBNF_RULES} (or write it in Lark)")
    try:
        return gbnf_to_lark(text)
    except RecursionError:
        raise ValueError(f"{WHERE}.grammar nests too deep to convert from GBNF") from None
    except Exception as error:  # noqa: BLE001 - the converter's own errors name the place
        raise ValueError(
            f"{WHERE}.grammar does not compile: neither Lark (no start: rule) nor GBNF ({str(error)[:500]})"
        ) from None


def compact(schema: dict | bool) -> dict | bool:
    """The schema with its JSON written compact unless it says otherwise, as the json form writes it."""
    if not isinstance(schema, dict):
        return schema
    return {**schema, "x-guidance": {"whitespace_flexible": False, **schema.get("x-guidance", {})}}


def schema_depth(schema) -> int:
    """The longest path from the root through nested objects and arrays and local `$ref` jumps ("#/..."), a
    jump to a node already on the path ending it (a recursive schema). Without recursion: a schema may nest
    deeper than Python's stack."""
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(schema, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = _schema_children(schema, node)
        if done:
            on_path.discard(key)
            depth[key] = 1 + max((depth.get(id(c), 0) for c in children if id(c) not in on_path), default=0)
        elif key not in depth and key not in on_path:
            on_path.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in depth and id(c) not in on_path)
    return depth[id(schema)]


def _schema_children(root, node) -> list:
    values = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    children = [v for v in values if isinstance(v, (dict, list))]
    ref = node.get("$ref") if isinstance(node, dict) else None
    if isinstance(ref, str) and ref.startswith("#"):
        target = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        if isinstance(target, (dict, list)):
            children.append(target)
    return children


@dataclass(frozen=True, eq=False)
class StructuredOutputsParams:
    """vLLM's names: exactly one of json (a schema, as a dict or a JSON string), regex, choice, grammar (Lark,
    llguidance's dialect, or GBNF), json_object (any JSON object) or structural_tag (free text in which each
    trigger starts a tagged part held to its schema: {"structures": [{"begin", "schema", "end"}, ...],
    "triggers": [...]}, as a dict or a JSON string)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: dict | str | None = None

    def __post_init__(self):
        given = [name for name in FORMS if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"{WHERE} takes exactly one of {', '.join(FORMS)}, json_object; got {given or 'none'}")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"{WHERE}.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        self._check_size()

    def _check_size(self) -> None:
        """Bounds what the grammar library gets, before it compiles anything."""
        sizes = {name: len(getattr(self, name) or "") for name in ("regex", "grammar")}
        sizes["choice"] = sum(map(len, self.choice or ()))
        for name in ("json", "structural_tag"):
            given = getattr(self, name)
            sizes[name] = len(given) if isinstance(given, str) else len(json.dumps(given)) if given else 0
        for name, size in sizes.items():
            if size > MAX_GRAMMAR_CHARS:
                raise ValueError(f"{WHERE}.{name} has {size} characters; at most {MAX_GRAMMAR_CHARS} are allowed")
        if self.json is not None:
            checked_schema(self.json, f"{WHERE}.json")
        if self.structural_tag is not None:
            self.structural_tags()

    def structural_tags(self) -> list[tuple[str, str, dict | bool, str]]:
        """structural_tag as (trigger, begin, schema, end) per structure, each begin after its trigger."""
        where = f"{WHERE}.structural_tag"
        spec = loaded(self.structural_tag, where, "an object with structures and triggers")
        if not isinstance(spec, dict) or "format" in spec:
            raise ValueError(
                f"{where} must be an object with structures and triggers (the format form is not supported)"
            )
        structures, triggers = spec.get("structures"), spec.get("triggers")
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise ValueError(f"{where}.triggers must be a non-empty list of non-empty strings")
        if not isinstance(structures, list) or not structures:
            raise ValueError(f"{where}.structures must be a non-empty list")
        tags = []
        for i, part in enumerate(structures):
            begin, end = (part.get(k) if isinstance(part, dict) else None for k in ("begin", "end"))
            if not isinstance(begin, str) or not isinstance(end, str) or "schema" not in part:
                raise ValueError(f"{where}.structures[{i}] needs begin and end strings and a schema")
            trigger = next((t for t in triggers if begin.startswith(t)), None)
            if trigger is None:
                raise ValueError(f"{where}.structures[{i}]: begin {begin[:100]!r} starts with none of the triggers")
            tags.append((trigger, begin, checked_schema(part["schema"], f"{where}.structures[{i}].schema"), end))
        return tags

    def key(self) -> tuple:
        """Hashable and equal for equal requests (a schema dict is not hashable)."""
        schema, tag = (
            v if not isinstance(v, dict) else json.dumps(v, sort_keys=True) for v in (self.json, self.structural_tag)
        )
        return schema, self.regex, self.choice, self.grammar, self.json_object, tag

    def grammar_text(self) -> str:
        """The request as an llguidance grammar."""
        from llguidance import LLMatcher

        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in self.choice))
        if self.grammar is not None:
            return LLMatcher.grammar_from_lark(lark_grammar(self.grammar))
        if self.structural_tag is not None:
            from llguidance import StructTag

            tags = [
                StructTag(trigger=t, begin=b, grammar=compact(schema), end=e)
                for t, b, schema, e in self.structural_tags()
            ]
            return StructTag.to_grammar(tags)
        schema = {"type": "object"} if self.json_object else self.json
        text = schema if isinstance(schema, str) else json.dumps(schema)
        try:
            return LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        except ValueError as error:  # not JSON at all
            raise ValueError(f"{WHERE}.json is not a JSON schema: {error}") from None


# what beam search does not apply, with the values that ask for nothing: anything else is refused, not ignored
BEAM_SEARCH_IGNORES = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "stop": None,
    "stop_token_ids": [],
    "min_tokens": 0,
    "prompt_logprobs": None,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "structured_outputs": None,
}


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # only what is new since the previous output (streaming)
    FINAL_ONLY = 2  # one output when the request finishes (offline generate)


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled (the others' logits -inf), as vLLM
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len), as vLLM
    bad_words: list[str] | None = None  # never generated: each word's last token is banned after the rest, as vLLM
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # or its fields as a dict
    # vLLM's beam search: n beams, run by the front end one token at a time (frontend/beam_search.py)
    use_beam_search: bool = False
    length_penalty: float = 1.0  # a finished beam's score: cumulative logprob / length ** length_penalty
    # vLLM's request field (a prompt dict's key offline): cached KV blocks are found only by requests with the same
    # salt, so one tenant cannot time another's prompts through the prefix cache
    cache_salt: str | None = None
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)
    stop_holdback: int = field(init=False, repr=False, default=0)  # characters a stream holds back
    # bad_words as token ids (the front end's tokenizer sets them: InputProcessor.check_params)
    bad_words_token_ids: list[list[int]] = field(init=False, repr=False, default_factory=list)
    # the sampler may have to ban tokens (min_tokens, bad_words): one test per row and step, not two
    bans_tokens: bool = field(init=False, repr=False, default=False)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_holdback = max((len(s) - 1 for s in self.stop_strings), default=0)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        self.bans_tokens = self.min_tokens > 0 or bool(self.bad_words)
        if self.top_k == -1:
            self.top_k = 0
        if 0 < self.top_p < MIN_TOP_P:  # 1e-300 would be 0 in float32, which drops every token
            self.top_p = MIN_TOP_P
        if self.logit_bias:
            self.logit_bias = {int(token): float(bias) for token, bias in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            check(math.isfinite(getattr(self, name)), f"{name} must be a finite number, got {getattr(self, name)}")
        check(
            all(abs(b) <= MAX_LOGIT_BIAS for b in (self.logit_bias or {}).values()),
            f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
        )
        for name in ("n", "top_k", "max_tokens", "min_tokens"):
            value = getattr(self, name)
            check(value is None or abs(value) <= INT64_MAX, f"{name} must fit in a 64-bit integer, got {value}")
        check(self.n >= 1, f"n must be at least 1, got {self.n}")
        check(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(
            -2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
        )
        low, high = REPETITION_PENALTY_RANGE
        check(
            low <= self.repetition_penalty <= high,
            f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty}",
        )
        check(
            0 <= self.temperature <= MAX_TEMPERATURE,
            f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}",
        )
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k >= 0, f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        check(self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or 0 <= value <= INT64_MAX, f"{name} must be at least 0, got {value}")
        check(
            self.truncate_prompt_tokens is None
            or 1 <= self.truncate_prompt_tokens <= INT64_MAX
            or self.truncate_prompt_tokens == -1,
            f"truncate_prompt_tokens must be -1 (max_model_len) or at least 1, got {self.truncate_prompt_tokens}",
        )
        check(all(self.stop_strings), "stop strings must not be empty")
        check(
            self.bad_words is None or all(isinstance(w, str) and w.strip() for w in self.bad_words),
            "bad_words must be non-blank strings",
        )
        check(self.allowed_token_ids != [], "allowed_token_ids must not be empty (leave it out to allow every token)")
        check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        check(
            self.cache_salt is None or isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= MAX_SALT_CHARS,
            f"cache_salt must be a non-empty string of at most {MAX_SALT_CHARS} characters",
        )
        check(math.isfinite(self.length_penalty), f"length_penalty must be a finite number, got {self.length_penalty}")
        if self.use_beam_search:
            changed = [name for name, default in BEAM_SEARCH_IGNORES.items() if getattr(self, name) != default]
            check(not changed, f"{', '.join(changed)} cannot be used with beam search (use_beam_search)")
        check(
            # (seed + sample index seeds a torch generator, which takes up to 2**64 - 1)
            self.seed is None or -INT64_MAX - 1 <= self.seed <= INT64_MAX,
            f"seed must be within the 64-bit integer range, got {self.seed}",
        )

    @property
    def greedy(self) -> bool:
        # top_k 1 leaves only the best token whatever top_p and min_p say (Qwen2.5-VL's generation_config sets it)
        return self.temperature < 1e-5 or self.top_k == 1

    def clone(self, **changes) -> SamplingParams:
        known = {f.name for f in fields(self) if f.init}
        return replace(self, **{k: v for k, v in changes.items() if k in known})


@dataclass
class BeamSearchParams:
    """vLLM's fields for `LLM.beam_search` (frontend/beam_search.py)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            n=self.beam_width,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            use_beam_search=True,
            logprobs=0,  # each beam's step entries and cumulative logprob come back (beam_search_output)
        )


# generation_config.json's sampling fields (the ones vLLM reads), by our name
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_config_defaults(model_dir: str | Path) -> dict:
    """vLLM's `generation_config="auto"`: the sampling fields the checkpoint's generation_config.json sets
    (a checkpoint may ship a repetition penalty); requests that leave a field out get these."""
    path = Path(model_dir) / "generation_config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    return {ours: raw[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items() if raw.get(theirs) is not None}


def sampling_defaults(model_dir: str | Path, generation_config: str = "auto", override: dict | None = None) -> dict:
    """vLLM's --generation-config: auto (the checkpoint's), vllm (none: SamplingParams' own), or a directory;
    then its --override-generation-config on top (generation_config.json's names, or ours for max_tokens)."""
    defaults = (
        {}
        if generation_config == "vllm"
        else generation_config_defaults(model_dir if generation_config == "auto" else generation_config)
    )
    unknown = sorted(set(override or {}) - set(GENERATION_CONFIG_FIELDS) - set(GENERATION_CONFIG_FIELDS.values()))
    if unknown:
        raise ValueError(
            f"override_generation_config: {unknown} are not sampling defaults; "
            f"it takes {sorted(GENERATION_CONFIG_FIELDS)}"
        )
    return {**defaults, **{GENERATION_CONFIG_FIELDS.get(name, name): value for name, value in (override or {}).items()}}


def default_sampling_params(
    model_dir: str | Path, generation_config: str = "auto", override: dict | None = None
) -> SamplingParams:
    return SamplingParams(**sampling_defaults(model_dir, generation_config, override))
