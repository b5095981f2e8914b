"""Incremental detokenization: whole characters only, the same text as a one-shot decode; stop-string search."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from fovea.engine.outputs import IncrementalDetokenizer, find_stop_string

TEXT = "Grüße 🌊🐟 日本語のテキスト — ok<|im_end|><|im_start|> done ✓"


@pytest.fixture(scope="module")
def tokenizer(tiny_dirs):
    return AutoTokenizer.from_pretrained(str(tiny_dirs["tiny-3b"]))


@pytest.mark.parametrize("skip", [True, False])
def test_streamed_pieces_are_whole_characters_and_add_up(tokenizer, skip):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello", add_special_tokens=False), skip)
    pieces = [detok.decode(i) for i in ids]
    assert "" in pieces  # some emoji bytes span several tokens: nothing is shown until the character is whole
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(pieces)) is not skip


def test_special_tokens_without_spaces_between_them(tokenizer):
    ids = tokenizer.encode("<|im_end|><|im_start|>user", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False, spaces_between_special_tokens=False)
    assert "".join(detok.decode(i) for i in ids) == "<|im_end|><|im_start|>user"


def test_stop_string_search_only_looks_at_new_text():
    assert find_stop_string("abc STOP def", 4, ["STOP"]) is None  # the match ended before the new text
    assert find_stop_string("abc ST", 2, ["STOP"]) is None
    assert find_stop_string("abc STOP", 2, ["STOP"]) == ("STOP", 4)  # completed by the new characters
    assert find_stop_string("xx ab cd", 5, ["cd", "ab"]) == ("ab", 3)  # earliest end wins


def test_ids_past_a_small_tokenizer_give_no_text_and_leave_the_stream_intact(tmp_path):
    """LLaVA's tiny byte-level BPE has 602 ids under a 32,064-row embedding, as padded checkpoints do: ids past it
    give no text and do not disturb the characters around them (the server and offline share this path)."""
    import random

    from fovea.testing.tiny_llava import write_llava_checkpoint

    small = AutoTokenizer.from_pretrained(str(write_llava_checkpoint(tmp_path / "llava", seed=1)))
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice([rng.randrange(3, len(small)), rng.randrange(len(small), 32064)]) for _ in range(8)]
        detok = IncrementalDetokenizer(small, [1, 50, 60])
        text = "".join(detok.decode(i) for i in ids)
        whole = small.decode([i for i in ids if i < len(small)], skip_special_tokens=True)
        assert text == whole.rstrip("\ufffd")  # bytes of a character still partial at the end are held back
