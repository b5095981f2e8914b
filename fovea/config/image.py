"""How a model's images are sized for its vision tower, read once from preprocessor_config.json: Qwen2-VL's
dynamic resolution (both sides multiples of patch x merge, the area between min_pixels and max_pixels), CLIP's
resize-and-crop (LLaVA), one fixed size whatever the aspect ratio (Gemma 3's SigLIP) or tiles of that size
(InternVL: the image resized to a grid of tiles close to its aspect ratio, and a thumbnail). The pixels themselves
are processed in multimodal/image.py; this is what the config, the models and `fovea plan` need to know about them."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
MAX_TILES = 64  # InternVL's tiles an image at most (the released checkpoints use 12)
# mm_processor_kwargs for videos (config/video.py; the edges, the cap and the token count are Qwen3-VL's)
VIDEO_ONLY_KWARGS = {
    "fps",
    "min_frames",
    "max_frames",
    "total_pixels",
    "shortest_edge",
    "longest_edge",
    "cap_pixels_per_frame",
    "max_video_tokens",
}
# mm_processor_kwargs for Gemma 3's pan-and-scan (transformers' and vLLM's names) -> ImageProcessorConfig fields
PAN_KWARGS = {
    "do_pan_and_scan": "pan_and_scan",
    "pan_and_scan_min_crop_size": "pan_min_crop",
    "pan_and_scan_max_num_crops": "pan_max_crops",
    "pan_and_scan_min_ratio_to_activate": "pan_min_ratio",
}
# mm_processor_kwargs for a tiled model's tile counts: transformers' names and vLLM's (its InternVL processor's)
TILE_KWARGS = {
    "min_patches": "min_tiles",
    "max_patches": "max_tiles",
    "min_dynamic_patch": "min_tiles",
    "max_dynamic_patch": "max_tiles",
}


def check_size(height: int, width: int) -> None:
    """Refuses an image with no pixels, or too thin to resize (a 1 x 10^5 image would resize to 10 GB)."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image has no pixels ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image aspect ratio {max(height, width) / min(height, width):.1f} is over the "
            f"supported {MAX_ASPECT_RATIO} ({width}x{height})"
        )


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
    frames: int = 1,
) -> tuple[int, int]:
    """Closest size with both sides multiples of `factor` and an area within [min_pixels, max_pixels]. With
    `frames` (Qwen3-VL's videos) the bounds hold for all frames together, counted in whole temporal patches."""
    check_size(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    kept = 1 if frames == 1 else round(frames / 2) * 2  # the published rule: round half to even, then beta by frames
    if kept * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif kept * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def crop_resize(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """CLIPImageProcessor's resize: the shortest side to `shortest_edge`, the other in proportion (truncated)."""
    check_size(height, width)
    if width <= height:
        return int(shortest_edge * height / width), shortest_edge
    return shortest_edge, int(shortest_edge * width / height)


def tile_grid(height: int, width: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) of InternVL's tiling (GotOcr2ImageProcessor's crop_to_patches): of the grids with
    min_tiles..max_tiles tiles, taken in order of their tile count, the one whose aspect ratio is closest to the
    image's; on a tie the later one, while the image has more than half the pixels of its tiles."""
    check_size(height, width)
    grids = [
        (c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1) if min_tiles <= c * r <= max_tiles
    ]
    best, best_gap = (1, 1), float("inf")
    for columns, rows in sorted(grids, key=lambda grid: grid[0] * grid[1]):  # stable: columns, then rows
        gap = abs(width / height - columns / rows)
        if gap < best_gap or (gap == best_gap and width * height > 0.5 * tile * tile * columns * rows):
            best, best_gap = (columns, rows), min(gap, best_gap)
    return best


@dataclass(frozen=True)
class ImageProcessorConfig:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD

    # CLIP-style preprocessing (LLaVA): the shortest side resized to `shortest_edge`, then a centre crop of
    # crop_size x crop_size; shortest_edge 0: resized to crop_size x crop_size straight (Gemma 3); crop_size 0:
    # Qwen's dynamic resolution (smart_resize between min_pixels and max_pixels)
    crop_size: int = 0
    shortest_edge: int = 0
    resample: str = "bicubic"  # PIL's filter: "bicubic" (Qwen, CLIP) or "bilinear" (Gemma 3)
    # InternVL: each image cut into crop_size tiles, min_tiles to max_tiles of them (tile_grid), plus a thumbnail
    # of the whole image where there are several; max_tiles 0: one image, one input
    max_tiles: int = 0
    min_tiles: int = 1
    thumbnail: bool = True  # the whole image as a last tile where there are several
    # Gemma 3's pan-and-scan: a wide (tall) image also goes as 2..pan_max_crops crops side by side (one above the
    # other), each at least pan_min_crop pixels wide (high), once its aspect ratio reaches pan_min_ratio; None:
    # the processor has none; False: off (transformers' default)
    pan_and_scan: bool | None = None
    pan_min_crop: int = 256
    pan_max_crops: int = 4
    pan_min_ratio: float = 1.2

    @classmethod
    def dynamic(cls, raw: dict) -> ImageProcessorConfig:
        """Qwen2-VL's processor (Qwen2VLImageProcessor) from its preprocessor_config.json."""
        size = raw.get("size") or {}
        return cls(
            min_pixels=raw.get("min_pixels", size.get("shortest_edge", cls.min_pixels)),
            max_pixels=raw.get("max_pixels", size.get("longest_edge", cls.max_pixels)),
            patch_size=raw.get("patch_size", 14),
            temporal_patch_size=raw.get("temporal_patch_size", 2),
            merge_size=raw.get("merge_size", 2),
            image_mean=tuple(raw.get("image_mean", CLIP_MEAN)),
            image_std=tuple(raw.get("image_std", CLIP_STD)),
        )

    @classmethod
    def center_crop(cls, raw: dict, patch_size: int, image_size: int) -> ImageProcessorConfig:
        """CLIPImageProcessor's settings (resize the shortest side, centre crop) for a tower that takes
        image_size x image_size pixels; one token per patch."""
        crop = raw.get("crop_size", image_size)
        crop = crop.get("height", image_size) if isinstance(crop, dict) else crop
        size = raw.get("size", image_size)
        shortest = size.get("shortest_edge", image_size) if isinstance(size, dict) else size
        if crop != image_size or raw.get("do_center_crop") is False:
            raise ValueError(
                f"the vision tower takes {image_size}x{image_size} images but preprocessor_config.json "
                f"crops to {crop} (do_center_crop {raw.get('do_center_crop')})"
            )
        return cls(
            min_pixels=crop * crop,
            max_pixels=crop * crop,
            patch_size=patch_size,
            temporal_patch_size=1,
            merge_size=1,
            image_mean=tuple(raw.get("image_mean", CLIP_MEAN)),
            image_std=tuple(raw.get("image_std", CLIP_STD)),
            crop_size=crop,
            shortest_edge=shortest,
        )

    @classmethod
    def fixed_size(cls, raw: dict, patch_size: int, image_size: int, merge_size: int) -> ImageProcessorConfig:
        """Gemma3ImageProcessor's settings: every image resized to image_size x image_size (bilinear), its
        mean and std 0.5 unless given, a token for each merge_size x merge_size patches; pan-and-scan off unless
        the file turns it on (its other settings Gemma3Processor's defaults where the file leaves them null)."""
        size = raw.get("size") or {}
        if (size.get("height", image_size), size.get("width", image_size)) != (image_size, image_size):
            raise ValueError(f"the vision tower takes {image_size}x{image_size} images, the processor makes {size}")
        if raw.get("resample", 2) != 2:
            raise ValueError(f"only bilinear resampling (2) is supported here, got {raw.get('resample')}")
        return cls(
            min_pixels=image_size * image_size,
            max_pixels=image_size * image_size,
            patch_size=patch_size,
            temporal_patch_size=1,
            merge_size=merge_size,
            image_mean=tuple(raw.get("image_mean", (0.5, 0.5, 0.5))),
            image_std=tuple(raw.get("image_std", (0.5, 0.5, 0.5))),
            crop_size=image_size,
            resample="bilinear",
            pan_and_scan=bool(raw.get("do_pan_and_scan")),
            **{
                field: raw[key] if raw.get(key) is not None else getattr(cls, field)
                for key, field in PAN_KWARGS.items()
                if key != "do_pan_and_scan"
            },
        )

    @classmethod
    def tiled(cls, raw: dict, patch_size: int, image_size: int, merge_size: int) -> ImageProcessorConfig:
        """GotOcr2ImageProcessor's settings as InternVLProcessor runs it (crop_to_patches on, whatever the
        image processor's own setting): bicubic tiles of image_size, min_patches..max_patches of them and a
        thumbnail; CLIP's mean and std unless given (the released files give ImageNet's). max_pixels: what the
        largest image's tiles hold."""
        size = raw.get("size") or {}
        if (size.get("height", image_size), size.get("width", image_size)) != (image_size, image_size):
            raise ValueError(f"the vision tower takes {image_size}x{image_size} tiles, the processor makes {size}")
        if raw.get("resample", 3) != 3:
            raise ValueError(f"only bicubic resampling (3) is supported here, got {raw.get('resample')}")
        low, high = raw.get("min_patches", 1), raw.get("max_patches", 12)
        if not 1 <= low <= high <= MAX_TILES:
            raise ValueError(f"min_patches {low} and max_patches {high} must satisfy 1 <= min <= max <= {MAX_TILES}")
        largest = high + (high > 1)  # the thumbnail
        return cls(
            min_pixels=image_size * image_size,
            max_pixels=image_size * image_size * largest,
            patch_size=patch_size,
            temporal_patch_size=1,
            merge_size=merge_size,
            image_mean=tuple(raw.get("image_mean", CLIP_MEAN)),
            image_std=tuple(raw.get("image_std", CLIP_STD)),
            crop_size=image_size,
            max_tiles=high if high > 1 else 0,
            min_tiles=low,
        )

    def tiles(self, height: int, width: int) -> tuple[int, int, int]:
        """(columns, rows, inputs) of an image of this size: its tiles' grid and how many crop_size inputs the
        tower takes for it (the grid's tiles and, where there are several, the thumbnail); (1, 1, 1) untiled."""
        if not self.max_tiles:
            return 1, 1, 1
        columns, rows = tile_grid(height, width, self.crop_size, self.min_tiles, self.max_tiles)
        return columns, rows, columns * rows + (self.thumbnail and columns * rows > 1)

    def tokens(self, height: int, width: int) -> int:
        """Image tokens of a source image of this size."""
        h, w = self.input_size(height, width)
        return self.tiles(height, width)[2] * h * w // (self.patch_size * self.merge_size) ** 2

    def pan_crops(self, height: int, width: int) -> list[tuple[int, int, int, int]]:
        """Gemma 3's pan-and-scan crops of an image of this size, as (left, top, right, bottom) boxes in its
        pixels (the last one cut at the image's edge); none unless it is on and the image wide or tall enough."""
        if not self.pan_and_scan:
            return []
        long_side, short_side = max(width, height), min(width, height)
        if long_side / short_side < self.pan_min_ratio:
            return []
        count = min(int(long_side / short_side + 0.5), long_side // self.pan_min_crop)  # half rounds up
        count = min(max(2, count), self.pan_max_crops)
        step = -(-long_side // count)
        if min(step, short_side) < self.pan_min_crop:
            return []
        if width >= height:
            return [(i * step, 0, min((i + 1) * step, width), height) for i in range(count)]
        return [(0, i * step, width, min((i + 1) * step, height)) for i in range(count)]

    @property
    def tokens_per_image(self) -> int:
        """Tokens of one image where every image has one size (crop_size): its patches over merge x merge."""
        return self.encoder_unit // self.merge_size**2

    @property
    def encoder_unit(self) -> int:
        """Patches a vision tower's input grows by: one merge group, or one whole image (tile) when all have one
        size."""
        return (self.crop_size // self.patch_size) ** 2 if self.crop_size else self.merge_size**2

    def input_size(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) an image of this size reaches the vision tower at (each of its tiles)."""
        if self.crop_size:
            crop_resize(height, width, self.shortest_edge or self.crop_size)  # refuses what it cannot resize
            return self.crop_size, self.crop_size
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def with_overrides(self, overrides: dict | None, capped: bool = False) -> ImageProcessorConfig:
        """`mm_processor_kwargs` such as {"min_pixels": ..., "max_pixels": ...}, or a tiled model's
        {"max_patches": ...}. `capped` (per request): neither may go above this config's max_pixels (max_tiles),
        which the engine sized its memory and encoder cache for."""
        if not overrides:
            return self
        unknown = set(overrides) - {"min_pixels", "max_pixels"} - VIDEO_ONLY_KWARGS - set(TILE_KWARGS) - set(PAN_KWARGS)
        if unknown:
            raise ValueError(
                f"unsupported mm_processor_kwargs {sorted(unknown)}; supported: min_pixels, max_pixels, "
                f"for tiled images {', '.join(TILE_KWARGS)}, for pan-and-scan {', '.join(PAN_KWARGS)}, and for "
                f"videos {', '.join(sorted(VIDEO_ONLY_KWARGS))}"
            )
        pan = {PAN_KWARGS[key]: value for key, value in overrides.items() if key in PAN_KWARGS}
        if pan:
            return self._with_pan_and_scan(pan, capped).with_overrides(
                {key: value for key, value in overrides.items() if key not in PAN_KWARGS}, capped
            )
        for key, value in overrides.items():
            if key not in VIDEO_ONLY_KWARGS and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"mm_processor_kwargs[{key!r}] must be a positive integer, got {value!r}")
        tiles = {TILE_KWARGS[key]: value for key, value in overrides.items() if key in TILE_KWARGS}
        overrides = {key: value for key, value in overrides.items() if key in ("min_pixels", "max_pixels")}
        if tiles and not self.max_tiles:
            raise ValueError(f"mm_processor_kwargs {sorted(tiles)} apply to models whose images are cut into tiles")
        if overrides and self.crop_size:
            raise ValueError(
                f"mm_processor_kwargs {sorted(overrides)} do not apply to this model: its images are "
                f"resized and cropped to {self.crop_size}x{self.crop_size}{' tiles' if self.max_tiles else ''}"
            )
        if tiles:
            low, high = tiles.get("min_tiles", self.min_tiles), tiles.get("max_tiles", self.max_tiles)
            high = min(high, self.max_tiles) if capped else high
            if (
                high > MAX_TILES
            ):  # each tile is an image's worth of work, and the grids to choose from grow as its square
                raise ValueError(f"mm_processor_kwargs: at most {MAX_TILES} tiles an image, got {high}")
            largest = high + (self.thumbnail and high > 1)  # min > max: one tile, as in the reference
            return replace(self, min_tiles=low, max_tiles=high, max_pixels=self.crop_size**2 * largest)
        if capped:
            overrides = {key: min(value, self.max_pixels) for key, value in overrides.items()}
        return replace(self, **overrides)  # min > max is allowed: max_pixels wins, as in the reference

    def _with_pan_and_scan(self, pan: dict, capped: bool) -> ImageProcessorConfig:
        if self.pan_and_scan is None:
            raise ValueError(f"mm_processor_kwargs {sorted(pan)} apply to models with pan-and-scan (Gemma 3)")
        if not isinstance(pan.get("pan_and_scan", False), bool):
            raise ValueError(
                f"mm_processor_kwargs['do_pan_and_scan'] must be true or false, got {pan['pan_and_scan']!r}"
            )
        for field in ("pan_min_crop", "pan_max_crops"):
            value = pan.get(field, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"mm_processor_kwargs for pan-and-scan: {field} must be a positive integer, got {value!r}"
                )
        ratio = pan.get("pan_min_ratio", 1.0)
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio < 1e6:
            raise ValueError(
                f"mm_processor_kwargs['pan_and_scan_min_ratio_to_activate'] must be positive, got {ratio!r}"
            )
        if capped:  # a request's crops are images too: no more than the server's setting
            pan["pan_max_crops"] = min(pan.get("pan_max_crops", self.pan_max_crops), self.pan_max_crops)
        return replace(self, **pan)


def largest_side(max_pixels: int, factor: int) -> int:
    """The side of the largest square image max_pixels allows (what the limits let one image cost)."""
    return int(max_pixels**0.5) // factor * factor
