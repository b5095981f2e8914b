"""Checks that need the GPU machine's packages or its device, written as one JSON and a short table.

    python benchmarks/gpu_media_checks.py --out DIR [--quick]

video:       our video patches against transformers' own Qwen2VLVideoProcessor (it needs torchvision, which only
             the GPU machine has), given the same already-sampled frames: once from the source frames (the two
             resizers: our PIL bicubic on uint8, its torchvision bicubic on tensors) and once from our resized frames
             with its resizing off (must agree to float rounding: the patch layout and normalisation).
qwen3-video: the same for Qwen3-VL's Qwen3VLVideoProcessor (frames sampled by the source rate, the released size).
llava-tower: the LLaVA-1.5-7B CLIP tower (ViT-L/14-336, 23 layers) with random bf16 weights on CUDA: our Triton
             varlen attention against PyTorch's SDPA path and an fp32 copy, 4 images, plus the time of each.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def smooth_clip(frames: int, height: int, width: int, seed: int) -> np.ndarray:
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(frames):
        small = rng.integers(0, 256, (height // 16, width // 16, 3), dtype=np.uint8)
        out.append(np.asarray(Image.fromarray(small).resize((width, height), Image.BILINEAR)))
    return np.stack(out)


def check_video(quick: bool) -> dict:
    from transformers import Qwen2VLVideoProcessor

    from fovea.config.image import ImageProcessorConfig
    from fovea.config.video import VideoOptions, frame_max_pixels
    from fovea.multimodal.patchify import patchify
    from fovea.multimodal.video import plan_video, process_video

    options, config = VideoOptions(), ImageProcessorConfig()
    results = {}
    for frames, height, width in [(4, 90, 160)] if quick else [(8, 360, 640), (16, 720, 1280), (5, 480, 270)]:
        clip = smooth_clip(frames, height, width, seed=frames)
        planned = plan_video(clip, options)  # frames given without a rate are taken as already sampled
        ours = process_video(planned)
        our_patches = patchify(torch.from_numpy(ours.pixels), config)
        size = {"shortest_edge": options.min_pixels, "longest_edge": int(frame_max_pixels(options, frames))}
        processor = Qwen2VLVideoProcessor(size=size, do_sample_frames=False)
        theirs = processor(videos=[torch.from_numpy(clip).permute(0, 3, 1, 2)], return_tensors="pt")
        same_input = processor(
            videos=[torch.from_numpy(ours.pixels).permute(0, 3, 1, 2)], do_resize=False, return_tensors="pt"
        )
        grid = tuple(theirs["video_grid_thw"][0].tolist())
        row = {"grid_ours": list(ours.grid_thw), "grid_transformers": list(grid)}
        if grid == tuple(ours.grid_thw):
            diff = (our_patches - theirs["pixel_values_videos"]).abs()
            row.update(
                resized_max_abs=float(diff.max()),
                resized_mean_abs=float(diff.mean()),
                resized_fraction_differing=float((diff > 1e-6).float().mean()),
            )
        layout = (our_patches - same_input["pixel_values_videos"]).abs()
        row["same_frames_max_abs"] = float(layout.max())
        results[f"{frames}x{height}x{width}"] = row
    return results


def check_qwen3_video(quick: bool) -> dict:
    """Qwen3-VL's rule: frames sampled by the source rate, one area bound for all frames; the same comparison."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from fovea.config.image import ImageProcessorConfig
    from fovea.config.video import TimestampedVideoOptions
    from fovea.multimodal.patchify import patchify
    from fovea.multimodal.video import plan_video, process_video
    from fovea.testing.tiny_qwen3_vl import VIDEO_PREPROCESSOR, preprocessor_config

    settings = {k: v for k, v in VIDEO_PREPROCESSOR.items() if k not in ("video_processor_type", "processor_class")}
    processor = Qwen3VLVideoProcessor(**settings)
    options = TimestampedVideoOptions.from_preprocessor(VIDEO_PREPROCESSOR)
    config = ImageProcessorConfig.dynamic(preprocessor_config())
    results = {}
    for total, fps, height, width in [(9, 4.0, 90, 160)] if quick else [(30, 10.0, 360, 640), (75, 25.0, 720, 1280)]:
        clip = smooth_clip(total, height, width, seed=total)
        ours = process_video(plan_video((clip, {"fps": fps}), options, patch_size=16))
        our_patches = patchify(torch.from_numpy(ours.pixels), config)
        metadata = [VideoMetadata(total_num_frames=total, fps=fps)]
        theirs = processor(
            videos=[torch.from_numpy(clip).permute(0, 3, 1, 2)],
            video_metadata=metadata,
            cap_pixels_per_frame=False,
            return_tensors="pt",
        )
        grid = tuple(theirs["video_grid_thw"][0].tolist())
        row = {"grid_ours": list(ours.grid_thw), "grid_transformers": list(grid)}
        if grid == tuple(ours.grid_thw):
            diff = (our_patches - theirs["pixel_values_videos"]).abs()
            row.update(resized_max_abs=float(diff.max()), resized_mean_abs=float(diff.mean()))
        results[f"{total}x{height}x{width}@{fps:g}"] = row
    return results


def check_llava_tower(quick: bool) -> dict:
    from fovea.config.families import parse_llava
    from fovea.models.base import ModelOptions
    from fovea.models.llava import ClipVisionTower
    from fovea.testing.tiny_llava import llava_config

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = parse_llava(llava_config("tiny-llava" if quick else "llava-1.5-7b"), {})
    torch.manual_seed(0)
    reference = ClipVisionTower(config.vision, ModelOptions()).float()
    for p in reference.parameters():
        p.data.normal_(0, 0.02)
    towers = {"fp32-sdpa": reference.to(device)}
    for name, kernel in (("bf16-sdpa", False), ("bf16-triton", True)):
        tower = ClipVisionTower(config.vision, ModelOptions(vision_kernel=kernel)).to(device)
        tower.load_state_dict(reference.state_dict())
        towers[name] = tower.to(torch.bfloat16)
    images, side = 4, config.vision.image_size // config.vision.patch_size
    pixels = torch.randn(images * side * side, config.vision.frame_patch_dim, device=device)
    grids = [(1, side, side)] * images
    outputs, times = {}, {}
    with torch.inference_mode():
        for name, tower in towers.items():
            x = pixels if name.startswith("fp32") else pixels.to(torch.bfloat16)
            outputs[name] = tower(x, grids).float()
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(2 if quick else 10):
                tower(x, grids)
            if device == "cuda":
                torch.cuda.synchronize()
            times[name] = (time.perf_counter() - start) / (2 if quick else 10) * 1e3
    ref = outputs["fp32-sdpa"]
    rel = {name: float((out - ref).norm() / ref.norm()) for name, out in outputs.items() if name != "fp32-sdpa"}
    return {
        "images": images,
        "tokens_per_image": side * side,
        "rel_error_vs_fp32": rel,
        "ms_per_call": times,
        "finite": all(bool(torch.isfinite(o).all()) for o in outputs.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--checks", default="video,qwen3-video,llava-tower")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for check in args.checks.split(","):
        try:
            checks = {"video": check_video, "qwen3-video": check_qwen3_video, "llava-tower": check_llava_tower}
            results[check] = checks[check](args.quick)
        except Exception as exc:  # noqa: BLE001 - one failed check still leaves the other's figures
            results[check] = {"error": f"{type(exc).__name__}: {exc}"}
    (out / "media_checks.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
