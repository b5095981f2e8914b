"""Which shape of message content a chat template expects, and messages turned into that shape.

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

import functools

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


@functools.lru_cache(maxsize=64)
def detect_content_format(template: str) -> str:
    """ "openai" when the template iterates over a message's content, else "string" (also for one that does not
    parse: rendering it will say what is wrong)."""
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
