"""Image preprocessing: fovea vs transformers' Qwen2VLImageProcessorPil, ms/image, side by side in one run.

Both start from the same JPEG bytes (decode included) and produce (num_patches, 1176) float32 patches.
Run:  python benchmarks/preprocess_bench.py [--sizes 1280x720,640x480] [--iters 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import numpy as np
import torch
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1280x720,640x480,3000x2000")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from fovea.multimodal.image import ImageProcessor, ImageProcessorConfig, smart_resize

    limits = dict(min_pixels=3136, max_pixels=12845056)  # the published checkpoints' preprocessor_config.json
    ours = ImageProcessor(ImageProcessorConfig(**limits))
    hf = Qwen2VLImageProcessorPil(**limits)
    print(f"{'image':>10} {'patches':>8} {'hf ms (median/min)':>20} {'fovea ms (median/min)':>22} {'speed-up':>9}"
          f" {'PIL decode+resize ms':>21}")
    for size in args.sizes.split(","):
        width, height = map(int, size.split("x"))
        data = jpeg(width, height)
        ref = hf(images=[Image.open(io.BytesIO(data))], return_tensors="np")["pixel_values"]
        mine = ours(data).pixel_values
        assert np.abs(ref - mine).max() <= 1e-5, "outputs differ"
        hf_ms = time_ms(lambda: hf(images=[Image.open(io.BytesIO(data))], return_tensors="np"), args.iters)
        our_ms = time_ms(lambda: ours(data), args.iters)
        # both implementations must decode and bicubic-resize with PIL to be exact: the shared floor
        target = smart_resize(height, width, 28, **limits)[::-1]
        floor_ms = time_ms(lambda: Image.open(io.BytesIO(data)).convert("RGB").resize(target, Image.BICUBIC),
                           args.iters)
        print(f"{size:>10} {mine.shape[0]:>8} {hf_ms[0]:>11.1f} / {hf_ms[1]:<7.1f} {our_ms[0]:>12.1f} / "
              f"{our_ms[1]:<8.1f} {hf_ms[0] / our_ms[0]:>8.2f}x {floor_ms[0]:>21.1f}")


if __name__ == "__main__":
    main()
