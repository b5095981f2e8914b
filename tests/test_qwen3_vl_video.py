"""Qwen3-VL's videos against transformers on tiny checkpoints it wrote (dense and MoE): which frames are kept and
their size (its Qwen3VLVideoProcessor's sampling and smart_resize), the prompt (each temporal patch after its
time as text, `<0.4 seconds>`, as the released processor writes it), positions, logits, and the engine's greedy
tokens with chunked prefill, prefix-cache hits and preemption.

transformers resizes video frames with torchvision, which this machine does not have: the reference inputs here
take our resized frames (PIL bicubic, as for Qwen2.5-VL's videos) and do the rest (normalising, patch layout,
prompt) with transformers' own code or the released rule; the resize itself is compared on the GPU machine
(benchmarks/gpu_media_checks.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import hf_tokenizer, random_image, video_file
from PIL import Image

from fovea import LLM, SamplingParams
from fovea.attention.layer import AttentionMetadata
from fovea.config.model import ModelConfig
from fovea.config.video import TimestampedVideoOptions
from fovea.models.loader import load_model
from fovea.models.mrope_positions import decode_positions
from fovea.multimodal.patchify import patchify
from fovea.multimodal.prompt import PromptProcessor
from fovea.testing.tiny_qwen3_vl import VIDEO_PREPROCESSOR, write_qwen3_vl_checkpoint

IMAGE_PAD, VIDEO_PAD = 151655, 151656
TRIPLE = "<|vision_start|><|video_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3-vl-video")
    return {
        "dense": write_qwen3_vl_checkpoint(root / "dense", seed=5),
        "moe": write_qwen3_vl_checkpoint(root / "moe", "tiny-qwen3-vl-moe", seed=6),
    }


def hf_video_processor():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    settings = {k: v for k, v in VIDEO_PREPROCESSOR.items() if k not in ("video_processor_type", "processor_class")}
    return Qwen3VLVideoProcessor(**settings)


@pytest.mark.parametrize(
    "total, fps, height, width, cap",
    [
        (9, 4.0, 70, 90, False),  # 4 frames (min_frames)
        (3, 1.0, 64, 64, False),  # an odd count: all 3 frames, the last repeated
        (300, 30.0, 720, 1280, False),  # 20 frames at full size
        (5000, 25.0, 1080, 1920, False),  # 400 frames: all shrink to share the total area
        (7, 2.0, 20, 600, False),  # a side under 32 pixels is scaled up first
        (31, 10.0, 481, 853, True),  # cap_pixels_per_frame: each frame at most its share
        (1000, 30.0, 360, 640, True),
    ],
)
def test_frames_and_sizes_equal_transformers(total, fps, height, width, cap):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
    from transformers.video_utils import VideoMetadata

    processor = hf_video_processor()
    options = TimestampedVideoOptions.from_preprocessor(VIDEO_PREPROCESSOR).with_kwargs({"cap_pixels_per_frame": cap})
    indices = options.frame_indices(total, fps)
    assert indices == processor.sample_frames(VideoMetadata(total_num_frames=total, fps=fps)).tolist()
    h, w = options.frame_size(height, width, len(indices))
    patches = processor.get_num_of_video_patches(len(indices), height, width, {"cap_pixels_per_frame": cap})
    assert -(-len(indices) // 2) * (h // 16) * (w // 16) == patches
    if not cap:
        assert (h, w) == smart_resize(len(indices), height, width, 2, 32, 4096, 25165824)


def frames(count: int, height: int, width: int, seed: int) -> np.ndarray:
    """Smooth random frames (a bicubic resize of noise rings less than of flat blocks of colour)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (count, 6, 8, 3), dtype=np.uint8)
    return np.stack([np.asarray(Image.fromarray(f).resize((width, height), Image.BILINEAR)) for f in small])


def hf_reference(model_dir, messages, images, videos):
    """transformers' inputs, built without fovea: its tokenizer and template, its PIL image processor, and per
    video (frames, fps) its sample_frames, smart_resize, patchify and _calculate_timestamps, with the released
    prompt rule: the template's whole <|vision_start|><|video_pad|><|vision_end|> becomes, per temporal patch,
    `<t seconds><|vision_start|>` + its pads + `<|vision_end|>`."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
    from transformers.video_utils import VideoMetadata

    tok = hf_tokenizer(model_dir)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = {}
    if images:
        feats = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))(images=images, return_tensors="pt")
        pieces = text.split("<|image_pad|>")
        counts = (feats["image_grid_thw"].prod(-1) // 4).tolist()
        text = pieces[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, pieces[1:]))
        out.update(pixel_values=feats["pixel_values"], image_grid_thw=feats["image_grid_thw"])
    processor, patches, grids = hf_video_processor(), [], []
    for clip, fps in videos:
        indices = processor.sample_frames(VideoMetadata(total_num_frames=len(clip), fps=fps)).tolist()
        h, w = smart_resize(len(indices), *clip.shape[1:3], 2, 32, 4096, 25165824)
        resized = np.stack([np.asarray(Image.fromarray(clip[i]).resize((w, h), Image.BICUBIC)) for i in indices])
        normalized = (torch.from_numpy(resized).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5
        flat, t, gh, gw = processor.patchify(normalized[None], 16, 2, 2)
        patches.append(flat[0])
        grids.append([t, gh, gw])
        times = Qwen3VLProcessor._calculate_timestamps(None, indices, fps, 2)
        pads = "<|video_pad|>" * (gh * gw // 4)
        text = text.replace(TRIPLE, "".join(f"<{s:.1f} seconds><|vision_start|>{pads}<|vision_end|>" for s in times), 1)
    if videos:
        out.update(pixel_values_videos=torch.cat(patches), video_grid_thw=torch.tensor(grids))
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    out["input_ids"] = ids
    out["mm_token_type_ids"] = (ids == IMAGE_PAD).long() + 2 * (ids == VIDEO_PAD).long()
    return out


CLIPS = {"short": (frames(9, 70, 90, seed=1), 4.0), "odd": (frames(5, 48, 112, seed=2), 1.0)}


def conversation(kind: str):
    """(messages for the template, messages for fovea, images, videos)."""
    question = {"type": "text", "text": "What happens, and when?"}
    if kind == "video":
        videos, images = [CLIPS["short"]], []
        parts = [{"type": "video"}, question]
    else:  # an image, then a video of an odd frame count
        videos, images = [CLIPS["odd"]], [random_image(200, 150, seed=8)]
        parts = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"}, question]
    given, media = [], iter([*images, *videos])
    for part in parts:
        if part["type"] == "image":
            given.append({"type": "image_pil", "image_pil": next(media)})
        elif part["type"] == "video":
            clip, fps = next(media)
            given.append({"type": "video", "video": (clip, {"fps": fps})})
        else:
            given.append(part)
    return [{"role": "user", "content": parts}], [{"role": "user", "content": given}], images, videos


@pytest.mark.parametrize("family", ["dense", "moe"])
@pytest.mark.parametrize("kind", ["video", "image_and_video"])
def test_prompt_positions_and_logits_match_transformers(dirs, family, kind):
    from transformers import AutoModelForImageTextToText

    model_dir = dirs[family]
    model, _ = load_model(model_dir, dtype="float32")
    template_messages, messages, images, videos = conversation(kind)
    prompt = PromptProcessor(model_dir, model.config).process_chat(messages)
    reference = hf_reference(model_dir, template_messages, images, videos)
    assert prompt.token_ids == reference["input_ids"][0].tolist()
    hf = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    expected, delta = hf.model.get_rope_index(
        reference["input_ids"],
        reference["mm_token_type_ids"],
        reference.get("image_grid_thw"),
        reference["video_grid_thw"],
    )
    assert np.array_equal(prompt.positions, expected[:, 0].numpy()) and prompt.mrope_delta == int(delta)
    extra = [5, 17, 9]  # decode steps after the prompt
    ids = prompt.token_ids + extra
    positions = np.concatenate([prompt.positions, decode_positions(len(prompt.token_ids), 3, prompt.mrope_delta)], 1)
    with torch.no_grad():
        mm = torch.cat(
            [
                model.encode_images(patchify(torch.from_numpy(item.pixels), model.config.image), [item.grid_thw])[0]
                for item in prompt.images
            ]
        )
        hidden = model(torch.tensor(ids), torch.from_numpy(positions), AttentionMetadata.from_lengths([len(ids)]), mm)
        ours = model.compute_logits(hidden)
        reference["input_ids"] = torch.tensor([ids])
        reference["mm_token_type_ids"] = torch.nn.functional.pad(reference["mm_token_type_ids"], (0, 3))
        ref = hf(**reference).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_a_video_file_keeps_its_rate_in_the_timestamps(dirs):
    """A file's frame rate (from its header) times the kept frames: the same prompt as its frames with that fps."""
    model_dir = dirs["dense"]
    prompts = PromptProcessor(model_dir, ModelConfig.from_dir(model_dir))
    clip, _ = CLIPS["short"]
    as_file = prompts.process_chat(
        [{"role": "user", "content": [{"type": "video", "video": video_file(clip, 3)}, {"type": "text", "text": "?"}]}]
    )
    reference = hf_reference(model_dir, [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "?"}]}],
                             [], [(clip, 3.0)])  # fmt: skip
    assert as_file.token_ids == reference["input_ids"][0].tolist()
    # 6 of 9 frames kept at 3 fps (0, 2 | 3, 5 | 6, 8): each patch at its two frames' mean time
    assert as_file.images[0].timestamps == pytest.approx((1 / 3, 4 / 3, 7 / 3))


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_engine_greedy_matches_transformers(dirs, family):
    """A budget small enough that a video's prompt is prefilled in chunks and sequences are preempted; the same
    video again comes from the prefix cache."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    model_dir = dirs[family]
    system = [{"role": "system", "content": "You watch videos closely and say what changes. " * 3}]
    cases = [conversation(kind) for kind in ("video", "image_and_video", "video", "image_and_video", "video")]
    cases = [(system + t, system + m, i, v) for t, m, i, v in cases[:4]] + cases[4:]
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        block_size=16,
        num_gpu_blocks_override=14,
        max_model_len=160,
    )
    # every video and image encoded first and kept in the encoder cache: whether sequences preempt then does not
    # depend on how fast the vision tower's thread keeps up with the steps
    warm = [conversation(kind)[1] for kind in ("video", "image_and_video")]
    llm.chat(warm, SamplingParams(max_tokens=1), use_tqdm=False)
    outputs = llm.chat(
        [m for _, m, _, _ in cases], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    engine = llm.engine
    assert max(len(o.prompt_token_ids) for o in outputs) > engine.config.max_num_batched_tokens  # chunked
    assert engine.scheduler.num_preemptions > 0
    assert sum(o.num_cached_tokens > 0 for o in outputs) >= 2
    hf = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    hf.generation_config = GenerationConfig(do_sample=False)
    for (template_messages, _, images, videos), out in zip(cases, outputs):
        inputs = hf_reference(model_dir, template_messages, images, videos)
        with torch.no_grad():
            expected = hf.generate(**inputs, max_new_tokens=10, do_sample=False)[0, inputs["input_ids"].shape[1] :]
        assert out.outputs[0].token_ids == expected.tolist(), template_messages


def test_plan_and_engine_size_videos_by_qwen3s_rule(dirs):
    """`fovea plan` lists Qwen3-VL's videos by its own rule (transformers' patch count), and the engine sizes its
    encoder for the largest frame that rule allows: two frames sharing the whole area bound."""
    from fovea.config.engine import EngineConfig
    from fovea.plan import plan_memory

    processor = hf_video_processor()
    rows = {what: (kept, tokens) for what, kept, tokens, _ in plan_memory(dirs["dense"], 80).videos}
    assert rows["60 s 1280x720"] == (120, processor.get_num_of_video_patches(120, 720, 1280) // 4)  # 60 x 10 x 19
    assert rows["600 s 1920x1080"][0] == 768  # max_frames
    config = EngineConfig.from_args(str(dirs["dense"]), dtype="float32")
    assert config.largest_frame_pixels == 25165824 / 2
    capped = EngineConfig.from_args(
        str(dirs["dense"]), dtype="float32", mm_processor_kwargs={"cap_pixels_per_frame": True}
    )
    assert capped.largest_frame_pixels == 768 * 32 * 32  # max_video_tokens tokens of 32 x 32 pixels
