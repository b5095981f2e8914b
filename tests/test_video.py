"""Videos against Qwen's published algorithm (frame sampling, sizes, patches, M-RoPE time positions, written out
here independently) and against transformers' Qwen2.5-VL given the same pixel_values_videos, video_grid_thw and
second_per_grid_ts: logits and greedy tokens through the engine."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import hf_model, published_video_patches, random_image

from fovea import LLM, SamplingParams
from fovea.config.image import ImageProcessorConfig, smart_resize
from fovea.config.model import ModelConfig
from fovea.config.video import VideoOptions, frame_indices, frame_size
from fovea.multimodal.image import ImageProcessor
from fovea.multimodal.patchify import patchify
from fovea.multimodal.prompt import PromptProcessor
from fovea.multimodal.video import plan_video, process_video

VIDEO_ID, IMAGE_ID = 151656, 151655
SMALL = {"min_pixels": 28 * 28 * 4, "max_pixels": 56 * 56 * 4}  # tiny frames: a CPU test


def processed_video(source, kwargs: dict | None = None):
    return process_video(plan_video(source, VideoOptions().with_kwargs(kwargs)))


def published_nframes(total: int, video_fps: float, fps=2.0, min_frames=4, max_frames=768) -> int:
    """qwen-vl-utils' smart_nframes, as published."""
    min_frames = math.ceil(min_frames / 2) * 2
    max_frames = math.floor(min(max_frames, total) / 2) * 2
    nframes = total / video_fps * fps
    nframes = min(min(max(nframes, min_frames), max_frames), total)
    return math.floor(nframes / 2) * 2


@pytest.mark.parametrize(
    "total, video_fps, kwargs",
    [
        (300, 30.0, {}),
        (301, 29.97, {}),
        (7, 2.0, {}),
        (5, 30.0, {}),
        (4000, 25.0, {}),
        (90, 30.0, {"fps": 1.0}),
        (90, 30.0, {"min_frames": 10}),
        (600, 30.0, {"max_frames": 16}),
        (61, 24.0, {"fps": 0.5}),
    ],
)
def test_frames_are_sampled_as_published(total, video_fps, kwargs):
    indices = frame_indices(total, video_fps, VideoOptions(**kwargs))
    count = published_nframes(total, video_fps, **kwargs)
    assert len(indices) == count and count % 2 == 0
    assert indices == torch.linspace(0, total - 1, count).round().long().tolist()


def test_frame_size_shrinks_with_the_frame_count():
    for frames, (height, width) in ((4, (720, 1280)), (64, (720, 1280)), (768, (1080, 1920)), (16, (91, 333))):
        max_pixels = max(min(768 * 28 * 28, int(128000 * 28 * 28 * 0.9) / frames * 2), int(128 * 28 * 28 * 1.05))
        expected = smart_resize(height, width, 28, 128 * 28 * 28, max_pixels)
        assert frame_size(height, width, frames, VideoOptions()) == expected
    processed = processed_video(np.zeros((16, 91, 333, 3), np.uint8))  # 16 frames at the default 2 fps: all kept
    assert processed.grid_thw == (8, expected[0] // 14, expected[1] // 14) and processed.second_per_grid_t == 1.0
    assert processed.pixels.shape == (16, *expected, 3)


@pytest.mark.parametrize("count", [1, 5, 6])
def test_frames_in_memory_are_all_kept_and_an_odd_count_padded_as_transformers_does(count):
    """transformers' video processor (which vLLM hands frames to) keeps every frame it is given and repeats the last
    one up to a whole temporal patch: 5 frames -> 3 temporal patches, 1 frame -> 1."""
    frames = clip(count, 56, 56, count)
    for video in (frames, list(frames)):
        processed = processed_video(video, SMALL)
        padded = np.concatenate([frames, frames[-1:].repeat(count % 2, axis=0)])
        assert processed.grid_thw == (len(padded) // 2, 4, 4)
        assert np.array_equal(processed.pixels, padded)  # 56 x 56 needs no resize under SMALL
        assert processed.second_per_grid_t == 1.0  # 2 frames at the default fps 2, as the processor's default


def test_video_patches_follow_the_published_layout():
    config = ImageProcessorConfig()
    frames = np.random.default_rng(0).integers(0, 256, (6, 56, 84, 3), dtype=np.uint8)
    ours = patchify(torch.from_numpy(frames), config).numpy()
    np.testing.assert_allclose(ours, published_video_patches(frames, config), rtol=0, atol=1e-6)


def published_positions(ids: list[int], items: list[tuple[int, tuple, float | None]], tokens_per_second=2):
    """Qwen2.5-VL's get_rope_index as released (and in vLLM): text after a vision item starts at the largest
    position used + 1. items: (token id, grid_thw, second_per_grid_t) in prompt order."""
    ids = torch.tensor(ids)
    parts, start, cursor = [], 0, 0
    for token, (t, h, w), second in items:
        at = cursor + int((ids[cursor:] == token).nonzero()[0])
        parts.append(torch.arange(at - cursor).view(1, -1).expand(3, -1) + start)
        start += at - cursor
        gh, gw = h // 2, w // 2
        interval = torch.tensor(second if second is not None else 1.0) * tokens_per_second  # float32, as released
        t_index = (torch.arange(t).view(-1, 1).expand(-1, gh * gw) * interval).long().flatten()
        h_index = torch.arange(gh).view(1, -1, 1).expand(t, -1, gw).flatten()
        w_index = torch.arange(gw).view(1, 1, -1).expand(t, gh, -1).flatten()
        parts.append(torch.stack([t_index, h_index, w_index]) + start)
        start = int(parts[-1].max()) + 1
        cursor = at + t * gh * gw
    parts.append(torch.arange(len(ids) - cursor).view(1, -1).expand(3, -1) + start)
    return torch.cat(parts, dim=1)


def clip(frames: int, height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


CASES = {  # prompt parts, in order: a string, or ("video", clip, fps or None), or ("image", PIL image)
    "one_video_odd": ["Watch:", ("video", clip(7, 90, 122, 1), None), "What happens next?"],
    "video_and_image": [("image", random_image(112, 84, 2)), "then", ("video", clip(8, 64, 64, 3), 4.0), "Compare."],
    "two_videos": [("video", clip(40, 70, 56, 4), 30.0), "and", ("video", clip(6, 56, 98, 5), None), "Differences?"],
}


def prompt_for(name: str):
    text, images, videos = "<|im_start|>user\n", [], []
    for part in CASES[name]:
        if isinstance(part, str):
            text += part
        elif part[0] == "image":
            text += "<|vision_start|><|image_pad|><|vision_end|>"
            images.append(part[1])
        else:
            text += "<|vision_start|><|video_pad|><|vision_end|>"
            videos.append(part[1] if part[2] is None else (part[1], {"fps": part[2]}))
    text += "<|im_end|>\n<|im_start|>assistant\n"
    return {"prompt": text, "multi_modal_data": {"image": images, "video": videos}, "mm_processor_kwargs": SMALL}


def hf_reference_inputs(llm: LLM, name: str) -> dict:
    """transformers' inputs for the same frames: patches written out as published, ids expanded, and the released
    position rule (transformers 5.23 starts text after a video at max(h, w) / merge instead; see the test below)."""
    processed = llm.inputs.process(prompt_for(name))
    config = ImageProcessorConfig()
    videos = [item for item in processed.images if item.is_video]
    images = [item for item in processed.images if not item.is_video]
    ids = processed.token_ids
    inputs = {
        "input_ids": torch.tensor([ids]),
        "mm_token_type_ids": torch.tensor([[1 if t == IMAGE_ID else 2 if t == VIDEO_ID else 0 for t in ids]]),
    }
    if videos:
        inputs.update(
            pixel_values_videos=torch.from_numpy(
                np.concatenate([published_video_patches(v.pixels, config) for v in videos])
            ),
            video_grid_thw=torch.tensor([v.grid_thw for v in videos]),
            second_per_grid_ts=torch.tensor([v.second_per_grid_t for v in videos]),
        )
    if images:
        inputs.update(
            pixel_values=torch.cat([patchify(torch.from_numpy(i.pixels), config, 2) for i in images]),
            image_grid_thw=torch.tensor([i.grid_thw for i in images]),
        )
    items = [(VIDEO_ID if i.is_video else IMAGE_ID, i.grid_thw, i.second_per_grid_t) for i in processed.images]
    inputs["position_ids"] = published_positions(ids, items)[:, None, :]
    return inputs, processed


@torch.inference_mode()
def hf_greedy(model, inputs: dict, steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens by full recomputation with explicit positions (generated token i at i + delta)."""
    inputs = dict(inputs)
    first_logits, tokens = None, []
    for _ in range(steps):
        logits = model(**inputs).logits[0, -1]
        first_logits = logits if first_logits is None else first_logits
        token = int(logits.argmax())
        tokens.append(token)
        positions = inputs["position_ids"]
        inputs["position_ids"] = torch.cat([positions, positions[:, :, -1:] + 1], dim=2)
        inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([[token]])], dim=1)
        inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.tensor([[0]])], dim=1)
    return tokens, first_logits


@pytest.fixture(scope="module")
def video_llm(tiny_dirs):
    return LLM(str(tiny_dirs["tiny-3b"]), max_model_len=2048, max_num_batched_tokens=64, block_size=16)


@pytest.mark.parametrize("name", list(CASES))
def test_video_prompts_equal_transformers(video_llm, tiny_dirs, name):
    inputs, processed = hf_reference_inputs(video_llm, name)
    assert torch.equal(torch.from_numpy(processed.positions), inputs["position_ids"][:, 0])
    expected, hf_logits = hf_greedy(hf_model(tiny_dirs["tiny-3b"]), inputs, 6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    output = video_llm.generate(prompt_for(name), params, use_tqdm=False)[0].outputs[0]
    assert output.token_ids == expected  # chunked prefill (64 tokens a step) through the paged engine
    ours = {token: lp.logprob for token, lp in output.logprobs[0].items()}
    reference = hf_logits.log_softmax(-1)
    for token, logprob in ours.items():
        assert abs(logprob - float(reference[token])) < 1e-4


def test_text_after_a_video_follows_the_released_rule(tiny_dirs):
    """Released Qwen2.5-VL (and vLLM): text after a vision item starts one past the largest position used.
    transformers 5.23 starts it at the item's start + max(h, w) / merge: the same for an image (whose largest
    position is that), earlier for a video whose time positions run past it. We follow the released model."""
    model = hf_model(tiny_dirs["tiny-3b"])
    processor = ImageProcessor(ImageProcessorConfig())
    prompts = PromptProcessor(tiny_dirs["tiny-3b"], ModelConfig.from_dir(tiny_dirs["tiny-3b"]))
    text = "<|vision_start|><|video_pad|><|vision_end|>after<|vision_start|><|image_pad|><|vision_end|>end"
    ids = prompts.tokenizer.encode(text, add_special_tokens=False)
    video = processed_video(clip(12, 56, 56, 6), SMALL)  # 6 temporal patches, 2 x 2 merged groups
    image = processor(random_image(56, 56, 7))
    ours = prompts.expand(ids, [image], [video])
    items = [(VIDEO_ID, video.grid_thw, video.second_per_grid_t), (IMAGE_ID, image.grid_thw, None)]
    assert np.array_equal(ours.positions, published_positions(ours.token_ids, items).numpy())
    types = torch.tensor([[1 if t == IMAGE_ID else 2 if t == VIDEO_ID else 0 for t in ours.token_ids]])
    hf_positions, _ = model.model.get_rope_index(
        torch.tensor([ours.token_ids]),
        types,
        image_grid_thw=torch.tensor([image.grid_thw]),
        video_grid_thw=torch.tensor([video.grid_thw]),
        second_per_grid_ts=torch.tensor([video.second_per_grid_t]),
    )
    after_video = ours.token_ids.index(VIDEO_ID) + video.num_tokens + 1  # <|vision_end|>
    assert int(ours.positions[0, after_video]) == int(ours.positions[:, :after_video].max()) + 1
    assert int(hf_positions[0, 0, after_video]) < int(ours.positions[0, after_video])  # 5.23 differs here only
    image_only = prompts.expand(prompts.tokenizer.encode("a<|image_pad|>b", add_special_tokens=False), [image])
    hf_image, _ = model.model.get_rope_index(
        torch.tensor([image_only.token_ids]),
        torch.tensor([[int(t == IMAGE_ID) for t in image_only.token_ids]]),
        image_grid_thw=torch.tensor([image.grid_thw]),
    )
    assert np.array_equal(image_only.positions, hf_image[:, 0].numpy())  # images: both rules agree


def test_media_io_kwargs_choose_the_frames_and_bad_ones_are_named(tiny_dirs):
    """vLLM's media_io_kwargs: video num_frames keeps that many frames (an even count here, capped at the server's
    max_frames), fps the rate; --media-io-kwargs sets them for every request, a request's own come on top."""
    from fovea.config.engine import EngineConfig
    from fovea.config.video import media_io_processor_kwargs
    from fovea.frontend.input_processor import InputProcessor

    assert media_io_processor_kwargs({"video": {"num_frames": 8, "fps": 1.0}, "image": {"image_mode": "RGB"}}) == {
        "min_frames": 8,
        "max_frames": 8,
        "fps": 1.0,
    }
    for bad, words in [
        ({"audio": {}}, "takes video and image settings"),
        ({"video": {"frames": 3}}, r"\['video.frames'\] are not supported"),
        ({"video": {"num_frames": 1}}, "at least 2"),
        ({"image": {"image_mode": "L"}}, "read as RGB only"),
    ]:
        with pytest.raises(ValueError, match=words):
            media_io_processor_kwargs(bad)
    with pytest.raises(ValueError, match="at least 2"):
        EngineConfig.from_args(str(tiny_dirs["tiny-3b"]), media_io_kwargs={"video": {"num_frames": 0}})
    frames = np.stack([np.asarray(random_image(56, 56, seed=s)) for s in range(40)])
    chat = [
        {"role": "user", "content": [{"type": "video", "video": (frames, {"fps": 10})}, {"type": "text", "text": "?"}]}
    ]

    def kept(engine_args, kwargs=None):
        config = EngineConfig.from_args(str(tiny_dirs["tiny-3b"]), dtype="float32", **engine_args)
        return InputProcessor(config).process_chat(chat, kwargs).images[0].grid_thw[0] * 2

    assert kept({}) == 8  # 4 s at fps 2
    assert kept({"media_io_kwargs": {"video": {"num_frames": 12}}}) == 12
    assert kept({"media_io_kwargs": {"video": {"num_frames": 13}}}) == 12  # an even count
    assert kept({"media_io_kwargs": {"video": {"fps": 1}}}) == 4
    assert kept({"media_io_kwargs": {"video": {"num_frames": 12}}}, {"max_frames": 6, "min_frames": 6}) == 6
    assert (
        kept({"mm_processor_kwargs": {"max_frames": 10}}, media_io_processor_kwargs({"video": {"num_frames": 30}}))
        == 10
    )
