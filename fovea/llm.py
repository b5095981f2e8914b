"""The offline batch API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))` and `.chat()`."""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from fovea.config.engine import EngineConfig
from fovea.core.memory import heap_frozen
from fovea.core.request import LoRARequest, RequestOutput
from fovea.core.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, default_sampling_params
from fovea.engine.engine import LLMEngine
from fovea.engine.profiler import StepProfiler, profiler_dir
from fovea.frontend.beam_search import BeamSearch, BeamSearchOutput, beam_search_output
from fovea.frontend.input_processor import InputProcessor
from fovea.frontend.outputs import LogprobEntries, OutputAssembler
from fovea.multimodal.prompt import ChatOptions, load_tokenizer


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        """`model`: a model directory or cached hub id (None = the demo model). `engine_args`: vLLM's names
        (dtype, max_model_len, max_num_seqs, max_num_batched_tokens, block_size, gpu_memory_utilization,
        enable_prefix_caching, mm_processor_kwargs, limit_mm_per_prompt, encoder_cache_size, seed, ...)."""
        config = EngineConfig.from_args(model, **engine_args)
        if config.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size > 1 is for `fovea serve` (one engine process per replica); offline, "
                "run one LLM per replica (as `fovea eval --ray --num-replicas N` does)"
            )
        # first: a bad --override-generation-config fails before the model loads
        self.default_params = default_sampling_params(
            config.model_dir, config.generation_config, config.override_generation_config
        )
        tokenizer = load_tokenizer(config.model_dir)
        assembler = functools.partial(OutputAssembler, entries=LogprobEntries(tokenizer))  # one for all requests
        self.engine = LLMEngine(config, tokenizer=tokenizer, assembler=assembler)
        # prompts are prepared here, with the engine's tokenizer and grammars (its config: max_model_len may have
        # been lowered to what the KV cache holds)
        self.inputs = InputProcessor(self.engine.config, tokenizer=self.engine.tokenizer, grammars=self.engine.grammars)
        self._ids = itertools.count()
        # prompts are prepared in this many threads: decoding, resizing and hashing images release the GIL, so a
        # batch of image prompts is ready in a fraction of the time one thread takes (the server's pool does the same)
        self.prepare_threads = min(8, os.cpu_count() or 1)
        self.profiler: StepProfiler | None = None  # start_profile's

    def close(self) -> None:
        """Stops the engine's threads and tensor-parallel workers (which also stop when this process exits)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Drops the cached KV of earlier prompts (vLLM's: timing or comparing runs without cache hits); False
        while a request is running."""
        return self.engine.blocks.reset_prefix_cache()

    def reset_mm_cache(self) -> None:
        """Forgets decoded images and encoder outputs kept for later requests (vLLM's), for runs without hits."""
        if self.inputs.processor_cache is not None:
            self.inputs.processor_cache.clear()
        self.engine.encoder_cache.reset()

    def start_profile(self) -> None:
        """vLLM's: the torch profiler records this process's engine steps until `stop_profile`, which writes the
        trace where VLLM_TORCH_PROFILER_DIR says (engine/profiler.py)."""
        folder = profiler_dir()
        if folder is None:
            raise ValueError("start_profile needs VLLM_TORCH_PROFILER_DIR set: where the trace is written")
        self.profiler = self.profiler or StepProfiler(folder)
        self.profiler.start()

    def stop_profile(self) -> Path | None:
        """Writes the trace and returns its path (None if no profile ran)."""
        return self.profiler.stop() if self.profiler else None

    def get_default_sampling_params(self) -> SamplingParams:
        return self.default_params.clone()

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable = True,
        mm_processor_kwargs: dict | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """`prompts`: one or a list of strings, token-id lists or {"prompt", "multi_modal_data", ...} dicts.
        `lora_request`: the adapter of every prompt, or a list with one per prompt (None: the base model).
        `priority`: one per prompt, lower first (needs scheduling_policy="priority"), as in vLLM."""
        prompts = as_prompt_list(prompts)
        params = self._params(sampling_params, len(prompts))
        params = [  # vLLM's prompt key: the prefix cache's salt
            p.clone(cache_salt=prompt["cache_salt"]) if isinstance(prompt, dict) and "cache_salt" in prompt else p
            for prompt, p in zip(prompts, params)
        ]
        processed = self._prepare(
            lambda prompt, p: self.inputs.process(prompt, mm_processor_kwargs, p.truncate_prompt_tokens),
            prompts,
            params,
        )
        return self._run(processed, params, use_tqdm, lora_request, priority)

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        mm_processor_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        chat_template_content_format: str = "auto",
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """`messages`: one conversation (a list of {"role", "content"} dicts) or a list of conversations; `tools`
        (OpenAI's function definitions) and `chat_template_kwargs` go to the chat template, as in vLLM;
        `chat_template_content_format`: auto, string or openai (fovea/multimodal/chat_format.py);
        `continue_final_message` (with add_generation_prompt=False): the model goes on with the last message."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        chat = ChatOptions(
            chat_template,
            add_generation_prompt,
            tools,
            chat_template_kwargs,
            chat_template_content_format,
            continue_final_message,
        )
        params = self._params(sampling_params, len(conversations))
        processed = self._prepare(
            lambda messages, p: self.inputs.process_chat(messages, mm_processor_kwargs, chat, p.truncate_prompt_tokens),
            conversations,
            params,
        )
        return self._run(processed, params, use_tqdm, lora_request)

    def beam_search(
        self,
        prompts,
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool | Callable = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's: the `beam_width` best beams of each prompt (any form `generate` takes), best first; each
        sequence's tokens and text include its prompt. `concurrency_limit`: prompts searched at a time."""
        prompts = as_prompt_list(prompts)
        loras = per_prompt(lora_request, len(prompts), "lora_request")
        step = concurrency_limit or max(len(prompts), 1)
        found = []
        for start in range(0, len(prompts), step):
            chunk = prompts[start : start + step]
            outputs = self.generate(chunk, params.sampling_params(), use_tqdm, lora_request=loras[start : start + step])
            found += [beam_search_output(output, self.engine.tokenizer) for output in outputs]
        return found

    def _params(self, sampling_params, count: int) -> list[SamplingParams]:
        return per_prompt(self.default_params if sampling_params is None else sampling_params, count, "sampling_params")

    def _prepare(self, process: Callable, prompts: list, params: list[SamplingParams]) -> list:
        """`process(prompt, its params)` over the prompts, in order; the first prompt that fails raises, as in one
        thread."""
        if self.prepare_threads < 2 or len(prompts) < 2:
            return [process(prompt, p) for prompt, p in zip(prompts, params)]
        with concurrent.futures.ThreadPoolExecutor(min(self.prepare_threads, len(prompts)), "fovea-prepare") as pool:
            return list(pool.map(process, prompts, params))

    def _run(self, processed, sampling_params, use_tqdm, lora_request=None, priority=None) -> list[RequestOutput]:
        params = self._params(sampling_params, len(processed))
        loras = per_prompt(lora_request, len(processed), "lora_request")
        priorities = [0] * len(processed) if priority is None else list(priority)
        if len(priorities) != len(processed):
            raise ValueError(f"got {len(priorities)} priorities for {len(processed)} prompts")
        final = RequestOutputKind.FINAL_ONLY
        requests = [
            self.inputs.make_request(str(next(self._ids)), prompt, p.clone(output_kind=final), lora=lora, priority=rank)
            for prompt, p, lora, rank in zip(processed, params, loras, priorities)
        ]
        searches: dict[str, BeamSearch] = {}  # beam searches (frontend/beam_search.py), by their step requests' ids

        def search_on(search: BeamSearch) -> RequestOutput | None:
            if search.done:
                return search.output(self.engine.tokenizer)
            for step in search.step_requests():
                searches[step.request_id] = search
                self.engine.add_request(step)
            return None

        order = {request.request_id: i for i, request in enumerate(requests)}
        results: list[RequestOutput | None] = [None] * len(requests)
        for request in requests:
            if request.params.use_beam_search:
                results[order[request.request_id]] = search_on(BeamSearch(request, self.engine.config.max_model_len))
            else:
                self.engine.add_request(request)
        progress = Progress(use_tqdm, len(requests))
        try:
            # the garbage collector's passes skip what was alive before the run: the model, the libraries, the
            # caller's objects (core/memory.py); they are the collector's again once it ends
            with heap_frozen():
                while self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        search = searches.pop(output.request_id, None)
                        if search is not None and (not search.take(output) or (output := search_on(search)) is None):
                            continue
                        if output.finished and output.request_id in order:
                            results[order[output.request_id]] = output
                            progress.finished(output)
        except BaseException:
            # Ctrl-C or a failure: free everything (beam searches' steps too), keep the engine usable
            self.engine.abort_request([*order, *searches])
            # nobody waits for these aborts' outputs, nor for the failures queued behind the one raised
            self.engine.finished_outputs.clear()
            self.engine.failures.clear()
            raise
        finally:
            progress.close()
        return results


def as_prompt_list(prompts) -> list:
    """One prompt (a string, a dict, a list of token ids) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def per_prompt(value, count: int, name: str) -> list:
    """One value for every prompt, or a list of one per prompt (as vLLM takes sampling_params, lora_request)."""
    values = value if isinstance(value, (list, tuple)) else [value] * count
    if len(values) != count:
        raise ValueError(f"got {len(values)} {name} for {count} prompts")
    return values


class Progress:
    """vLLM's bar of finished prompts, with the input and output tokens a second so far (`use_tqdm`: True, or a
    callable that makes the bar, as in vLLM; False: none)."""

    def __init__(self, use_tqdm: bool | Callable, total: int):
        self.bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            make = (
                use_tqdm
                if callable(use_tqdm)
                else functools.partial(tqdm, desc="Processed prompts", dynamic_ncols=True)
            )
            self.bar = make(total=total)
        self.prompt_tokens = self.output_tokens = 0

    def finished(self, output: RequestOutput) -> None:
        if self.bar is None:
            return
        self.prompt_tokens += len(output.prompt_token_ids)
        self.output_tokens += sum(len(o.token_ids) for o in output.outputs)
        elapsed = self.bar.format_dict["elapsed"] or 1e-9
        self.bar.set_postfix_str(
            f"est. speed input: {self.prompt_tokens / elapsed:.2f} toks/s, "
            f"output: {self.output_tokens / elapsed:.2f} toks/s",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
