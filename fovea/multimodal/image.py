"""Qwen2-VL image preprocessing with Pillow and numpy: load -> RGB -> smart_resize -> normalize -> patches.

The output equals transformers' `Qwen2VLImageProcessorPil` bit for bit (same PIL bicubic resize on uint8, same
float32 arithmetic) but takes less than half its time: the pixels are put in patch order while still uint8,
converted once, normalized in place, and written once into the output with the temporal copy.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
MAX_FETCH_BYTES = 64 << 20
MAX_IMAGE_PIXELS = int(os.environ.get("FOVEA_MAX_IMAGE_PIXELS", 8192 * 8192))  # decoded RGB: 200 MB at most


class ImageTooLarge(ValueError):
    """An image over the size limits (bytes or pixels); the server answers 413."""


@dataclass(frozen=True)
class ImageProcessorConfig:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ImageProcessorConfig":
        path = Path(model_dir) / "preprocessor_config.json"
        raw = json.loads(path.read_text()) if path.is_file() else {}
        size = raw.get("size") or {}
        return cls(
            min_pixels=raw.get("min_pixels", size.get("shortest_edge", cls.min_pixels)),
            max_pixels=raw.get("max_pixels", size.get("longest_edge", cls.max_pixels)),
            patch_size=raw.get("patch_size", 14), temporal_patch_size=raw.get("temporal_patch_size", 2),
            merge_size=raw.get("merge_size", 2),
            image_mean=tuple(raw.get("image_mean", CLIP_MEAN)), image_std=tuple(raw.get("image_std", CLIP_STD)))

    def with_overrides(self, overrides: dict | None) -> "ImageProcessorConfig":
        """Per-call `mm_processor_kwargs` such as {"min_pixels": ..., "max_pixels": ...}."""
        if not overrides:
            return self
        unknown = set(overrides) - {"min_pixels", "max_pixels"}
        if unknown:
            raise ValueError(f"unsupported mm_processor_kwargs {sorted(unknown)}; supported: min_pixels, max_pixels")
        for key, value in overrides.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"mm_processor_kwargs[{key!r}] must be a positive integer, got {value!r}")
        return replace(self, **overrides)  # min > max is allowed: max_pixels wins, as in the reference


@dataclass
class ProcessedImage:
    pixel_values: np.ndarray  # (t*h*w, channels*temporal*patch*patch) float32, merge groups contiguous
    grid_thw: tuple[int, int, int]  # in patches
    merge_size: int = 2

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size ** 2


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """Closest size with both sides multiples of `factor` and an area within [min_pixels, max_pixels]."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image has no pixels ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image aspect ratio {max(height, width) / min(height, width):.1f} is over the "
                         f"supported {MAX_ASPECT_RATIO} ({width}x{height})")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def load_image(source) -> Image.Image:
    """A PIL image from a PIL image, raw bytes, a path, or a `file://`, `http(s)://` or
    `data:image/...;base64,` URL."""
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(io.BytesIO(bytes(source)), "image bytes")
    if isinstance(source, os.PathLike) or (isinstance(source, str) and "://" not in source
                                            and not source.startswith("data:")):
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"image file not found: {path}")
        return _decode(path, str(path))
    if isinstance(source, str) and source.startswith("data:"):
        header, sep, payload = source.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ValueError("data URL must look like data:image/<type>;base64,<data>")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"data URL holds invalid base64: {exc}") from None
        return _decode(io.BytesIO(raw), "data URL")
    if isinstance(source, str) and source.startswith("file://"):
        return load_image(file_url_path(source))
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        return _decode(io.BytesIO(fetch_url(source)), source)
    raise ValueError(f"cannot load an image from {type(source).__name__}")


def file_url_path(url: str) -> Path:
    """The path a file:// URL names, percent-decoded as Path.as_uri() encodes it (%20 for a space). The server's
    media policy checks this same path, so an encoded `..` cannot slip past it."""
    from urllib.parse import unquote, urlparse

    return Path(unquote(urlparse(url).path))


def fetch_url(url: str, check_url=None, check_address=None, max_redirects: int = 3) -> bytes:
    """Downloads an image, bounded in time (FOVEA_IMAGE_FETCH_TIMEOUT seconds, vLLM's default of 5) and size.
    `check_url(url)` vets every URL including redirects; `check_address(ip)` vets the address actually
    connected to, so a host that resolves differently the second time (DNS rebinding) is still caught."""
    import http.client
    from urllib.parse import urljoin, urlparse

    timeout = float(os.environ.get("FOVEA_IMAGE_FETCH_TIMEOUT", "5"))
    for _ in range(max_redirects + 1):
        if check_url is not None:
            check_url(url)
        parsed = urlparse(url)
        kind = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
        try:
            connection = kind(parsed.hostname, parsed.port, timeout=timeout)
        except (ValueError, http.client.HTTPException) as exc:
            raise ValueError(f"cannot fetch image from {url!r}: {exc}") from None
        try:
            if check_address is not None:
                connection._create_connection = _guarded_connect(check_address)
            connection.request("GET", (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else ""),
                               headers={"User-Agent": "fovea", "Accept": "image/*"})
            response = connection.getresponse()
            location = response.getheader("Location")
            if response.status in (301, 302, 303, 307, 308) and location:
                url = urljoin(url, location)
                continue
            if response.status != 200:
                raise ValueError(f"could not fetch image {url}: HTTP {response.status}")
            data = response.read(MAX_FETCH_BYTES + 1)
        except (OSError, http.client.HTTPException) as exc:
            raise ValueError(f"could not fetch image {url}: {exc}") from None
        finally:
            connection.close()
        if len(data) > MAX_FETCH_BYTES:
            raise ImageTooLarge(f"image at {url} is larger than {MAX_FETCH_BYTES >> 20} MiB")
        return data
    raise ValueError(f"could not fetch image {url}: more than {max_redirects} redirects")


def _guarded_connect(check_address):
    import ipaddress
    import socket

    def connect(address, timeout, source_address=None):
        host, port = address
        last_error: OSError = OSError(f"cannot resolve {host}")
        for family, kind, proto, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            check_address(ipaddress.ip_address(sockaddr[0].split("%")[0]))
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(timeout)
                sock.connect(sockaddr)
                return sock
            except OSError as error:
                sock.close()
                last_error = error
        raise last_error

    return connect


def _decode(fp, what: str) -> Image.Image:
    try:
        image = Image.open(fp)
        if image.width * image.height > MAX_IMAGE_PIXELS:  # known from the header, before any decoding
            raise ImageTooLarge(f"{what}: {image.width}x{image.height} is over the {MAX_IMAGE_PIXELS} pixels "
                                "an image may have")
        image.load()
    except Image.DecompressionBombError as exc:
        raise ImageTooLarge(f"{what}: image too large to decode safely ({exc})") from None
    except ImageTooLarge:
        raise
    except (OSError, SyntaxError, ValueError) as exc:
        raise ValueError(f"{what} is not a readable image ({exc})") from None
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
        self._mean = np.asarray(self.config.image_mean, dtype=np.float32)[None, :, None, None]
        self._std = np.asarray(self.config.image_std, dtype=np.float32)[None, :, None, None]

    def __call__(self, source, mm_processor_kwargs: dict | None = None) -> ProcessedImage:
        cfg = self.config.with_overrides(mm_processor_kwargs)
        image = to_rgb(load_image(source))
        factor = cfg.patch_size * cfg.merge_size
        height, width = smart_resize(image.height, image.width, factor, cfg.min_pixels, cfg.max_pixels)
        if (width, height) != image.size:
            image = image.resize((width, height), resample=Image.BICUBIC)
        return self._patchify(np.asarray(image), cfg)

    def _patchify(self, pixels: np.ndarray, cfg: ImageProcessorConfig) -> ProcessedImage:
        p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
        height, width, channels = pixels.shape
        gh, gw = height // p, width // p
        # uint8 (H, W, C) viewed as (group_row, group_col, sub_row, sub_col, C, py, px): merge groups contiguous
        grouped = pixels.reshape(gh // m, m, p, gw // m, m, p, channels).transpose(0, 3, 1, 4, 6, 2, 5)
        x = grouped.reshape(gh * gw, channels, 1, p * p).astype(np.float32)
        # float32 v / 255 equals the reference's float32(v * (1/255) in float64) for every uint8 v (tested),
        # and the subtraction and division below are the reference's float32 operations in the same order.
        x /= np.float32(255)
        x -= self._mean
        x /= self._std
        out = np.empty((gh * gw, channels, tp, p * p), dtype=np.float32)
        out[:] = x  # a still image is its own second frame: both temporal slots hold the same values
        return ProcessedImage(out.reshape(gh * gw, -1), (1, gh, gw), m)
