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
    for cuts in ([], [3], [1, 2, 9], list(range(1, len(ids)))):  # whole outputs and deltas of any size, in one call
        whole = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello", add_special_tokens=False), skip)
        parts = [whole.decode_all(ids[a:b]) for a, b in zip([0, *cuts], [*cuts, len(ids)])]
        assert "".join(parts) == "".join(pieces), cuts
    # an output that ends inside a character (max_tokens cut it): its text up to that character, in one call too
    # (the whole text was lost when the call's last ids were a partial character)
    cut = ids + tokenizer.encode("𓀀", add_special_tokens=False)[:-1]  # three tokens: two partial ones
    whole = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello", add_special_tokens=False), skip)
    assert whole.decode_all(cut) == "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)
    stepped = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello", add_special_tokens=False), skip)
    assert "".join(stepped.decode_all(cut[i : i + 5]) for i in range(0, len(cut), 5)) == "".join(pieces)


def test_whole_outputs_and_deltas_of_random_bytes_give_the_one_at_a_time_text(tokenizer):
    """Outputs of lone byte tokens (runs of invalid UTF-8 of any length, partial characters) among text, decoded
    in one call or in deltas of random sizes: the same text as one token at a time. (The served cross-talk fuzz
    found a whole output ending in five invalid bytes without any text: one call held all of it back.)"""
    import random

    byte_tokens = [i for token, i in tokenizer.get_vocab().items() if len(token) == 1]  # byte-level: one per byte
    high_bytes = [i for i in byte_tokens if tokenizer.decode([i]) == "\ufffd"]  # not a character alone
    text_tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(byte_tokens) >= 256 and len(high_bytes) == 128
    rng = random.Random(0)
    for _ in range(300):
        pools = rng.choices([high_bytes, byte_tokens, text_tokens], [5, 2, 3], k=rng.randint(1, 30))
        ids = [rng.choice(pool) for pool in pools]
        one = IncrementalDetokenizer(tokenizer, [9707, 11])
        expected = [one.decode(i) for i in ids]
        cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(0, min(3, len(ids) - 1))))
        whole = IncrementalDetokenizer(tokenizer, [9707, 11])
        parts = [whole.decode_all(ids[a:b]) for a, b in zip([0, *cuts], [*cuts, len(ids)])]
        assert "".join(parts) == "".join(expected), (ids, cuts)
        assert parts[-1] == "".join(expected[cuts[-1] if cuts else 0 :]), (ids, cuts)


def test_special_tokens_without_spaces_between_them(tokenizer):
    ids = tokenizer.encode("<|im_end|><|im_start|>user", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False, spaces_between_special_tokens=False)
    assert "".join(detok.decode(i) for i in ids) == "<|im_end|><|im_start|>user"
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False, spaces_between_special_tokens=False)
    assert detok.decode_all(ids) == "<|im_end|><|im_start|>user"


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
        assert IncrementalDetokenizer(small, [1, 50, 60]).decode_all(ids) == text  # one call, the same text


def _vocabularies(tiny_dirs, tmp_path):
    from fovea.testing.tiny import write_tokenizer_files
    from fovea.testing.tiny_llava import write_llava_checkpoint

    qwen3 = tmp_path / "qwen3"
    qwen3.mkdir()
    write_tokenizer_files(qwen3, qwen3=True)
    return [tiny_dirs["tiny-3b"], qwen3, write_llava_checkpoint(tmp_path / "llava", seed=1)]


def test_the_engines_tokenizer_gives_transformers_texts(tiny_dirs, tmp_path):
    """The engine reads tokenizer.json with the tokenizers library alone (no transformers in its process): every
    token's text, whole texts and streamed pieces are transformers' (Qwen2.5's, Qwen3's and LLaVA's vocabularies)."""
    from fovea.engine.tokenizer import TokenTexts, load_engine_tokenizer

    for model_dir in _vocabularies(tiny_dirs, tmp_path):
        ours, reference = load_engine_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
        assert isinstance(ours, TokenTexts), model_dir
        size = len(reference)
        ids = list(range(0, size, max(1, size // 3000))) + list(reference.added_tokens_decoder)
        assert [ours.decode([i]) for i in ids] == [reference.decode([i]) for i in ids]
        assert {i: t.content for i, t in ours.added_tokens_decoder.items()} == {
            i: t.content for i, t in reference.added_tokens_decoder.items()
        }
        text = reference.encode(TEXT, add_special_tokens=False) + ids[:40]
        assert ours.decode(text) == reference.decode(text)
        for skip, spaces in [(True, True), (False, True), (False, False)]:
            streams = [IncrementalDetokenizer(t, text[:5], skip, spaces) for t in (ours, reference)]
            assert [streams[0].decode(i) for i in text] == [streams[1].decode(i) for i in text]


def test_checkpoints_that_decode_through_transformers_keep_its_tokenizer(tiny_dirs, tmp_path):
    """Space clean-up after decoding, or added tokens that only tokenizer_config.json lists: transformers'."""
    import json
    import shutil

    from fovea.engine.tokenizer import TokenTexts, load_engine_tokenizer

    for change in ("clean_up", "added_token"):
        model_dir = tmp_path / change
        shutil.copytree(tiny_dirs["tiny-3b"], model_dir)
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        if change == "clean_up":
            config["clean_up_tokenization_spaces"] = True
        else:
            config.setdefault("added_tokens_decoder", {})["151999"] = {"content": "<extra>", "special": True}
        config_file.write_text(json.dumps(config))
        assert not isinstance(load_engine_tokenizer(model_dir), TokenTexts), change


def test_a_served_engine_never_imports_transformers(tiny_dirs):
    import subprocess
    import sys

    script = (
        "import sys; from fovea.config.engine import EngineConfig; from fovea.engine.engine import LLMEngine; "
        f"engine = LLMEngine(EngineConfig.from_args({str(tiny_dirs['tiny-3b'])!r}, dtype='float32', "
        "max_model_len=512, num_gpu_blocks_override=40)); "
        "engine.grammars.warm_up(); print([m for m in ('transformers', 'jinja2') if m in sys.modules])"
    )  # jinja2: the chat templates' modules, the front end's (0.2 s of the engine's start when they came along)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "[]", (
        done.stdout[-500:] + done.stderr[-2000:]
    )
