"""Image preprocessing against transformers' Qwen2VLImageProcessorPil, plus loading and the smart_resize facts."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from conftest import image_patches, jpeg_bytes, random_image
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from fovea.config.image import smart_resize
from fovea.config.model import ModelConfig
from fovea.multimodal.image import ImageProcessor, load_image


def reference(image, **kwargs):
    out = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056, **kwargs)(images=[image], return_tensors="np")
    return out["pixel_values"], tuple(out["image_grid_thw"][0].tolist())


def alpha_image(width, height, mode):
    rng = np.random.default_rng(width)
    rgba = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    if mode == "P_transparent":
        p = random_image(width, height, 3).convert("P")
        p.info["transparency"] = 0
        return p
    return rgba if mode == "RGBA" else rgba.convert(mode)


@pytest.mark.parametrize(
    "width,height,mode",
    [
        (640, 480, "RGB"),
        (1280, 720, "RGB"),
        (333, 517, "RGB"),
        (56, 56, "RGB"),
        (20, 30, "RGB"),
        (1000, 100, "RGB"),
        (97, 1203, "RGB"),
        (300, 200, "RGBA"),
        (250, 180, "L"),
        (199, 301, "P"),
        (160, 120, "LA"),
        (144, 144, "P_transparent"),
        (321, 123, "CMYK"),
        (64, 48, "1"),
    ],
)
def test_matches_transformers(width, height, mode):
    if mode in ("RGBA", "LA", "P_transparent"):
        image = alpha_image(width, height, mode)
    else:
        image = random_image(width, height, seed=width * height, mode=mode)
    ref_pixels, ref_grid = reference(image)
    ours = ImageProcessor()(image)
    assert ours.grid_thw == ref_grid
    assert np.array_equal(image_patches([ours], frames=2).numpy(), ref_pixels)  # bit for bit


@pytest.mark.parametrize(
    "overrides",
    [
        {"max_pixels": 100_000},
        {"min_pixels": 200_000},
        {"min_pixels": 50_000, "max_pixels": 60_000},
        {"max_pixels": 784},
    ],
)
def test_min_max_overrides_match_transformers(overrides):
    image = random_image(500, 375, seed=7)
    ref = Qwen2VLImageProcessorPil(**{"min_pixels": 3136, "max_pixels": 12845056, **overrides})(
        images=[image], return_tensors="np"
    )
    ours = ImageProcessor()(image, overrides)
    assert ours.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
    assert np.array_equal(image_patches([ours], frames=2).numpy(), ref["pixel_values"])


def test_checkpoint_config_and_its_overrides(tiny_dirs):
    cfg = ModelConfig.from_dir(tiny_dirs["tiny-3b"]).image
    assert (cfg.min_pixels, cfg.max_pixels, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size) == (
        3136,
        12845056,
        14,
        2,
        2,
    )
    assert cfg.with_overrides({"max_pixels": 5000}).max_pixels == 5000
    with pytest.raises(ValueError, match="unsupported mm_processor_kwargs"):
        cfg.with_overrides({"resized_height": 2})
    with pytest.raises(ValueError, match="positive integer"):
        cfg.with_overrides({"max_pixels": -3})


@pytest.mark.parametrize("width,height,tokens", [(640, 480, 391), (1280, 720, 1196), (224, 168, 48), (56, 56, 4)])
def test_token_counts_from_the_facts_sheet(width, height, tokens):
    assert ImageProcessor()(random_image(width, height)).num_tokens == tokens


def test_smart_resize_formula():
    assert smart_resize(480, 640) == (476, 644)  # rounded to multiples of 28
    h, w = smart_resize(4000, 6000, max_pixels=12845056)  # above max_pixels: floor after scaling down
    assert h * w <= 12845056 and h % 28 == 0 and w % 28 == 0 and (h, w) == (2912, 4368)
    h, w = smart_resize(10, 10, min_pixels=3136)  # below min_pixels: ceil after scaling up
    assert (h, w) == (56, 56)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2010)
    with pytest.raises(ValueError, match="no pixels"):
        smart_resize(0, 100)


def test_load_image_sources(tmp_path):
    image = random_image(120, 80, seed=3)
    data = jpeg_bytes(image)
    path = tmp_path / "x.jpg"
    path.write_bytes(data)
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    decoded = [load_image(s) for s in (data, str(path), path, f"file://{path}", url)]
    for d in decoded:
        assert d.size == (120, 80)
        assert np.array_equal(np.asarray(d), np.asarray(decoded[0]))
    assert load_image(image) is image


@pytest.mark.parametrize(
    "source,message",
    [
        (b"not an image at all", "not a readable image"),
        ("data:image/png;base64,@@@", "invalid base64"),
        ("data:image/png,abc", "data URL must look like"),
        ("/nonexistent/file.png", "not found"),
        ("http://127.0.0.1:9/x.png", "could not fetch image"),  # nothing listens on the discard port
        (12345, "cannot load an image"),
    ],
)
def test_load_image_errors(source, message):
    with pytest.raises(ValueError, match=message):
        load_image(source)


@pytest.mark.parametrize("kind", ["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"])
def test_the_common_formats_open(kind):
    image = random_image(40, 30, seed=4)
    buf = io.BytesIO()
    image.save(buf, format=kind)
    assert load_image(buf.getvalue()).size == (40, 30)


@pytest.mark.parametrize("kind", ["EPS", "PCX", "TGA", "PPM", "ICO", "SGI", "IM"])
def test_other_formats_are_refused_before_any_decoder_runs(kind, monkeypatch):
    """Pillow knows more formats than an image request needs; some hand the bytes on (EPS to Ghostscript). Only
    the listed ones are opened, and the error names them, not the file object."""
    buf = io.BytesIO()
    if kind == "EPS":
        buf.write(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 40 30\n%%EndComments\nshowpage\n")
    else:
        random_image(40, 30, seed=4).save(buf, format=kind)
    refused = r"image bytes is not a readable image in a supported format \(JPEG, "
    with pytest.raises(ValueError, match=refused) as error:
        load_image(buf.getvalue())
    assert "0x" not in str(error.value) and "BytesIO" not in str(error.value)


def test_truncated_jpeg_is_rejected():
    data = jpeg_bytes(random_image(200, 200))
    with pytest.raises(ValueError, match="not a readable image"):
        load_image(data[: len(data) // 3])


def test_extreme_aspect_ratio_is_rejected():
    with pytest.raises(ValueError, match="aspect ratio"):
        ImageProcessor()(Image.new("RGB", (3000, 10)))


def test_processing_is_deterministic_and_order_is_merge_groups():
    # Each merge group (2x2 patches) must be 4 consecutive rows: check on an image whose patches are constant.
    tiles = np.zeros((56, 56, 3), dtype=np.uint8)
    for r in range(4):
        for c in range(4):
            tiles[r * 14 : (r + 1) * 14, c * 14 : (c + 1) * 14] = 10 * (4 * r + c)
    out = ImageProcessor()(Image.fromarray(tiles))
    first_value = (image_patches([out])[:, 0].numpy() * 0.26862954 + 0.48145466) * 255  # undo normalize, channel 0
    order = np.rint(first_value / 10).astype(int).tolist()
    assert order == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]


def test_float32_rescale_equals_the_float64_reference_route():
    values = np.arange(256)
    reference_route = (values.astype(np.float64) * (1 / 255)).astype(np.float32)
    assert np.array_equal(values.astype(np.float32) / np.float32(255), reference_route)


def test_large_jpegs_decode_at_reduced_scale_others_exactly():
    """A JPEG at least twice its target size on both sides is decoded at a reduced scale (Image.draft), which
    changes pixels by about half a grey level on average; below that it equals transformers bit for bit."""
    from fovea.config.image import ImageProcessorConfig

    big = jpeg_bytes(random_image(3000, 2000, seed=4))
    for max_pixels, exact in ((1_000_000, True), (200_000, False)):  # 3000 / 1204 < 2; 3000 / 532 > 2
        ours = image_patches([ImageProcessor(ImageProcessorConfig(max_pixels=max_pixels))(big)], frames=2).numpy()
        ref = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=max_pixels)(
            images=[Image.open(io.BytesIO(big))], return_tensors="np"
        )["pixel_values"]
        difference = np.abs(ours - ref)
        assert (difference.max() == 0) == exact
        assert difference.mean() < 0.02 and difference.max() < 0.2  # normalized units: 0.02 is ~1.4 grey levels
