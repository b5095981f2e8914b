"""From a user's prompt (chat messages or text + images) to what the model consumes.

chat messages (OpenAI content parts) -> the checkpoint's chat template -> token ids -> each image's single
`<|image_pad|>` expanded to its t*h*w/4 placeholder tokens -> M-RoPE positions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

import numpy as np

from fovea.config import ModelConfig
from fovea.models.mrope_positions import VisionSpan, mrope_positions
from fovea.multimodal.image import ImageProcessor, ImageProcessorConfig, ProcessedImage


@dataclass
class ProcessedPrompt:
    token_ids: list[int]
    images: list[ProcessedImage] = field(default_factory=list)
    positions: np.ndarray | None = None  # (3, len(token_ids)) M-RoPE positions
    mrope_delta: int = 0
    text: str | None = None  # the prompt as text, when it was given as text (chat: the rendered template)


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer  # heavy import, only where a tokenizer is needed

    return AutoTokenizer.from_pretrained(str(model_dir))


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


def split_chat_images(messages: list[dict]) -> tuple[list[dict], list]:
    """Replaces image content parts by {"type": "image"} (what the template expects) and collects the images.

    Accepted parts: text; image_url ({"url": ...} or a plain string); image_pil (a PIL image); image.
    """
    images, normalized = [], []
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"each chat message needs a 'role', got {message!r}")
        content = message.get("content")
        if content is None or isinstance(content, str):
            normalized.append({**message, "content": content or ""})
            continue
        if not isinstance(content, list):
            raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind in ("image_url", "image_pil", "image"):
                source = part.get(kind)
                if kind == "image_url" and isinstance(source, dict):
                    source = source.get("url")
                if source is None:
                    raise ValueError(f"content part of type {kind!r} has no {kind!r} field")
                images.append(source)
                parts.append({"type": "image"})
            else:
                raise ValueError(f"unsupported content part type {kind!r}; use text, image_url or image_pil")
        normalized.append({**message, "content": parts})
    return normalized, images


class PromptProcessor:
    def __init__(self, model_dir: str | Path, config: ModelConfig, chat_template: str | None = None,
                 mm_processor_kwargs: dict | None = None):
        self.config = config
        self.tokenizer = load_tokenizer(model_dir)
        self.chat_template = chat_template or find_chat_template(model_dir, self.tokenizer)
        image_cfg = ImageProcessorConfig.from_dir(model_dir).with_overrides(mm_processor_kwargs)
        self.image_processor = ImageProcessor(image_cfg)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> tuple[str, list]:
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("the model has no chat template; pass one with chat_template=")
        normalized, images = split_chat_images(messages)
        try:
            text = self.tokenizer.apply_chat_template(normalized, chat_template=template, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as exc:  # a template's raise_exception, or a bad template sent with a request
            raise ValueError(f"the chat template failed on these messages: {exc}") from None
        return text, images

    def process_chat(self, messages: list[dict], mm_processor_kwargs: dict | None = None) -> ProcessedPrompt:
        text, images = self.render_chat(messages)
        return self.process(text, images, mm_processor_kwargs)

    def process(self, prompt: str | list[int], images: list = (),
                mm_processor_kwargs: dict | None = None) -> ProcessedPrompt:
        """`prompt` holds one `<|image_pad|>` per image (as the chat template writes it), or is token ids."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
        processed = [self.image_processor(image, mm_processor_kwargs) for image in images]
        result = self.expand(ids, processed)
        result.text = prompt if isinstance(prompt, str) else None
        return result

    def expand(self, ids: list[int], images: list[ProcessedImage]) -> ProcessedPrompt:
        image_id = self.config.image_token_id
        slots = [i for i, tok in enumerate(ids) if tok == image_id]
        if len(slots) != len(images):
            raise ValueError(f"prompt has {len(slots)} image placeholders (<|image_pad|>) but {len(images)} "
                             "images were given")
        expanded: list[int] = []
        prev = 0
        for slot, image in zip(slots, images):
            expanded += ids[prev:slot]
            expanded += [image_id] * image.num_tokens
            prev = slot + 1
        expanded += ids[prev:]
        spans = [VisionSpan(image_id, image.grid_thw) for image in images]
        positions, delta = mrope_positions(expanded, spans, self.config.vision.spatial_merge_size,
                                           self.config.vision.tokens_per_second)
        return ProcessedPrompt(expanded, images, positions, delta)
