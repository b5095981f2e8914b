"""From a user's prompt (chat messages or text + images) to what the model consumes.

chat messages (OpenAI content parts) -> the checkpoint's chat template -> token ids -> each image's single
placeholder (Qwen's `<|image_pad|>`, a video's `<|video_pad|>`; LLaVA's `<image>`) expanded to its item's tokens
-> positions by the model's rule (M-RoPE t/h/w, or 1-D). Qwen3-VL's videos carry their time as text: a video's
`<|vision_start|><|video_pad|><|vision_end|>` becomes, per temporal patch, `<t seconds>` and the patch inside its
own vision start and end tokens.

Given a token limit (max_model_len), too-long prompts are refused as cheaply as possible: by their character
count before templating or tokenizing (no token is longer than the vocabulary's longest string), by counting
tokens chunk by chunk with an early stop (a tokenizer call holds the GIL, so one huge call would freeze the whole
front end), and by the images' and videos' token counts before their pixels are decoded.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import re
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fovea.config.model import ModelConfig
from fovea.models.mrope_positions import VisionSpan, linear_positions, mrope_positions
from fovea.multimodal.chat_format import (
    CONTENT_FORMATS,
    ChatMedia,
    as_string_content,
    detect_content_format,
    split_chat_media,
    text_length,
)
from fovea.multimodal.embeds import image_embeds, is_embeds
from fovea.multimodal.fetch import ImageTooLarge
from fovea.multimodal.image import MAX_REQUEST_PIXELS, ImageProcessor, PlannedImage, ProcessedImage
from fovea.multimodal.image_workers import LocalDecoder, release_images
from fovea.multimodal.video import PlannedVideo, frame_images, plan_video

logger = logging.getLogger("fovea")
COUNT_CHUNK_CHARS = 16384  # text longer than this is counted chunk by chunk before it is tokenized whole
SURROGATE = re.compile("[\ud800-\udfff]")


def prompt_too_long(length: int, limit: int, at_least: bool = False) -> ValueError:
    return ValueError(
        f"the prompt (length {'at least ' if at_least else ''}{length}) is longer than the maximum "
        f"model length of {limit}"
    )


def check_text(text: str) -> None:
    if not text.isascii() and SURROGATE.search(text):
        raise ValueError("the prompt holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid Unicode")


# apply_chat_template's own arguments: chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "messages",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
}


@dataclass(frozen=True)
class ChatOptions:
    """How chat messages become a prompt: the template (None: the model's own), whether the assistant's turn is
    opened at the end, the tools the template lists, extra template variables (chat_template_kwargs), and
    whether the last message is left open for the model to go on with (vLLM's continue_final_message: a reply's
    start, "prefilled")."""

    template: str | None = None
    add_generation_prompt: bool = True
    tools: list[dict] | None = None
    template_kwargs: dict | None = None
    content_format: str = "auto"  # the shape of message content the template expects (chat_format.py)
    continue_final_message: bool = False
    documents: list[dict] | None = None  # for templates that do retrieval-augmented generation (vLLM's field)

    def __post_init__(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true: the last message is either "
                "left open or followed by a new turn (set add_generation_prompt to false)"
            )
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(self.template_kwargs or {}))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved}: they are request fields of their own")
        if self.content_format not in CONTENT_FORMATS:
            raise ValueError(
                f"chat template content format must be one of {CONTENT_FORMATS}, got {self.content_format!r}"
            )

    def render(self, tokenizer, messages: list[dict], template: str) -> str:
        return tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            tools=self.tools or None,
            documents=self.documents or None,
            tokenize=False,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            **(self.template_kwargs or {}),
        )


@dataclass
class ProcessedPrompt:
    token_ids: list[int]
    images: list[ProcessedImage] = field(default_factory=list)
    positions: np.ndarray | None = None  # (3, len(token_ids)) M-RoPE positions
    mrope_delta: int = 0
    text: str | None = None  # the prompt as text, when it was given as text (chat: the rendered template)


_TOKENIZERS: dict[tuple, object] = {}  # what a tokenizer is read from (tokenizer_source) -> the tokenizer
NOT_TOKENIZER_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json", ".md")  # weights, model cards


def tokenizer_source(path: Path) -> tuple:
    """What transformers builds a checkpoint's tokenizer from: its files but the weights, model cards and
    config.json, by content (large ones by size and time), and the two fields of config.json that can choose the
    tokenizer's class. Checkpoints with the same tokenizer files (a fine-tune beside its base; the tests' tiny ones)
    share one."""
    digest = hashlib.sha1()
    for file in sorted(path.iterdir()):
        if not file.is_file() or file.name == "config.json" or file.name.endswith(NOT_TOKENIZER_FILES):
            continue
        stat = file.stat()
        content = file.read_bytes() if stat.st_size <= 64 << 20 else f"{stat.st_size} {stat.st_mtime_ns}".encode()
        digest.update(file.name.encode() + b"\0" + content)
    config = path / "config.json"
    fields = json.loads(config.read_text()) if config.is_file() else {}
    return digest.hexdigest(), fields.get("model_type"), fields.get("tokenizer_class")


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's tokenizer, loaded once per process and shared (callers must not change it): loading Qwen's
    vocabulary takes 1.2-1.6 s, most of an offline LLM's start, and a process may start several. A file changed
    since loads it again."""
    from transformers import AutoTokenizer  # heavy import, only where a tokenizer is needed

    path = Path(model_dir)
    if not path.is_dir():
        return AutoTokenizer.from_pretrained(str(model_dir))
    key = tokenizer_source(path)
    if key not in _TOKENIZERS:
        if len(_TOKENIZERS) >= 8:  # a process going through many checkpoints keeps the latest few
            del _TOKENIZERS[next(iter(_TOKENIZERS))]
        _TOKENIZERS[key] = AutoTokenizer.from_pretrained(str(model_dir))
    return _TOKENIZERS[key]


def find_chat_template(model_dir: str | Path, tokenizer) -> str | None:
    """The tokenizer's own template, else the processor-level chat_template.json newer checkpoints ship."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    for name in ("chat_template.jinja", "chat_template.json"):
        path = Path(model_dir) / name
        if path.is_file():
            text = path.read_text()
            return json.loads(text)["chat_template"] if name.endswith(".json") else text
    return None


_MAX_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_token_chars(tokenizer) -> int:
    """An upper bound on the characters of one token (byte-level strings are at least as long as their text), read
    once per tokenizer and size: the vocabulary as a dict is 0.2 s of Qwen's, at every PromptProcessor (each `LLM`)."""
    size, longest = _MAX_TOKEN_CHARS.get(tokenizer, (None, 0))
    if size != len(tokenizer):  # new, or tokens were added since
        size, longest = len(tokenizer), max(map(len, tokenizer.get_vocab()), default=1)
        _MAX_TOKEN_CHARS[tokenizer] = size, longest
    return longest


class PromptProcessor:
    def __init__(
        self,
        model_dir: str | Path,
        config: ModelConfig,
        chat_template: str | None = None,
        mm_processor_kwargs: dict | None = None,
        decoder=None,
        tokenizer=None,
        accept_embeds: bool = False,
    ):
        """`decoder.process(planned)` decodes and resizes planned images and videos, `decoder.probe(data)` reads a
        video file's header (default: in this thread; the server passes worker processes, image_workers.py).
        `accept_embeds`: images may come as the tower's output (--enable-mm-embeds, multimodal/embeds.py)."""
        self.config, self.accept_embeds = config, accept_embeds
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
        self.chat_template = chat_template or find_chat_template(model_dir, self.tokenizer)
        image_cfg = config.image.with_overrides(mm_processor_kwargs)
        self.image_processor = ImageProcessor(image_cfg)
        self.video_options = config.video.with_kwargs(mm_processor_kwargs)
        self.decoder = decoder or LocalDecoder()
        self.placeholders = {"image": self._placeholder(config.image_token_id)}  # for "string" chat templates
        if config.image_placeholder_id is not None:
            self.placeholders["image"] = self.tokenizer.convert_ids_to_tokens(config.image_placeholder_id)
        if config.video_token_id is not None:
            self.placeholders["video"] = self._placeholder(config.video_token_id)
        elif config.video_text is not None:
            self.placeholders["video"] = config.video_text
        self.image_wrap = [self._special_id(text) for text in config.image_wrap or ()]  # [start, end] or []
        self.max_token_chars = max_token_chars(self.tokenizer)
        self._warned_tools = False
        self._timestamp_ids: dict[str, list[int]] = {}

    def _special_id(self, text: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(text)
        if token_id is None or token_id == self.tokenizer.unk_token_id:
            raise ValueError(f"the checkpoint's tokenizer has no {text} token, which {self.config.architecture} needs")
        return token_id

    def _placeholder(self, token_id: int) -> str:
        """What a template writes for one image or video: the placeholder token, inside the vision start and end
        tokens where the model has them."""
        text = self.tokenizer.convert_ids_to_tokens(token_id)
        start, end = self.config.vision_start_token_id, self.config.vision_end_token_id
        if start is None:
            return text
        return self.tokenizer.convert_ids_to_tokens(start) + text + self.tokenizer.convert_ids_to_tokens(end)

    def encode(
        self, text: str, max_tokens: int | None = None, add_special_tokens: bool = False, truncating: bool = False
    ) -> list[int]:
        """Token ids of `text`; with `max_tokens`, a text that clearly has more is refused before it is
        tokenized whole (`truncating`: only one whose characters alone say so, the same bound on the work).
        `add_special_tokens`: what the tokenizer adds around a plain prompt (Llama's BOS; Qwen's adds nothing), as
        vLLM does for completions; a rendered chat template has its own."""
        check_text(text)
        if truncating and max_tokens is not None and len(text) > max_tokens * self.max_token_chars:
            raise ValueError(
                f"the prompt has {len(text)} characters; truncate_prompt_tokens reads at most {max_tokens} tokens' "
                f"worth ({max_tokens * self.max_token_chars} characters, max_model_len x the longest token)"
            )
        self._check_characters(len(text), max_tokens)
        if max_tokens is not None and not truncating and len(text) > COUNT_CHUNK_CHARS:
            self._count_up_to(text, max_tokens)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _check_characters(self, length: int, max_tokens: int | None) -> None:
        """Text of `length` characters has at least length / max_token_chars tokens."""
        if max_tokens is not None and length > max_tokens * self.max_token_chars:
            raise prompt_too_long(-(-length // self.max_token_chars), max_tokens, at_least=True)

    def _count_up_to(self, text: str, limit: int) -> int:
        """Counts tokens chunk by chunk (the GIL is free between chunks), refusing the text once past `limit`.
        Chunks end before a space that follows a non-space, which word-level pre-tokenizers also split at; a cut
        elsewhere (one huge word) may add tokens, so the limit grows by the longest token per such cut."""
        count, slack, start = 0, 0, 0
        while start < len(text):
            end = text.find(" ", start + COUNT_CHUNK_CHARS, start + 2 * COUNT_CHUNK_CHARS)
            while end > 0 and text[end - 1].isspace():
                end = text.find(" ", end + 1, start + 2 * COUNT_CHUNK_CHARS)
            if end < 0:
                end = start + COUNT_CHUNK_CHARS
                slack += self.max_token_chars if end < len(text) else 0
            slack += 1  # a tokenizer that marks the start of its input (a prefix space) may add one per chunk
            count += len(self.tokenizer.encode(text[start:end], add_special_tokens=False))
            if count > limit + slack:
                raise prompt_too_long(count - slack, limit, at_least=True)
            start = end
        return count

    def render_chat(
        self, messages: list[dict], chat: ChatOptions | None = None, max_tokens: int | None = None
    ) -> tuple[str, ChatMedia]:
        chat = chat or ChatOptions()
        template = chat.template or self.chat_template
        if not template:
            raise ValueError("the model has no chat template; pass one with chat_template=")
        if chat.tools and "tools" not in template and not self._warned_tools:
            self._warned_tools = True  # as in vLLM, the request goes on; the model just does not see the tools
            logger.warning(
                "the chat template does not list tools; pass one that does (--chat-template), e.g. "
                "fovea/models/qwen2_5_vl_chat_template.jinja"
            )
        normalized, media = self.normalize_chat(messages, max_tokens, chat, template)
        try:
            text = chat.render(self.tokenizer, normalized, template)
        except Exception as exc:  # noqa: BLE001 - a template's raise_exception or its own error is the request's
            raise ValueError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") from None
        return text, media

    def normalize_chat(
        self,
        messages: list[dict],
        max_tokens: int | None = None,
        chat: ChatOptions | None = None,
        template: str | None = None,
    ) -> tuple[list[dict], ChatMedia]:
        """split_chat_media, refusing (before any templating) text too long for `max_tokens` tokens; the content
        in the shape `template` expects (chat.content_format, or read off the template when "auto")."""
        chat = chat or ChatOptions()
        normalized, media = split_chat_media(messages)
        extra = sum(len(json.dumps(given)) for given in (chat.tools, chat.documents) if given)
        self._check_characters(text_length(normalized) + extra, max_tokens)
        template = template or chat.template or self.chat_template
        content_format = chat.content_format
        if content_format == "auto":
            content_format = detect_content_format(template) if template else "openai"
        if content_format == "string":
            normalized = as_string_content(normalized, self.placeholders)
        return normalized, media

    def process_chat(self, messages: list[dict], mm_processor_kwargs: dict | None = None) -> ProcessedPrompt:
        text, media = self.render_chat(messages)
        return self.process(text, media.images, mm_processor_kwargs, videos=media.videos)

    def process(
        self,
        prompt: str | list[int],
        images: list = (),
        mm_processor_kwargs: dict | None = None,
        max_tokens: int | None = None,
        videos: list = (),
        add_special_tokens: bool = False,
        truncate: int | None = None,
    ) -> ProcessedPrompt:
        """`prompt` holds one `<|image_pad|>` per image and one `<|video_pad|>` per video (as the chat template
        writes them; InternVL's `<video>`, in text only), or is token ids. With `max_tokens`, a longer prompt is
        refused before its images' and videos' pixels are decoded. `truncate` (vLLM's truncate_prompt_tokens, at
        most `max_tokens`): a longer prompt keeps its last `truncate` tokens instead, as long as the cut falls before
        its first image or video."""
        given = prompt if isinstance(prompt, str) else None  # the prompt as outputs name it (vLLM's), unexpanded
        if mm_processor_kwargs:  # names and values are refused alike whatever the prompt shows (images, videos)
            self.image_processor.config.with_overrides(mm_processor_kwargs, capped=True)
            self.video_options.with_kwargs(mm_processor_kwargs, capped=True)
        if self.config.image_text is not None and isinstance(prompt, str):  # e.g. "<image>" for InternVL's own
            prompt = prompt.replace(self.config.image_text, self.placeholders["image"], len(images))
        if videos and self.config.video_text is not None:  # InternVL: a video is its frames, each an image
            images, prompt = self._frames_for_videos(prompt, images, videos, mm_processor_kwargs, max_tokens)
            videos = []
        wrapped = self.config.image_placeholder_id is not None
        if wrapped and isinstance(prompt, str):  # a text too long is refused before any image is fetched
            self._check_characters(len(prompt), max_tokens)
        planned = self._plan_images(images, mm_processor_kwargs) if wrapped else None
        if wrapped:  # the images' text is the processor's, which may depend on their size (pan-and-scan)
            prompt, planned = self._pan_and_scan(prompt, planned)
            prompt = self._wrap_images(prompt, len(planned))
        truncating = truncate is not None
        ids = (
            self.encode(prompt, max_tokens, add_special_tokens, truncating) if isinstance(prompt, str) else list(prompt)
        )
        if videos and self.config.video_token_id is None:
            raise ValueError(f"{self.config.architecture} takes no videos")
        if planned is None:
            planned = self._plan_images(images, mm_processor_kwargs)
        source_pixels = sum(p.image.width * p.image.height for p in planned if isinstance(p, PlannedImage))
        if source_pixels > MAX_REQUEST_PIXELS:  # known from the headers: refused before any pixel is decoded
            raise ImageTooLarge(
                f"the prompt's images have {source_pixels / 1e6:.1f} megapixels before resizing, more "
                f"than the {MAX_REQUEST_PIXELS / 1e6:.1f} one request may have "
                "(FOVEA_MAX_REQUEST_PIXELS)"
            )
        cfg, options = self.image_processor.config, self.video_options.with_kwargs(mm_processor_kwargs, capped=True)
        planned_videos = [
            plan_video(video, options, self.decoder.probe, cfg.patch_size, cfg.merge_size) for video in videos
        ]
        added = len(self.image_wrap) - 1  # a placeholder's own token, less the tokens around the image
        length = len(ids) + sum(p.num_tokens - 1 for p in planned_videos)
        length += (
            0
            if wrapped
            else sum(p.num_tokens + added * (p.grid[0] if isinstance(p, PlannedVideo) else 1) for p in planned)
        )
        if truncating and length > truncate:  # before any pixel is decoded
            ids, length = self._cut_front(ids, length - truncate, truncate), truncate
        if max_tokens is not None and length > max_tokens:
            raise prompt_too_long(length, max_tokens)
        processed, clips = [], []
        try:
            for image in planned:
                if isinstance(image, PlannedVideo):
                    processed += frame_images(self.decoder.process(image))
                else:
                    processed.append(image if isinstance(image, ProcessedImage) else self.decoder.process(image))
            for video in planned_videos:
                clips.append(self.decoder.process(video))
            result = self.expand(ids, processed, clips)
            if max_tokens is not None and len(result.token_ids) > max_tokens:
                raise prompt_too_long(len(result.token_ids), max_tokens)
        except BaseException:
            release_images(processed + clips)  # pixels already handed to shared memory will not reach the engine
            raise
        result.text = given
        return result

    def _cut_front(self, ids: list[int], count: int, kept: int) -> list[int]:
        """`ids` less their first `count`, which must all come before the first image or video (their tokens and
        the positions after them are the expanded prompt's: what is cut is the same either way)."""
        media = {self.config.image_token_id, self.config.video_token_id, self.config.vision_start_token_id}
        media.update(self.image_wrap)
        if not media.isdisjoint(ids[:count]):
            raise ValueError(
                f"truncate_prompt_tokens={kept} would cut into the prompt's images or videos (they and the text "
                "after them must fit in the tokens kept)"
            )
        return ids[count:]

    def _plan_images(self, images: list, mm_processor_kwargs: dict | None) -> list[PlannedImage | ProcessedImage]:
        return [
            image
            if isinstance(image, PlannedVideo)  # (_frames_for_videos)
            else self._embeds(image)
            if is_embeds(image)
            else self.image_processor.plan(image, mm_processor_kwargs)
            for image in images
        ]

    def _frames_for_videos(
        self, prompt: str | list[int], images: list, videos: list, kwargs: dict | None, max_tokens: int | None
    ) -> tuple[list, str]:
        """InternVL: each video placeholder (`<video>`) becomes "Frame1: <image>\nFrame2: <image>..." (transformers'
        InternVLProcessor writes that, and the published chat example), one image per kept frame. Returns the
        images and the planned videos in the order the prompt names them, and the prompt."""
        if not isinstance(prompt, str):
            raise ValueError(
                f"{self.config.architecture} takes videos in a text prompt only (its frames are named in it)"
            )
        self._check_characters(len(prompt), max_tokens)  # before any video file's header is read
        marker, image = self.config.video_text, self.placeholders["image"]
        pieces = re.split(f"({re.escape(marker)}|{re.escape(image)})", prompt)
        found = pieces[1::2].count(marker)
        if found != len(videos):
            raise ValueError(f"prompt has {found} video placeholders ({marker}) but {len(videos)} videos were given")
        cfg, options = self.image_processor.config, self.video_options.with_kwargs(kwargs, capped=True)
        planned = iter([plan_video(v, options, self.decoder.probe, cfg.patch_size, cfg.merge_size) for v in videos])
        given, ordered = iter(images), []
        for index in range(1, len(pieces), 2):
            if pieces[index] == marker:
                video = next(planned)
                ordered.append(video)
                pieces[index] = "\n".join(f"Frame{frame + 1}: {image}" for frame in range(video.grid[0]))
            else:
                ordered += itertools.islice(given, 1)  # (more placeholders than images: expand() says so)
        return ordered + list(given), "".join(pieces)

    def _pan_and_scan(self, prompt: str | list[int], planned: list) -> tuple[str | list[int], list]:
        """Gemma 3's processor: an image with pan-and-scan crops becomes, in the text, "Here is the original image
        <start_of_image> and here are some crops to help you see better <start_of_image> <start_of_image>...", each
        crop an image of its own."""
        crops = [self.image_processor.crops(p) if isinstance(p, PlannedImage) else [] for p in planned]
        if not any(crops):
            return prompt, planned
        if not isinstance(prompt, str):
            raise ValueError("pan-and-scan needs the prompt as text: its words are tokenized with the text around")
        start = self.tokenizer.convert_ids_to_tokens(self.config.image_placeholder_id)
        pieces = prompt.split(start)
        if len(pieces) - 1 != len(planned):
            raise ValueError(f"prompt has {len(pieces) - 1} image placeholders ({start}) but {len(planned)} images")
        text = pieces[0]
        for piece, extra in zip(pieces[1:], crops):
            seen = " ".join([start] * len(extra))
            text += (
                f"Here is the original image {start} and here are some crops to help you see better {seen}"
                if extra
                else start
            )
            text += piece
        return text, [image for original, extra in zip(planned, crops) for image in (original, *extra)]

    def _embeds(self, source: dict) -> ProcessedImage:
        if not self.accept_embeds:
            raise ValueError("image embeddings as input are off here; the server takes them with --enable-mm-embeds")
        return image_embeds(source, self.config)

    def _wrap_images(self, prompt: str | list[int], count: int) -> str | list[int]:
        """Gemma 3's processor: each image placeholder (<start_of_image>) becomes "\n\n<start_of_image>", the
        image's tokens, "<end_of_image>\n\n", in the text before it is tokenized (its newlines then merge with
        the text's as the tokenizer merges them); in token ids, id for id."""
        config, tokens = self.config, self.tokenizer.convert_ids_to_tokens
        per_image = self.image_processor.config.tokens_per_image
        soft, start, end = config.image_token_id, config.image_placeholder_id, config.vision_end_token_id
        found = prompt.count(tokens(start)) if isinstance(prompt, str) else prompt.count(start)
        if found != count:
            raise ValueError(f"prompt has {found} image placeholders ({tokens(start)}) but {count} images were given")
        if isinstance(prompt, str):
            return prompt.replace(tokens(start), f"\n\n{tokens(start)}{tokens(soft) * per_image}{tokens(end)}\n\n")
        newlines = self.tokenizer.encode("\n\n", add_special_tokens=False)
        image = [*newlines, start, *[soft] * per_image, end, *newlines]
        return [t for token in prompt for t in (image if token == start else [token])]

    def expand(
        self, ids: list[int], images: list[ProcessedImage], videos: list[ProcessedImage] = ()
    ) -> ProcessedPrompt:
        """Each placeholder token becomes its item's run of tokens; the items come back in prompt order."""
        if self.config.image_placeholder_id is not None:  # the text holds each image's tokens already
            token, runs = self.config.image_token_id, []
            for i, t in enumerate(ids):
                if t == token and i and ids[i - 1] == token:
                    runs[-1] += 1
                elif t == token:
                    runs.append(1)
            if runs != [image.num_tokens for image in images]:
                raise ValueError(f"the prompt's runs of image tokens {runs} are not its images' {len(images)}")
            return ProcessedPrompt(ids, list(images), linear_positions(len(ids)), 0)
        items = {self.config.image_token_id: ("image", images)}
        if self.config.video_token_id is not None:
            items[self.config.video_token_id] = ("video", videos)
        slots = [i for i, tok in enumerate(ids) if tok in items]
        queues = {}
        for token, (name, given) in items.items():
            count = sum(ids[i] == token for i in slots)
            if count != len(given):
                placeholder = self.tokenizer.convert_ids_to_tokens(token)
                raise ValueError(
                    f"prompt has {count} {name} placeholders ({placeholder}) but {len(given)} {name}s were given"
                )
            queues[token] = iter(given)
        expanded: list[int] = []
        ordered: list[ProcessedImage] = []
        spans: list[VisionSpan] = []
        prev = 0
        start, end = self.config.vision_start_token_id, self.config.vision_end_token_id
        for slot in slots:
            token = ids[slot]
            item = next(queues[token])
            ordered.append(item)
            if item.timestamps is None:
                spans.append(VisionSpan(token, item.grid_thw, item.second_per_grid_t))
                expanded += ids[prev:slot]
                expanded += [*self.image_wrap[:1], *[token] * item.num_tokens, *self.image_wrap[1:]]
                prev = slot + 1
                continue
            # the template's whole <|vision_start|><|video_pad|><|vision_end|> becomes the video's patches (the
            # released processor's rule; a bare <|video_pad|> too)
            whole = prev < slot and ids[slot - 1] == start and ids[slot + 1 : slot + 2] == [end]
            expanded += ids[prev : slot - 1 if whole else slot]
            expanded += self._timestamped_patches(item, spans)
            prev = slot + 2 if whole else slot + 1
        expanded += ids[prev:]
        if not self.config.mrope:
            return ProcessedPrompt(expanded, ordered, linear_positions(len(expanded)), 0)
        positions, delta = mrope_positions(
            expanded, spans, self.config.vision.spatial_merge_size, self.config.vision.tokens_per_second
        )
        return ProcessedPrompt(expanded, ordered, positions, delta)

    def _timestamped_patches(self, video: ProcessedImage, spans: list[VisionSpan]) -> list[int]:
        """Qwen3-VL: each temporal patch as `<t seconds><|vision_start|>` + its tokens + `<|vision_end|>`, t with
        one decimal; every patch its own vision item for the positions (a grid one patch deep)."""
        _, h, w = video.grid_thw
        per_patch = h * w // video.merge_size**2
        token = self.config.video_token_id
        ids: list[int] = []
        for seconds in video.timestamps:
            text = f"<{seconds:.1f} seconds>"
            if text not in self._timestamp_ids:
                if len(self._timestamp_ids) > 65536:  # a bound on what many long videos' times keep
                    self._timestamp_ids.clear()
                self._timestamp_ids[text] = self.tokenizer.encode(text, add_special_tokens=False)
            ids += self._timestamp_ids[text]
            ids += [self.config.vision_start_token_id, *[token] * per_patch, self.config.vision_end_token_id]
            spans.append(VisionSpan(token, (1, h, w)))
        return ids
