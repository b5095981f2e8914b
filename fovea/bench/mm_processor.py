"""`fovea bench mm-processor`: image preprocessing, fovea vs transformers' Qwen2VLImageProcessorPil, ms per image,
side by side in one run, for the listed sizes. Both start from the same JPEG bytes (decode included) and must
produce the same (num_patches, 1176) float32 patches; the PIL decode + bicubic resize both need is shown as the
floor neither can go under.
"""

from __future__ import annotations

import io
import statistics
import time

import numpy as np
from PIL import Image


def jpeg(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (height // 16, width // 16, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((width, height), Image.BILINEAR)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def time_ms(fn, iters: int) -> tuple[float, float]:
    fn()  # warm-up
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples), min(samples)


def compare(sizes: list[tuple[int, int]], iters: int, min_pixels: int = 3136, max_pixels: int = 12845056) -> list[dict]:
    """Defaults: the published checkpoints' preprocessor_config.json limits."""
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from fovea.config.image import ImageProcessorConfig, smart_resize
    from fovea.multimodal.image import ImageProcessor
    from fovea.multimodal.patchify import patchify

    limits = dict(min_pixels=min_pixels, max_pixels=max_pixels)
    ours = ImageProcessor(ImageProcessorConfig(**limits))
    hf = Qwen2VLImageProcessorPil(**limits)
    rows = []
    for width, height in sizes:
        data = jpeg(width, height)
        ref = hf(images=[Image.open(io.BytesIO(data))], return_tensors="np")["pixel_values"]

        def fovea_patches():  # the front end's part (decode, resize), then the engine's (patchify, here on the CPU)
            return patchify(torch.from_numpy(ours(data).pixels), ours.config, frames=2).numpy()

        mine = fovea_patches()
        if ref.shape != mine.shape or np.abs(ref - mine).max() > 1e-5:
            raise AssertionError(f"{width}x{height}: fovea's patches differ from transformers'")
        hf_ms = time_ms(lambda: hf(images=[Image.open(io.BytesIO(data))], return_tensors="np"), iters)
        our_ms = time_ms(fovea_patches, iters)
        target = smart_resize(height, width, 28, **limits)[::-1]
        floor_ms = time_ms(lambda: Image.open(io.BytesIO(data)).convert("RGB").resize(target, Image.BICUBIC), iters)
        rows.append(
            {
                "size": f"{width}x{height}",
                "patches": int(mine.shape[0]),
                "hf_median_ms": hf_ms[0],
                "hf_min_ms": hf_ms[1],
                "fovea_median_ms": our_ms[0],
                "fovea_min_ms": our_ms[1],
                "speedup": hf_ms[0] / our_ms[0],
                "pil_floor_ms": floor_ms[0],
            }
        )
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [
        f"{'image':>10} {'patches':>8} {'hf ms (median/min)':>20} {'fovea ms (median/min)':>22} "
        f"{'speed-up':>9} {'PIL decode+resize ms':>21}"
    ]
    for r in rows:
        lines.append(
            f"{r['size']:>10} {r['patches']:>8} {r['hf_median_ms']:>11.1f} / {r['hf_min_ms']:<7.1f} "
            f"{r['fovea_median_ms']:>12.1f} / {r['fovea_min_ms']:<8.1f} {r['speedup']:>8.2f}x "
            f"{r['pil_floor_ms']:>21.1f}"
        )
    return "\n".join(lines)
