"""Qwen2-VL image preprocessing with Pillow and numpy, up to the resized pixels: open -> plan the size -> decode
-> RGB -> resize. Opening reads only the header, so a prompt's image tokens are known (and can be refused) before
any pixels are decoded. Rescaling, normalizing and cutting into patches happen in the engine, on its device
(patchify.py); together they equal transformers' `Qwen2VLImageProcessorPil` bit for bit (same PIL bicubic
resize on uint8, same float32 arithmetic), except where a large JPEG is decoded at a reduced scale (`resize`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from fovea.config.image import ImageProcessorConfig, crop_resize
from fovea.multimodal.fetch import ImageTooLarge, fetch_url, file_url_path

MAX_IMAGE_PIXELS = int(os.environ.get("FOVEA_MAX_IMAGE_PIXELS", 8192 * 8192))  # decoded RGB: 200 MB at most
# Decoding costs by the source's pixels, whatever size the image is resized to: a request's images together may
# have at most this many (four of the largest images, or some thirty 12-megapixel photos).
MAX_REQUEST_PIXELS = int(os.environ.get("FOVEA_MAX_REQUEST_PIXELS", 4 * 8192 * 8192))
# The formats an image may come in (what browsers and vLLM's users send; Pillow's JPEG opener also reads a phone
# camera's MPO). Pillow knows many more, some of which hand the bytes to other programs (EPS to Ghostscript) or to
# little-used parsers.
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")


@dataclass
class PlannedImage:
    """An opened image (header read, pixels not decoded yet) and the size it will be resized to. `data`: the
    encoded bytes it was opened from (None for a PIL image), which a decoding worker process can take."""

    image: Image.Image
    config: ImageProcessorConfig
    height: int
    width: int
    data: bytes | None = None
    tiles: tuple[int, int, int] = (1, 1, 1)  # InternVL's (columns, rows, inputs): ImageProcessorConfig.tiles
    box: tuple[int, int, int, int] | None = None  # a pan-and-scan crop of the image, (left, top, right, bottom)

    @property
    def num_tokens(self) -> int:
        return self.tiles[2] * self.height * self.width // (self.config.patch_size * self.config.merge_size) ** 2


@dataclass
class ProcessedImage:
    """A resized image (or video) as it crosses to the engine: uint8 (height, width, 3) pixels (a video's:
    (frames, height, width, 3)), which the engine turns into patches on its device (multimodal/patchify.py), and
    its grid in patches. `content_hash` names the encoder's exact input (the pixels and the grid; a video's time
    step too), for the prefix and encoder caches."""

    pixels: np.ndarray
    grid_thw: tuple[int, int, int]
    content_hash: str
    merge_size: int = 2
    second_per_grid_t: float | None = None  # a video (pixels (frames, height, width, 3)): seconds per 2 frames
    timestamps: tuple[float, ...] | None = None  # Qwen3-VL's videos: each temporal patch's time, written as text
    embeds: bool = False  # `pixels` holds the vision tower's output for it, given (multimodal/embeds.py)
    frames: tuple[int, int] | None = None  # a video frame as an image (InternVL): its frames of shared `pixels`

    @property
    def is_video(self) -> bool:
        return self.second_per_grid_t is not None

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size**2


def pixels_hash(pixels: np.ndarray, grid_thw: tuple[int, int, int]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(tuple(grid_thw)).encode())
    digest.update(np.ascontiguousarray(pixels).data)
    return digest.hexdigest()


def load_image(source) -> Image.Image:
    """A decoded PIL image from a PIL image, raw bytes, a path, or a `file://`, `http(s)://` or
    `data:image/...;base64,` URL."""
    return decode_pixels(open_image(source))


def open_image(source) -> Image.Image:
    """Like load_image, but only the header is read (and its size checked); decode_pixels decodes."""
    if isinstance(source, Image.Image):
        return source
    data, what = encoded_bytes(source)
    return _open(io.BytesIO(data), what)


def encoded_bytes(source, kind: str = "image") -> tuple[bytes, str]:
    """The encoded bytes (an image's, or a video file's) any non-PIL source names, and how to name the source in
    errors."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source), f"{kind} bytes"
    if isinstance(source, os.PathLike) or (
        isinstance(source, str) and "://" not in source and not source.startswith("data:")
    ):
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"{kind} file not found: {path}")
        return path.read_bytes(), str(path)
    if isinstance(source, str) and source.startswith("data:"):
        header, sep, payload = source.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ValueError(f"data URL must look like data:{kind}/<type>;base64,<data>")
        try:
            return base64.b64decode(payload, validate=True), "data URL"
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"data URL holds invalid base64: {exc}") from None
    if isinstance(source, str) and source.startswith("file://"):
        return encoded_bytes(file_url_path(source), kind)
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        return fetch_url(source, kind=kind), source
    raise ValueError(f"cannot load {'an' if kind == 'image' else 'a'} {kind} from {type(source).__name__}")


def _open(fp, what: str) -> Image.Image:
    try:
        image = Image.open(fp, formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as exc:
        raise ImageTooLarge(f"{what}: image too large to decode safely ({exc})") from None
    except UnidentifiedImageError:  # its message would name the file object (`<_io.BytesIO object at 0x...>`)
        raise ValueError(f"{what} is not a readable image in a supported format ({', '.join(IMAGE_FORMATS)})") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ValueError(f"{what} is not a readable image ({exc})") from None
    if image.width * image.height > MAX_IMAGE_PIXELS:  # known from the header, before any decoding
        raise ImageTooLarge(
            f"{what}: {image.width}x{image.height} is over the {MAX_IMAGE_PIXELS} pixels an image may have"
        )
    image.fovea_source = what  # named in decode errors
    return image


def decode_pixels(image: Image.Image) -> Image.Image:
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as exc:
        raise ValueError(f"{getattr(image, 'fovea_source', 'image')} is not a readable image ({exc})") from None
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB with any transparency composited onto white (what the reference processor does)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


class ImageProcessor:
    def __init__(self, config: ImageProcessorConfig | None = None):
        self.config = config or ImageProcessorConfig()

    def __call__(self, source, mm_processor_kwargs: dict | None = None) -> ProcessedImage:
        return self.process(self.plan(source, mm_processor_kwargs))

    def plan(self, source, mm_processor_kwargs: dict | None = None) -> PlannedImage:
        """Opens the image (header only) and works out its resized size; `mm_processor_kwargs` are capped at
        this processor's max_pixels."""
        cfg = self.config.with_overrides(mm_processor_kwargs, capped=True)
        data, what = (None, "image") if isinstance(source, Image.Image) else encoded_bytes(source)
        image = source if data is None else _open(io.BytesIO(data), what)
        height, width = cfg.input_size(image.height, image.width)
        return PlannedImage(image, cfg, height, width, data, cfg.tiles(image.height, image.width))

    def crops(self, planned: PlannedImage) -> list[PlannedImage]:
        """Gemma 3's pan-and-scan crops of a planned image, each an image of its own (none unless it is on and
        the image wide or tall enough). Each crop and the image itself open their own copy of it: a JPEG decoded
        at a reduced scale for one would have other coordinates for the next."""
        boxes = planned.config.pan_crops(planned.image.height, planned.image.width)
        if not boxes:
            return []
        if planned.data is None:
            decode_pixels(planned.image)  # a PIL image given: decoded in full once, never at a reduced scale
            return [dataclasses.replace(planned, box=box) for box in boxes]
        what = getattr(planned.image, "fovea_source", "image")
        return [dataclasses.replace(planned, image=_open(io.BytesIO(planned.data), what), box=box) for box in boxes]

    def process(self, planned: PlannedImage) -> ProcessedImage:
        if planned.box is not None:
            cropped = to_rgb(decode_pixels(planned.image)).crop(planned.box)
            planned = dataclasses.replace(planned, image=cropped, box=None)
        cfg = planned.config
        if cfg.crop_size and cfg.shortest_edge:
            height, width = crop_resize(planned.image.height, planned.image.width, cfg.shortest_edge)
            top, left = (height - cfg.crop_size) // 2, (width - cfg.crop_size) // 2
            pixels = resize(planned.image, width, height)[top : top + cfg.crop_size, left : left + cfg.crop_size]
            pixels = np.ascontiguousarray(pixels)
        elif cfg.max_tiles:
            pixels = cut_tiles(planned)
        else:
            pixels = resize(planned.image, planned.width, planned.height, cfg.resample)
        grid = planned_grid(planned)
        return ProcessedImage(pixels, grid, pixels_hash(pixels, grid), planned.config.merge_size)


def planned_grid(planned: PlannedImage) -> tuple[int, int, int]:
    """(t, h, w) in patches; t counts a tiled image's inputs (its tiles and thumbnail)."""
    p = planned.config.patch_size
    return planned.tiles[2], planned.height // p, planned.width // p


def cut_tiles(planned: PlannedImage) -> np.ndarray:
    """InternVL's inputs: the image resized to columns x rows tiles, cut row by row, then (where there are
    several) the whole image resized to one tile; (inputs, tile, tile, 3) uint8."""
    columns, rows, inputs = planned.tiles
    side, resample = planned.config.crop_size, planned.config.resample
    whole = resize(planned.image, columns * side, rows * side, resample)  # decodes the image
    tiles = [whole[r * side : (r + 1) * side, c * side : (c + 1) * side] for r in range(rows) for c in range(columns)]
    if inputs > columns * rows:
        tiles.append(resize(planned.image, side, side, resample))
    return np.stack(tiles)


FILTERS = {"bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR}


def resize(image: Image.Image, width: int, height: int, resample: str = "bicubic") -> np.ndarray:
    """Decodes and resizes: (height, width, 3) uint8. A JPEG at least twice the target size on both sides is
    decoded at a reduced scale (Image.draft: 1/2, 1/4 or 1/8, still at least twice the target), which skips most
    of the decoding work; smaller reductions decode in full, exactly as transformers does."""
    if image.format == "JPEG" and image.width >= 2 * width and image.height >= 2 * height:
        image.draft(None, (2 * width, 2 * height))
    image = to_rgb(decode_pixels(image))
    if (width, height) != image.size:
        image = image.resize((width, height), resample=FILTERS[resample])
    return np.array(image)  # writable (torch.from_numpy of a read-only array warns)
