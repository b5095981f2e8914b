"""The engine's tokenizer: token ids to text (outputs, log-probabilities) and the vocabulary of the grammar engine.

The engine never encodes text (the front end does, with transformers' tokenizer and its chat templates), so it
reads the checkpoint's tokenizer.json with the tokenizers library alone: a server's engine process then never
imports transformers, 1.5-4 s of every start. Checkpoints whose decoding needs transformers (no tokenizer.json,
its space clean-up, added tokens only tokenizer_config.json lists) get transformers' tokenizer, as before.
"""

from __future__ import annotations

import json
from pathlib import Path


class TokenTexts:
    """The part of transformers' fast tokenizer the engine uses, over the same tokenizers.Tokenizer."""

    def __init__(self, backend):
        self.backend_tokenizer = backend
        self.added_tokens_decoder = backend.get_added_tokens_decoder()  # id -> AddedToken

    def decode(self, token_ids: list[int]) -> str:
        return self.backend_tokenizer.decode(token_ids, skip_special_tokens=False)


def load_engine_tokenizer(model_dir: str | Path):
    path = Path(model_dir)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if not (path / "tokenizer.json").is_file() or config.get("clean_up_tokenization_spaces"):
        return transformers_tokenizer(model_dir)
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    texts = TokenTexts(backend)
    if {int(i) for i in config.get("added_tokens_decoder", {})} - set(texts.added_tokens_decoder):
        return transformers_tokenizer(model_dir)
    # the engine never encodes: the grammar engine reads the vocabulary without a padding or truncation setting
    backend.no_padding()
    backend.no_truncation()
    return texts


def transformers_tokenizer(model_dir: str | Path):
    from fovea.multimodal.prompt import load_tokenizer  # imported only here: its chat-template modules take 0.2 s

    return load_tokenizer(model_dir)
