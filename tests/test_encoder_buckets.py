"""Encoder shape buckets: padding a step's images up to a bucket must not change their embeddings or tokens."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import image_patches, random_image  # noqa: E402

from fovea import LLM, SamplingParams  # noqa: E402
from fovea.config.engine import parse_buckets  # noqa: E402
from fovea.models.base import ModelOptions
from fovea.models.loader import load_model  # noqa: E402
from fovea.multimodal.image import ImageProcessor  # noqa: E402
from fovea.runner.encoder_buckets import EncoderBuckets  # noqa: E402


def test_parse_buckets():
    assert parse_buckets("4096,1024", 4) == [1024, 4096]
    assert parse_buckets([64, 64, 16], 4) == [16, 64]
    assert parse_buckets(None, 4) == []
    with pytest.raises(ValueError, match="multiples of 4"):
        parse_buckets("1000,1002", 4)
    with pytest.raises(ValueError, match="multiples of 4"):
        parse_buckets([0], 4)


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "triton"])
def test_padded_bucket_gives_the_unpadded_embeddings(tiny_dirs, kernel):
    """Three images (24 + 48 + 16 patches) in a 128-patch bucket: 40 filler patches, windows and full-attention
    frames alike. With our kernel the tile tables are padded to the bucket's fixed size too."""
    # the kernel on the GPU where there is one (without: under Triton's interpreter, on the CPU)
    device = torch.device("cuda" if kernel and torch.cuda.is_available() else "cpu")
    model, _ = load_model(
        tiny_dirs["tiny-7b"], dtype="float32", device=device, options=ModelOptions(vision_kernel=kernel)
    )
    processor = ImageProcessor()
    images = [processor(random_image(w, h, seed=i)) for i, (w, h) in enumerate([(84, 56), (112, 84), (56, 56)])]
    pixels = image_patches(images).to(device)
    grids = [im.grid_thw for im in images]
    assert pixels.shape[0] == 88
    expected = model.visual(pixels, grids)
    buckets = EncoderBuckets(model.visual, [64, 128, 512], torch.float32, device, capture=False)
    assert buckets.bucket(88) == 128 and buckets.bucket(513) is None
    got = buckets.encode(pixels, grids, 128)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_engine_with_buckets_gives_the_same_tokens(tiny_dirs, fovea_log):
    image = random_image(84, 56, seed=3)
    conversations = [
        [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "What?"}]}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_pil", "image_pil": random_image(112, 84, seed=4)},
                    {"type": "image_pil", "image_pil": image},
                    {"type": "text", "text": "Both?"},
                ],
            }
        ],
    ]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    options = dict(dtype="float32", max_model_len=512, enable_prefix_caching=False)
    expected = [
        o.outputs[0].token_ids
        for o in LLM(str(tiny_dirs["tiny-3b"]), **options).chat(conversations, params, use_tqdm=False)
    ]
    llm = LLM(str(tiny_dirs["tiny-3b"]), mm_buckets=[64, 256], **options)
    log = fovea_log.text
    done = "captured" if torch.cuda.is_available() else "warmed up"  # graphs on a GPU, eager runs without
    assert f"vision encoder bucket 64 patches: {done}" in log and f"bucket 256 patches: {done}" in log
    buckets = llm.engine.runner.encoder_buckets
    used = []
    encode = buckets.encode
    buckets.encode = lambda pixels, grids, size: used.append((pixels.shape[0], size)) or encode(pixels, grids, size)
    got = [o.outputs[0].token_ids for o in llm.chat(conversations, params, use_tqdm=False)]
    assert used and all(real < size for real, size in used)  # every encode padded
    assert got == expected
    with pytest.raises(ValueError, match="multiples of 4"):
        LLM(str(tiny_dirs["tiny-3b"]), mm_buckets=[30], **options)
