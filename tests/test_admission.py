"""Cheap rejections first: prompts too long for max_model_len are refused before the expensive work (templating,
a whole-text tokenizer call, decoding pixels); requests cannot raise the server's image limits; the vision tower
never builds a dense attention mask."""

from __future__ import annotations

import io
import random
import subprocess
import sys

import pytest
import torch
from conftest import our_model, random_image
from PIL import Image

from fovea.config.image import ImageProcessorConfig, smart_resize
from fovea.multimodal.image import ImageProcessor
from fovea.multimodal.prompt import COUNT_CHUNK_CHARS

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def prompts(tiny_dirs):
    return our_model(tiny_dirs["tiny-3b"])[1]


class CountingTokenizer:
    """Wraps a tokenizer, counting the characters it is asked to encode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.chars = tokenizer, 0

    def encode(self, text, **kwargs):
        self.chars += len(text)
        return self.tokenizer.encode(text, **kwargs)


def varied_text(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["the", "Cat", "naïve", "東京", "x=3.14;", "(quoted)", "don't", "\n\n", "  ", "1234567", "😀", "--", "\t"]
    out, size = [], 0
    while size < chars:
        word = rng.choice(words)
        out.append(word + rng.choice([" ", " ", "", "  ", ". "]))
        size += len(out[-1])
    return "".join(out)


def test_the_longest_token_is_read_once_per_tokenizer_and_again_after_added_tokens(tiny_dirs, monkeypatch):
    """Every `LLM` makes a PromptProcessor; the vocabulary as a dict (0.2 s of Qwen's) is read for the first one of
    a tokenizer only, and again when tokens were added to it (a longer token raises the bound)."""
    from transformers import AutoTokenizer

    from fovea.multimodal.prompt import max_token_chars

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dirs["tiny-3b"]))  # a copy of its own: tokens are added
    reads = []
    get_vocab = tokenizer.get_vocab
    monkeypatch.setattr(tokenizer, "get_vocab", lambda: reads.append(1) or get_vocab())
    longest = max(map(len, get_vocab()))
    assert [max_token_chars(tokenizer), max_token_chars(tokenizer), max_token_chars(tokenizer)] == [longest] * 3
    assert len(reads) == 1
    tokenizer.add_tokens(["<|" + "z" * (longest + 40) + "|>"])
    assert max_token_chars(tokenizer) == longest + 44 and len(reads) == 2


def test_text_far_too_long_is_refused_before_tokenizing(prompts, monkeypatch):
    counting = CountingTokenizer(prompts.tokenizer)
    monkeypatch.setattr(prompts, "tokenizer", counting)
    with pytest.raises(ValueError, match=r"\(length at least \d+\) is longer than the maximum model length of 512"):
        prompts.encode("x" * (512 * prompts.max_token_chars + 1), max_tokens=512)
    assert counting.chars == 0
    # long enough to pass the character bound, still too long: counted chunk by chunk, stopped early
    text = varied_text(40 * COUNT_CHUNK_CHARS)
    with pytest.raises(ValueError, match="maximum model length of 2000"):
        prompts.encode(text, max_tokens=2000)
    assert counting.chars < 3 * COUNT_CHUNK_CHARS


def test_chunked_counting_is_exact_for_the_qwen_tokenizer(prompts):
    """Chunks end before a space that follows a non-space: a boundary of Qwen2's pre-tokenizer, so the chunk
    counts add up to the whole text's count, and a prompt of exactly max_model_len tokens still passes."""
    for seed in range(3):
        text = varied_text(5 * COUNT_CHUNK_CHARS, seed)
        whole = len(prompts.tokenizer.encode(text, add_special_tokens=False))
        assert prompts._count_up_to(text, whole) == whole
        assert prompts.encode(text, max_tokens=whole) == prompts.tokenizer.encode(text, add_special_tokens=False)


def test_lone_surrogates_are_bad_input(prompts):
    with pytest.raises(ValueError, match="surrogate"):
        prompts.encode("a\ud800b")


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height and holds no pixel data: decoding it fails."""
    buffer = io.BytesIO()
    Image.new("RGB", (width, height)).save(buffer, format="PNG")
    raw = buffer.getvalue()
    return raw[: raw.index(b"IDAT") - 4] + raw[raw.index(b"IEND") - 4 :]


def test_images_are_counted_before_their_pixels_are_decoded(prompts):
    header_only = png_header(4000, 3000)
    with pytest.raises(ValueError, match=r"\(length \d+\) is longer than the maximum model length of 512"):
        prompts.process(IMAGE, [header_only], max_tokens=512)
    with pytest.raises(ValueError, match="not a readable image"):  # what decoding it would have said
        prompts.process(IMAGE, [header_only], {"max_pixels": 56 * 56}, max_tokens=512)


def test_request_pixel_limits_cannot_exceed_the_servers():
    processor = ImageProcessor(ImageProcessorConfig(max_pixels=100_000))
    tiny, large = random_image(8, 8, 1), random_image(1000, 800, 2)
    for image, overrides in ((tiny, {"min_pixels": 40_000_000}), (large, {"max_pixels": 10**12})):
        planned = processor.plan(image, overrides)  # as if the request had asked for the server's max_pixels
        capped = {key: 100_000 for key in overrides}
        assert (planned.height, planned.width) == smart_resize(
            image.height, image.width, 28, capped.get("min_pixels", 3136), 100_000
        )
    assert (
        processor.plan(large, {"max_pixels": 50_000}).height * processor.plan(large, {"max_pixels": 50_000}).width
        <= 50_000
    )  # lowering still works


def test_vision_attention_never_builds_a_dense_mask(tiny_dirs, monkeypatch):
    import torch.nn.functional as F

    model = our_model(tiny_dirs["tiny-3b"])[0]
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("attn_mask"))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    grids = [(1, 20, 28), (1, 8, 8), (1, 12, 6)]  # three images: several windows and frames of different sizes
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), model.config.vision.patch_dim)
    with torch.inference_mode():
        model.encode_images(pixels, grids)
    assert calls and all(mask is None for mask in calls)


MEMORY_PROBE = """
import resource, torch
from fovea.attention.layer import AttentionMetadata, varlen_attention
torch.set_num_threads(1)
q, k, v = (torch.randn(16384, 2, 16) for _ in range(3))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for lengths in ([16384], [8192, 8128, 64]):  # one large image, then several of different sizes
    meta = AttentionMetadata.from_lengths(lengths)
    varlen_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen, causal=False, scale=0.25, lengths=meta.lengths)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_attention_over_large_images_stays_small():
    """16384 patches of one image: scores for every pair would take 2 GB for this tiny tower's two heads (the
    previous code asked for 34 GB for an 8192x8192 image); the memory-efficient kernels need a few MB."""
    grew_mb = int(
        subprocess.run([sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True, check=True).stdout
    )
    assert grew_mb < 200, grew_mb
