"""Chat messages split into text and media, and the shape of message content a chat template expects.

OpenAI's messages carry content as a list of parts (text, image, video). Templates written for that shape
("openai": Qwen's, transformers' LLaVA template) loop over `message['content']`; older ones ("string": vLLM's
template_llava.jinja and many fine-tunes') add `message['content']` to strings and fail on a list. As vLLM does
(`--chat-template-content-format auto`), the format is read off the template's syntax tree: a for-loop over a
message's content, directly or through a variable set from it or a macro's parameter given it, means
"openai". For a "string" template each
message's text parts are joined with newlines, after one placeholder line per image or video (the model's own
placeholder text, e.g. LLaVA's `<image>` or Qwen's `<|vision_start|><|image_pad|><|vision_end|>`).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field

import jinja2
from jinja2 import nodes

CONTENT_FORMATS = ("auto", "string", "openai")


def _is_content(node: nodes.Node, names: set[str]) -> bool:
    """`x['content']`, `x.content`, a variable set from one of those, or either through filters."""
    while isinstance(node, nodes.Filter):
        node = node.node
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        return node.arg.value == "content"
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, nodes.Name) and node.name in names


_FORMATS: OrderedDict[bytes, str] = OrderedDict()  # by the template's digest: the template itself is not kept


def detect_content_format(template: str) -> str:
    """ "openai" when the template iterates over a message's content, else "string" (also for one that does not
    parse: rendering it will say what is wrong). A client's template is read in the template sandbox only."""
    key = hashlib.blake2b(template.encode(), digest_size=16).digest()
    found = _FORMATS.get(key)
    if found is None:
        found = _FORMATS[key] = _detect_content_format(template)
        while len(_FORMATS) > 64:
            _FORMATS.popitem(last=False)
    return found


def _detect_content_format(template: str) -> str:
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    names: set[str] = set()  # variables that hold a message's content: set from it, or a macro's parameter
    macros = {macro.name: [arg.name for arg in macro.args] for macro in tree.find_all(nodes.Macro)}
    for assign in tree.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and _is_content(assign.node, names):
            names.add(assign.target.name)
    for call in tree.find_all(nodes.Call):
        if isinstance(call.node, nodes.Name) and call.node.name in macros:
            params = macros[call.node.name]
            names |= {params[i] for i, arg in enumerate(call.args[: len(params)]) if _is_content(arg, names)}
    return "openai" if any(_is_content(loop.iter, names) for loop in tree.find_all(nodes.For)) else "string"


def as_string_content(messages: list[dict], placeholders: dict[str, str]) -> list[dict]:
    """Messages whose content is a list of parts, with the content as one string (vLLM's "string" format)."""
    converted = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            media = [placeholders[part["type"]] for part in content if part["type"] in placeholders]
            texts = [part["text"] for part in content if part["type"] == "text"]
            content = "\n".join(media + texts)
        converted.append({**message, "content": content})
    return converted


@dataclass
class ChatMedia:
    images: list = field(default_factory=list)
    videos: list = field(default_factory=list)


MEDIA_PARTS = {"image_url": "image", "image_pil": "image", "image": "image", "video_url": "video", "video": "video"}


def split_chat_media(messages: list[dict]) -> tuple[list[dict], ChatMedia]:
    """Replaces image and video content parts by {"type": "image"} / {"type": "video"} (what the template
    expects) and collects their sources.

    Accepted parts: text; image_url / video_url ({"url": ...} or a plain string); image_pil (a PIL image); image
    and video (anything multi_modal_data takes); image_embeds (multimodal/embeds.py).
    """
    media, normalized = ChatMedia(), []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError("each chat message needs a 'role' that is a string")
        if message.get("tool_calls"):
            message = {**message, "tool_calls": [template_tool_call(call) for call in message["tool_calls"]]}
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
                if not isinstance(part.get("text", ""), str):
                    raise ValueError("a text content part's 'text' must be a string")
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind == "image_embeds":  # vLLM's part: a base64 tensor, or {image_embeds, image_grid_thw}
                source = part.get("image_embeds")
                if source is None:
                    raise ValueError("content part of type 'image_embeds' has no 'image_embeds' field")
                media.images.append(source if isinstance(source, dict) else {"image_embeds": source})
                parts.append({"type": "image"})
            elif kind in MEDIA_PARTS:
                source = part.get(kind)
                if kind.endswith("_url") and isinstance(source, dict):
                    source = source.get("url")
                if source is None:
                    raise ValueError(f"content part of type {kind!r} has no {kind!r} field")
                (media.images if MEDIA_PARTS[kind] == "image" else media.videos).append(source)
                parts.append({"type": MEDIA_PARTS[kind]})
            else:
                raise ValueError(
                    f"unsupported content part type {kind!r}; use text, image_url, video_url, image_embeds or image_pil"
                )
        normalized.append({**message, "content": parts})
    return normalized, media


def template_tool_call(call) -> dict:
    """An assistant's earlier call with its arguments as an object: templates write them with tojson (vLLM
    passes them so too), and OpenAI clients send them as JSON text."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError("each of an assistant message's tool_calls needs a function with a name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ValueError(f"the arguments of tool call {function['name']!r} are not JSON") from None
    return {**call, "function": {**function, "arguments": arguments}}


def text_length(messages: list[dict]) -> int:
    """Characters of text in (normalized) chat messages."""
    total = 0
    for message in messages:
        content = message["content"]
        total += len(content) if isinstance(content, str) else sum(len(p.get("text", "")) for p in content)
    return total
