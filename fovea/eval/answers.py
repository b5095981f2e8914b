"""From a model's raw answer to one of the task's options, or None (counted as `missing`).

The prompt asks for JSON such as {"answer": "yes"}; models wrap it in code fences, add prose around it, or answer
with a bare word. Extraction tries, in order: a JSON object anywhere in the text (its "answer" field, or its only
value), then the text itself as an option or a synonym, then the one option (or synonym) that occurs as a whole
word in the text. Two different options found that way is ambiguous: None.
"""

from __future__ import annotations

import json
import re

# words models use for the usual binary options
DEFAULT_SYNONYMS = {"yes": ["true", "positive", "present", "y"], "no": ["false", "negative", "absent", "n"]}
JSON_OBJECT = re.compile(r"\{[^{}]*\}", re.DOTALL)


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().strip(".!\"'`").strip()).lower()


def _match(value: str, lookup: dict[str, str]) -> str | None:
    return lookup.get(normalize(value))


def extract_answer(text: str, options: list[str], synonyms: dict[str, list[str]] | None = None) -> str | None:
    lookup = {normalize(option): option for option in options}
    synonyms = DEFAULT_SYNONYMS if synonyms is None else synonyms
    for option in options:
        for word in synonyms.get(normalize(option), []):
            lookup.setdefault(normalize(word), option)
    for candidate in JSON_OBJECT.findall(text):
        try:
            parsed = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(parsed, dict):
            value = parsed.get("answer", next(iter(parsed.values())) if len(parsed) == 1 else None)
            if value is not None and (found := _match(str(value), lookup)):
                return found
    if found := _match(text, lookup):
        return found
    words = set(re.findall(r"[\w-]+", text.lower()))
    hits = {option for key, option in lookup.items() if key in words or (" " in key and key in normalize(text))}
    return hits.pop() if len(hits) == 1 else None
