"""Turns what a user submits (text, token ids, vLLM-style dicts with images, chat messages) into a `RequestInput`.

Runs outside the engine loop (the server calls it in a worker thread): decoding and resizing images is the
slow part of a request's admission and must not hold up token generation. Every check that can reject a
request happens here, before the engine sees it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import weakref

from fovea.config.engine import EngineConfig
from fovea.config.flags import REASONING_TAGS, reasoning_opened
from fovea.config.video import media_io_processor_kwargs
from fovea.core.request import LoRARequest, MMItem, MMSpan, RequestInput
from fovea.core.sampling_params import INT64_MAX, SamplingParams
from fovea.engine.structured_outputs import Grammars
from fovea.models.lora import AdapterCheck
from fovea.multimodal.image import ProcessedImage
from fovea.multimodal.image_workers import LocalDecoder, SharedPixels, release_images, release_shared
from fovea.multimodal.processor_cache import ProcessorCache
from fovea.multimodal.prompt import ChatOptions, ProcessedPrompt, PromptProcessor, prompt_too_long
from fovea.multimodal.video import video_list

logger = logging.getLogger("fovea")


class InputProcessor:
    def __init__(self, config: EngineConfig, decoder=None, tokenizer=None, grammars: Grammars | None = None):
        """`tokenizer`, `grammars`: an engine's in the same process (offline `LLM`), else loaded here."""
        self.config = config
        self.processor_cache = None
        if config.mm_processor_cache_gb > 0:
            decoder = self.processor_cache = ProcessorCache(
                decoder or LocalDecoder(), int(config.mm_processor_cache_gb * 2**30)
            )
        self.prompts = PromptProcessor(
            config.model_dir,
            config.model,
            mm_processor_kwargs=config.mm_processor_kwargs,
            decoder=decoder,
            tokenizer=tokenizer,
            accept_embeds=config.enable_mm_embeds,
        )
        self.tokenizer = self.prompts.tokenizer
        self.media_io = media_io_processor_kwargs(config.media_io_kwargs)  # under each request's own
        self.vocab_size = config.model.text.vocab_size
        self._arrivals = itertools.count()
        # anything with check(params): an engine's grammars, or the server's checks in child processes
        self.grammars = grammars or Grammars(self.tokenizer, self.vocab_size, config.model.eos_token_ids, config.device)
        self.adapter_check = AdapterCheck(config.model, config.max_lora_rank) if config.enable_lora else None

    def process(self, prompt, mm_processor_kwargs: dict | None = None, truncate: int | None = None) -> ProcessedPrompt:
        """A prompt is a string, a list of token ids, or {"prompt" | "prompt_token_ids": ...,
        "multi_modal_data": {"image": image or [images], "video": video or [videos]}, "mm_processor_kwargs": {...}}.
        `truncate`: SamplingParams.truncate_prompt_tokens (a longer prompt keeps its last tokens)."""
        images: list = []
        videos: list = []
        if isinstance(prompt, dict):
            # (cache_salt: read into the prompt's SamplingParams by LLM.generate)
            known = {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs", "cache_salt"}
            unknown = set(prompt) - known
            if unknown:
                raise ValueError(f"unknown prompt fields {sorted(unknown)}")
            data = prompt.get("multi_modal_data") or {}
            if set(data) - {"image", "video"}:
                raise ValueError(
                    f"unsupported multi_modal_data {sorted(set(data) - {'image', 'video'})}; supported: image, video"
                )
            images = data.get("image") or []
            images = images if isinstance(images, (list, tuple)) else [images]
            videos = video_list(data.get("video"))
            mm_processor_kwargs = {**(mm_processor_kwargs or {}), **(prompt.get("mm_processor_kwargs") or {})}
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if not isinstance(prompt, (str, list)):
            raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        self._check_count("image", len(images))
        self._check_count("video", len(videos))
        return self.prompts.process(
            prompt,
            images,
            self._kwargs(mm_processor_kwargs),
            self.config.max_model_len,
            videos,
            add_special_tokens=True,
            truncate=self._kept_tokens(truncate),
        )

    def process_chat(
        self,
        messages: list[dict],
        mm_processor_kwargs: dict | None = None,
        chat: ChatOptions | None = None,
        truncate: int | None = None,
    ) -> ProcessedPrompt:
        text, media = self.prompts.render_chat(messages, chat, self.config.max_model_len)
        self._check_count("image", len(media.images))
        self._check_count("video", len(media.videos))
        kwargs, kept = self._kwargs(mm_processor_kwargs), self._kept_tokens(truncate)
        return self.prompts.process(text, media.images, kwargs, self.config.max_model_len, media.videos, truncate=kept)

    def _bad_words_ids(self, words) -> list[list[int]]:
        """bad_words as vLLM reads them: each word's tokens with its leading blanks stripped, and again after a
        space (the word in mid-text) where that starts with another token and has as many."""
        found = []
        for word in words:
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            found.append(alone)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                found.append(spaced)
        return found

    def _check_priority(self, priority: int) -> None:
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(
                f"priority {priority} needs --scheduling-policy priority (this engine runs requests in arrival order)"
            )
        if not isinstance(priority, int) or abs(priority) > INT64_MAX:
            raise ValueError(f"priority must be a 64-bit integer, got {priority!r}")

    def _kept_tokens(self, truncate: int | None) -> int | None:
        """truncate_prompt_tokens as vLLM reads it: -1 is max_model_len, and more than that is an error."""
        if truncate is not None and truncate > self.config.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens ({truncate}) is more than max_model_len ({self.config.max_model_len})"
            )
        return self.config.max_model_len if truncate == -1 else truncate

    def _kwargs(self, mm_processor_kwargs: dict | None) -> dict | None:
        return {**self.media_io, **(mm_processor_kwargs or {})} or None

    def _check_count(self, kind: str, count: int) -> None:
        limit = self.config.limit_mm_per_prompt.get(kind)
        if limit is not None and count > limit:
            raise ValueError(f"the prompt has {count} {kind}s but limit_mm_per_prompt allows {limit}")

    def check_params(self, params: SamplingParams, grammar: bool = True) -> None:
        """What SamplingParams cannot check alone: ids against the vocabulary, n against max_num_seqs, logprobs
        against max_logprobs, that a structured-output grammar compiles (`grammar`: seconds for a large one, so the
        server leaves it to the preparation pool, where make_request checks again)."""
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"n={params.n} is more than max_num_seqs={self.config.max_num_seqs} sequences can run at once"
            )
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > self.config.max_logprobs:
                raise ValueError(
                    f"{name}={getattr(params, name)} is more than max_logprobs="
                    f"{self.config.max_logprobs} (a server flag: --max-logprobs)"
                )
        if params.use_beam_search and 2 * params.n > self.config.max_logprobs:
            raise ValueError(
                f"beam search with n={params.n} beams needs {2 * params.n} logprobs a step, more than max_logprobs="
                f"{self.config.max_logprobs} (a server flag: --max-logprobs)"
            )
        if params.use_beam_search and self.config.logprobs_mode != "raw_logprobs":
            raise ValueError(
                "beam search ranks beams by the model's log-probabilities, which this engine's logprobs_mode="
                f"{self.config.logprobs_mode} does not report (a server flag: --logprobs-mode raw_logprobs)"
            )
        if grammar and params.structured_outputs is not None:
            params.structured_outputs = self.grammars.check(params.structured_outputs)
        params.bad_words_token_ids = self._bad_words_ids(params.bad_words or ())
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias or {}),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("bad_words", [t for ids in params.bad_words_token_ids for t in ids]),
        ):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{name} has token id {bad[0]}, out of vocabulary (size {self.vocab_size})")
        eos = () if params.ignore_eos else self.config.model.eos_token_ids
        stops = {*eos, *params.stop_token_ids}  # what min_tokens bans (sequence.py)
        if params.allowed_token_ids and params.min_tokens and set(params.allowed_token_ids) <= stops:
            raise ValueError("allowed_token_ids holds only stop tokens, which min_tokens keeps from being drawn")

    def make_request(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        params: SamplingParams,
        arrival_time: float | None = None,
        fair_rank: int = 0,
        lora: LoRARequest | None = None,
        priority: int = 0,
    ) -> RequestInput:
        try:
            return self._make_request(request_id, processed, params, arrival_time, fair_rank, lora, priority)
        except BaseException:
            release_images(processed.images)  # refused: its pixels never reach the engine
            raise

    def _make_request(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        params: SamplingParams,
        arrival_time: float | None,
        fair_rank: int,
        lora: LoRARequest | None,
        priority: int,
    ) -> RequestInput:
        self._check_priority(priority)
        ids = processed.token_ids
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) > self.config.max_model_len:
            raise prompt_too_long(len(ids), self.config.max_model_len)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of vocabulary (size {self.vocab_size})")
        self.check_params(params)
        items, start, model = [], 0, self.config.model
        for image in processed.images:
            start = ids.index(model.video_token_id if image.is_video else model.image_token_id, start)
            parts = (
                self._video_parts(image, start, ids)
                if image.is_video
                else [
                    MMItem(
                        MMSpan(start, image.num_tokens, image.content_hash),
                        tuple(image.grid_thw),
                        image.pixels,
                        image.frames,
                        embeds=image.embeds,
                    )
                ]
            )
            for part in parts:
                if part.span.length > self.config.encoder_cache_size:
                    raise ValueError(
                        f"an image of {part.span.length} tokens does not fit the encoder cache "
                        f"({self.config.encoder_cache_size} tokens); lower max_pixels or raise "
                        "encoder_cache_size"
                    )
            items += parts
            start = parts[-1].end
        if lora is not None:
            lora, changes_vision = self.check_lora(lora)  # as checked: the engine loads only those bytes
        if lora is not None and changes_vision:  # its image embeddings are its own: cached apart
            items = [
                dataclasses.replace(
                    item,
                    span=dataclasses.replace(item.span, content_hash=f"{item.content_hash}+lora{lora.lora_int_id}"),
                    lora=lora,
                )
                for item in items
            ]
        request = RequestInput(
            request_id,
            ids,
            params,
            processed.positions,
            processed.mrope_delta,
            items,
            prompt=processed.text,
            arrival_time=arrival_time or time.time(),
            eos_token_ids=self.config.model.eos_token_ids,
            arrival_index=next(self._arrivals),
            fair_rank=fair_rank,
            priority=priority,
            grammar_after=self._reasoning_end(processed.text, params),
            lora=lora,
        )
        shared = list(
            {
                item.pixels.name: item.pixels  # a long video's parts share one segment
                for item in items
                if isinstance(item.pixels, SharedPixels)
            }.values()
        )
        if shared:  # freed if this request is dropped unsent (client gone, another prompt failed, ...)
            request.release_unsent = weakref.finalize(request, release_shared, shared)
        return request

    def check_lora(self, lora: LoRARequest) -> tuple[LoRARequest, bool]:
        """Fails naming what is wrong with the adapter; the adapter with the digest of the files checked, and
        whether it changes the vision tower."""
        if not isinstance(lora, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        if self.adapter_check is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} asked for, but LoRA is off: start with enable_lora")
        checked, changes_vision = self.adapter_check(lora)
        if changes_vision and self.config.mm_encoder_workers:
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r} changes the vision tower, which runs without adapters in the "
                "encoder workers (--mm-encoder-workers): only adapters of the language model are served with them"
            )
        return checked, changes_vision

    def _reasoning_end(self, prompt: str | None, params: SamplingParams) -> str | None:
        """With --reasoning-parser, a prompt that opens the reasoning (a thinking template's `<think>`) lets the
        model think freely: its grammar starts once the reasoning's end tag is in the output (as vLLM)."""
        if self.config.reasoning_parser is None or params.structured_outputs is None or not params.detokenize:
            return None
        parser = self.config.reasoning_parser
        return REASONING_TAGS[parser][1] if reasoning_opened(parser, prompt) else None

    def _video_parts(self, video: ProcessedImage, start: int, ids: list[int]) -> list[MMItem]:
        """A video as runs of whole temporal patches of at most one step's encoder budget each (at least one
        patch): the vision tower attends within a temporal patch only (its cu_seqlens and windows are per
        patch), so the parts' embeddings are the whole video's, and a long video's encoder work spreads over
        steps instead of stalling one."""
        t, h, w = video.grid_thw
        per_patch = h * w // video.merge_size**2
        if video.timestamps is not None:  # Qwen3-VL: text between the patches, so each patch is an item
            parts = []
            for first in range(t):
                start = ids.index(self.config.model.video_token_id, start) if first else start
                parts.append(self._video_part(video, start, first, 1, per_patch))
                start += per_patch
            return parts
        step = max(1, self.config.encoder_budget // per_patch)
        if step >= t:
            return [MMItem(MMSpan(start, video.num_tokens, video.content_hash), (t, h, w), video.pixels)]
        return [
            self._video_part(video, start + first * per_patch, first, min(step, t - first), per_patch)
            for first in range(0, t, step)
        ]

    @staticmethod
    def _video_part(video: ProcessedImage, start: int, first: int, count: int, per_patch: int) -> MMItem:
        """Temporal patches first .. first + count - 1 of a video, their tokens from `start` on."""
        _, h, w = video.grid_thw
        frames = (first * 2, (first + count) * 2)  # two frames per temporal patch
        span = MMSpan(start, count * per_patch, f"{video.content_hash}-p{first}")
        if isinstance(video.pixels, SharedPixels):  # sliced when the engine takes the segment
            return MMItem(span, (count, h, w), video.pixels, frames)
        return MMItem(span, (count, h, w), video.pixels[frames[0] : frames[1]])
