"""Request bodies of the OpenAI API (plus vLLM's sampling extras), validated by pydantic, and their mapping to
SamplingParams. Fields a request leaves out take the checkpoint's generation_config defaults, as in vLLM.
Numbers must be finite (JSON's NaN and Infinity are refused); lists that cost work per generated token (stop
strings, stop token ids, logit_bias) and the prompts of one completions request have limits (`RequestLimits`)."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fovea.config.video import media_io_processor_kwargs
from fovea.core.sampling_params import (
    FORMS,
    MAX_SCHEMA_DEPTH,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    schema_depth,
)

logger = logging.getLogger("fovea")


@dataclass
class RequestLimits:
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1000
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024  # entries
    # a set of answers' tokens (digits, letters, labels): like logit_bias, entries each step writes for each row
    max_allowed_token_ids: int = 1024
    # each word's tokens are compared with each row's last generated ones at every step
    max_bad_words: int = 128
    max_bad_word_chars: int = 200
    max_prompts: int = 1024  # prompts in one /v1/completions request

    def check(self, fields: SamplingFields) -> None:
        stop = [fields.stop] if isinstance(fields.stop, str) else fields.stop or []
        for name, count, limit in (
            ("stop", len(stop), self.max_stop_strings),
            ("stop_token_ids", len(fields.stop_token_ids or ()), self.max_stop_token_ids),
            ("logit_bias", len(fields.logit_bias or {}), self.max_logit_bias),
            ("allowed_token_ids", len(fields.allowed_token_ids or ()), self.max_allowed_token_ids),
            ("bad_words", len(fields.bad_words or ()), self.max_bad_words),
        ):
            if count > limit:
                raise ValueError(f"{name} has {count} entries; at most {limit} are allowed")
        if any(len(s) > self.max_stop_string_chars for s in stop):
            raise ValueError(f"stop strings may have at most {self.max_stop_string_chars} characters")
        if any(len(w) > self.max_bad_word_chars for w in fields.bad_words or () if isinstance(w, str)):
            raise ValueError(f"bad_words may have at most {self.max_bad_word_chars} characters each")


MAX_REQUEST_TEMPLATE_CHARS = 64 << 10  # released chat templates are 2-20 kB


class StreamOptions(BaseModel):
    """vLLM's: once a client sends stream_options, the last chunk carries the usage unless include_usage is
    false; continuous_usage_stats puts it in every chunk too (prompt tokens, and that choice's tokens so far)."""

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False

    @staticmethod
    def usage(options: StreamOptions | None, forced: bool = False) -> tuple[bool, bool]:
        """(usage in the last chunk, usage in every chunk); `forced`: --enable-force-include-usage, both."""
        if forced:
            return True, True
        last = bool(options is not None and options.include_usage)
        return last, last and bool(options.continuous_usage_stats)


# Fields of OpenAI's or vLLM's request protocol that fovea does not implement, with the values that ask for
# nothing (what clients send by default): any other value is a 400 naming the field, since ignoring it would
# answer something other than what was asked. Fields outside both protocols are logged and ignored, as in vLLM.
NOT_IMPLEMENTED = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "best_of": (None, 1),
    "chat_template_kwargs": (None, {}),
    "prompt_embeds": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "add_special_tokens": (None, False),  # chat's
}
# no effect on the answer, or asking nothing of a model that does not reason or search (vLLM accepts them too)
IGNORED = {
    "store",
    "metadata",
    "service_tier",
    "reasoning_effort",
    "include_reasoning",
    "web_search_options",
    "prediction",
    "verbosity",
}


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # extra fields: checked in check_extra_fields

    @model_validator(mode="after")
    def check_extra_fields(self):
        extra = self.model_extra or {}
        for name, value in extra.items():
            if name in NOT_IMPLEMENTED and value not in NOT_IMPLEMENTED[name]:
                raise ValueError(f"{name} is not supported by fovea yet")
        unknown = sorted(set(extra) - set(NOT_IMPLEMENTED) - IGNORED)
        if unknown:
            logger.warning("ignoring request fields that are not part of the API: %s", unknown)
        return self

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be sampled
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: max_model_len)
    priority: int = 0  # vLLM's: lower runs first under --scheduling-policy priority (else only 0)
    bad_words: list[str] | None = None  # vLLM's: words never generated
    use_beam_search: bool = False  # vLLM's: the n best beams (frontend/beam_search.py)
    length_penalty: float = 1.0  # vLLM's: beams ranked by cumulative logprob / length ** length_penalty
    cache_salt: str | None = None  # vLLM's: prefix-cache hits only among requests with the same salt
    request_id: str | None = None  # vLLM's: the response's id after its prefix (an X-Request-Id header wins)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids with the text
    return_tokens_as_token_ids: bool | None = (
        None  # vLLM's: logprobs name their tokens "token_id:N" (None: the server's)
    )
    prompt_logprobs: int | None = None  # each prompt token's log-probability and this many top ones, as vLLM
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None  # vLLM's: how media are loaded (video num_frames, fps)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, or vLLM's older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | None = None  # vLLM's older field: a structural tag as JSON text

    def processor_kwargs(self) -> dict[str, Any] | None:
        """mm_processor_kwargs, over what media_io_kwargs asks of loading (raises ValueError for a bad one)."""
        return {**media_io_processor_kwargs(self.media_io_kwargs), **(self.mm_processor_kwargs or {})} or None

    def structured(self) -> StructuredOutputsParams | None:
        forms = {}
        if self.response_format is not None:
            kind = self.response_format.get("type")
            if kind == "json_object":
                forms["response_format"] = dict(json_object=True)
            elif kind == "json_schema":
                spec = self.response_format.get("json_schema")
                if not isinstance(spec, dict):
                    raise ValueError("response_format json_schema needs a json_schema object")
                schema = spec.get("schema")
                forms["response_format"] = dict(json=schema) if schema is not None else dict(json_object=True)
            elif kind == "structural_tag":
                forms["response_format"] = dict(
                    structural_tag={k: v for k, v in self.response_format.items() if k != "type"}
                )
            elif kind != "text":
                raise ValueError(
                    f"response_format type must be text, json_object, json_schema or structural_tag, got {kind!r}"
                )
        if self.structured_outputs:
            forms["structured_outputs"] = self.structured_outputs
        guided = {
            name: getattr(self, f"guided_{name}")
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, f"guided_{name}") is not None
        }
        if guided:
            forms["guided_" + "/".join(guided)] = guided
        if self.structural_tag is not None:
            forms["structural_tag"] = dict(structural_tag=self.structural_tag)
        if len(forms) > 1:
            raise ValueError(f"give one way of constraining the output, not {' and '.join(forms)}")
        if not forms:
            return None
        ((where, fields),) = forms.items()
        unknown = set(fields) - {*FORMS, "json_object"}
        if unknown:
            raise ValueError(f"{where}: {sorted(unknown)} not supported; supported: {', '.join(FORMS)}, json_object")
        return StructuredOutputsParams(**fields)

    def sampling_params(
        self, defaults: dict, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """`defaults`: the generation_config fields; an omitted max_tokens means up to max_model_len."""
        if self.prompt_logprobs is not None:
            if self.stream:  # vLLM's rule: they would come only with the last chunk
                raise ValueError("prompt_logprobs are not available when stream is true")
            prompt_logprobs = max(self.prompt_logprobs, prompt_logprobs or 0)
        fields = {
            name: getattr(self, name)
            for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
            if getattr(self, name) is not None
        }
        try:  # values are clamped to OpenAI's range [-100, 100], as vLLM does
            bias = {int(token): min(100.0, max(-100.0, value)) for token, value in (self.logit_bias or {}).items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids") from None
        # the checkpoint's defaults, but a beam search takes only its temperature (as vLLM): the others would be
        # refused as settings it cannot apply, while a request's own are
        base = {
            name: value
            for name, value in defaults.items()
            if name != "max_tokens" and (name == "temperature" or not self.use_beam_search)
        }
        return SamplingParams(
            **{**base, **fields},
            **{
                "n": self.n,
                "stop": self.stop,
                "seed": self.seed,
                "logit_bias": bias or None,
                "logprobs": logprobs,
                "max_tokens": max_tokens if max_tokens is not None else defaults.get("max_tokens"),
                "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty,
                "min_tokens": self.min_tokens,
                "ignore_eos": self.ignore_eos,
                "stop_token_ids": self.stop_token_ids,
                "allowed_token_ids": self.allowed_token_ids,
                "truncate_prompt_tokens": self.truncate_prompt_tokens,
                "bad_words": self.bad_words,
                "skip_special_tokens": self.skip_special_tokens,
                "prompt_logprobs": prompt_logprobs,
                "spaces_between_special_tokens": self.spaces_between_special_tokens,
                "include_stop_str_in_output": self.include_stop_str_in_output,
                "structured_outputs": self.structured(),
                "use_beam_search": self.use_beam_search,
                "length_penalty": self.length_penalty,
                "cache_salt": self.cache_salt,
                "output_kind": RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            },
        )


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None

    @model_validator(mode="after")
    def _bounded(self):
        """The parameters become a grammar, and the chat template renders them: bounded as a schema is."""
        if self.parameters is not None and schema_depth(self.parameters) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"function.parameters nests deeper than {MAX_SCHEMA_DEPTH} levels")
        return self


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


def tool_list(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as the client wrote them (fields it left out stay out of the template)."""
    return [tool.model_dump(exclude_unset=True) for tool in tools] if tools else None


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template: str | None = Field(None, max_length=MAX_REQUEST_TEMPLATE_CHARS)  # run in the sandbox
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message left open: the model goes on with it
    echo: bool = False  # vLLM's: the reply starts with the last message's text when that is the reply's role
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None  # vLLM's: for templates that do retrieval-augmented generation
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def echo_text(self, role: str) -> str:
        """What `echo` puts before the reply: the last message's text if it has the reply's role (its text parts
        joined by newlines, as vLLM joins them), else nothing."""
        last = self.messages[-1]
        if not self.echo or last.get("role") != role:
            return ""
        content = last.get("content") or ""
        if isinstance(content, list):
            content = "\n".join(
                part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
        return content if isinstance(content, str) else ""

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(defaults, max_tokens, logprobs)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # the OpenAI completions default
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self.sampling_params(
            defaults,
            self.max_tokens,
            self.logprobs,
            prompt_logprobs=self.logprobs if self.echo and self.logprobs is not None else None,
        )

    def prompts(self, max_prompts: int) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if len(prompt) > max_prompts:
            raise ValueError(f"the request has {len(prompt)} prompts; at most {max_prompts} are allowed")
        return list(prompt)


class ResponsesRequest(BaseModel):
    """POST /v1/responses (responses.py): OpenAI's fields; vLLM's sampling extras pass through to the chat."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class InvocationRequest(BaseModel):
    """SageMaker's /invocations body, only as far as telling which request it is (vLLM's route)."""

    messages: Any = None
    prompt: Any = None

    def route(self) -> str:
        if self.messages is not None:
            return "chat"
        if self.prompt is not None:
            return "completion"
        raise InvalidBody("an /invocations body is a chat completion (messages) or a completion (prompt) request")


class InvalidBody(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """A request body as `model`; InvalidBody names the first problem (never pydantic's whole report: it names
    our source files). The server runs this in its preparation pool; parsing holds the GIL all the same, which is
    why BodyLimit (guards.py) bounds how many JSON objects a body may hold."""
    try:
        data = json.loads(raw)
    except ValueError as error:  # not JSON, or not UTF-8
        raise InvalidBody(f"the body is not valid JSON ({getattr(error, 'msg', 'not UTF-8 text')})") from None
    except RecursionError:
        raise InvalidBody("the body nests objects or arrays too deeply") from None
    try:
        return model.model_validate(data)
    except RecursionError:
        raise InvalidBody("the body nests objects or arrays too deeply") from None
    except ValidationError as error:
        raise invalid_body(error) from None


def invalid_body(error: ValidationError) -> InvalidBody:
    """pydantic's first complaint, where it is and what is wrong (never its whole report: it names our source
    files, echoes the input and links to pydantic's site)."""
    first = error.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    return InvalidBody(f"{where}: {first['msg']}" if where else first["msg"], where or None)


OBJECT_REPR = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")  # `<_io.BytesIO object at 0x7f...>` and its kin


def error_body(message: str, kind: str = "BadRequestError", code: int = 400, param: str | None = None) -> dict:
    """OpenAI's error shape. Object reprs from library messages are cut: they tell a client nothing and show
    the server's memory layout."""
    return {"error": {"message": OBJECT_REPR.sub("<object>", message), "type": kind, "param": param, "code": code}}
