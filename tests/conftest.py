"""Shared fixtures: tiny checkpoints written once per session, HF transformers as the reference implementation."""

from __future__ import annotations

import io
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

torch.set_num_threads(1)  # the CI machine has 2 shared cores; more threads thrash
if not torch.cuda.is_available():  # our Triton kernels run under the interpreter; set before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")
warnings.filterwarnings("ignore", category=FutureWarning)

IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 151655, 151656


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a test left out of the fast tier (pytest -m 'not slow'); CI runs it")
    config.addinivalue_line("markers", "extended: a longer tier (more fuzzer draws); FOVEA_EXTENDED=1 runs it")


# Left out of the fast tier (`pytest -m "not slow"`, docs/development.md): the files that took the longest in
# a full run (`--durations=0` at 6acf457, 650 of its 930 test seconds): servers started, parallel ranks, the
# fuzzer, every family against transformers. The engine's parity with transformers (test_engine_vs_hf,
# test_model_vs_hf), its unit tests and one server's stay in it.
SLOW_FILES = {
    "test_soak.py",
    "test_encoder_workers.py",
    "test_config_fuzz.py",
    "test_request_fuzz.py",
    "test_crosstalk_fuzz.py",
    "test_crosstalk_exact_fuzz.py",
    "test_parallel_serving.py",
    "test_multihost.py",
    "test_families.py",
    "test_eval_backends.py",
    "test_tensor_parallel.py",
    "test_structured_outputs.py",
    "test_loading.py",
    "test_quantized.py",
    "test_lora.py",
    "test_bench.py",
    "test_server_templates.py",
    "test_docs_examples.py",
    "test_vllm_args.py",
    "test_tool_calls.py",
    "test_cli.py",
    "test_hostile_load.py",
    "test_metrics.py",
    "test_playground.py",
    "test_qwen3_vl_video.py",
    "test_chat_formats.py",
    "test_server_errors.py",
    "test_responses.py",
    "test_video_files.py",
}


# The files that take longest, longest first (`--durations=0` at e78fb7f on the 2-core CI machine, 2,552 test
# seconds in all): they start first, so that the two workers end together instead of one running a long file alone
# at the end (with `--no-loadscope-reorder` in pyproject.toml: xdist's own order puts the files with the most tests
# first).
LONGEST_FIRST = [
    "test_soak.py",
    "test_multihost.py",
    "test_parallel_serving.py",
    "test_encoder_workers.py",
    "test_structured_outputs.py",
    "test_config_fuzz.py",
    "test_tensor_parallel.py",
    "test_eval_backends.py",
    "test_kernels.py",
    "test_bench.py",
    "test_docs_examples.py",
    "test_families.py",
    "test_request_fuzz.py",
    "test_tool_calls.py",
    "test_vllm_args.py",
    "test_quantized.py",
    "test_async_engine.py",
    "test_metrics.py",
    "test_responses.py",
    "test_playground.py",
    "test_model_vs_hf.py",
]


@pytest.hookimpl(tryfirst=True)  # before `-m` reads the markers
def pytest_collection_modifyitems(config, items):
    """Orders the files longest first; marks the slow tier; leaves the extended tier out of the default run
    (CI's 20 minutes), not skipped: FOVEA_EXTENDED=1 adds it."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order stays
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
    if os.environ.get("FOVEA_EXTENDED") == "1":
        return
    extended = [item for item in items if item.get_closest_marker("extended")]
    if extended:
        config.hook.pytest_deselected(items=extended)
        items[:] = [item for item in items if not item.get_closest_marker("extended")]


@pytest.fixture(scope="session", autouse=True)
def small_gpu_share():
    """On a GPU, engines built in this process default to a small share of the card (serving.GPU_SHARE), as the
    servers the tests start do: many share one card over a run."""
    if not torch.cuda.is_available():
        yield
        return
    from serving import GPU_SHARE

    from fovea.config.engine import EngineConfig

    build = EngineConfig.build.__func__
    patch = pytest.MonkeyPatch()
    patch.setattr(
        EngineConfig,
        "build",
        classmethod(
            lambda cls, *args, **options: build(cls, *args, **{"gpu_memory_utilization": GPU_SHARE, **options})
        ),
    )
    yield
    patch.undo()


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """{"tiny-3b": dir, "tiny-7b": dir}: the two tiny configs in the published layout, fp32 weights."""
    from fovea.testing.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {name: write_tiny_checkpoint(root / name, name, seed=1 + i) for i, name in enumerate(["tiny-3b", "tiny-7b"])}


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    """Each family's tiny checkpoint (tests/test_families.py and the tests built on it)."""
    from fovea.testing.tiny import write_tiny_checkpoint
    from fovea.testing.tiny_gemma3 import write_gemma3_checkpoint
    from fovea.testing.tiny_internvl import write_internvl_checkpoint
    from fovea.testing.tiny_llava import write_llava_checkpoint
    from fovea.testing.tiny_qwen3_vl import write_qwen3_vl_checkpoint

    root = tmp_path_factory.mktemp("families")
    return {
        "internvl": write_internvl_checkpoint(root / "internvl", seed=8),
        # 16 tokens an image, twice the sliding window
        "gemma3": write_gemma3_checkpoint(root / "gemma3", seed=7, image_size=112, tokens_per_image=16),
        "llava": write_llava_checkpoint(root / "llava", seed=3),
        "qwen2-vl": write_tiny_checkpoint(root / "qwen2-vl", "tiny-qwen2-vl", seed=4),
        "qwen3-vl": write_qwen3_vl_checkpoint(root / "qwen3-vl", seed=5),
        "qwen3-vl-moe": write_qwen3_vl_checkpoint(root / "qwen3-vl-moe", "tiny-qwen3-vl-moe", seed=6),
    }


_HF_TOKENIZERS: dict = {}


def hf_tokenizer(model_dir):
    """transformers' AutoTokenizer for a checkpoint, loaded once per process for each set of tokenizer files (the
    engine's key, tokenizer_source): many checkpoints here (every fuzzer draw, most families' tiny ones) carry the
    same files, and reading Qwen's vocabulary takes about a second a time, a tenth of the suite's CPU before.
    Shared: callers must not change it."""
    from transformers import AutoTokenizer

    from fovea.multimodal.prompt import tokenizer_source

    key = tokenizer_source(Path(model_dir))
    if key not in _HF_TOKENIZERS:
        _HF_TOKENIZERS[key] = AutoTokenizer.from_pretrained(str(model_dir))
    return _HF_TOKENIZERS[key]


_HF_CACHE: dict = {}
_OURS_CACHE: dict = {}


def hf_model(model_dir):
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    key = str(model_dir)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            key, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        # Plain greedy: otherwise generate() merges the checkpoint's generation_config.json (repetition
        # penalty 1.05, top_k...) into every call, even into an explicit greedy GenerationConfig.
        _HF_CACHE[key].generation_config = GenerationConfig(
            do_sample=False, eos_token_id=[151645, 151643], pad_token_id=151643
        )
    return _HF_CACHE[key]


def our_model(model_dir):
    from fovea.models.loader import load_model
    from fovea.multimodal.prompt import PromptProcessor

    key = str(model_dir)
    if key not in _OURS_CACHE:
        model, _ = load_model(model_dir, dtype="float32")
        _OURS_CACHE[key] = (model, PromptProcessor(model_dir, model.config))
    return _OURS_CACHE[key]


def image_patches(images, frames: int = 1) -> torch.Tensor:
    """The vision tower's input for processed images, made as the engine makes it (frames=1); frames=2 is the
    layout transformers' processor hands over (the still image repeated)."""
    from fovea.config.image import ImageProcessorConfig
    from fovea.multimodal.patchify import patchify

    return torch.cat([patchify(torch.from_numpy(im.pixels), ImageProcessorConfig(), frames) for im in images])


def random_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """Smooth random structure plus noise, so that resizing matters and no two images are alike."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(2, height // 16), max(2, width // 16), 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(small).resize((width, height), Image.BILINEAR), dtype=np.int16)
    noisy = np.clip(base + rng.integers(-20, 21, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(noisy)
    return image if mode == "RGB" else image.convert(mode)


def jpeg_bytes(image: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def video_file(frames: np.ndarray, fps: int, lossless: bool = True) -> bytes:
    """A video file of `frames` (T, H, W, 3) uint8 written with PyAV: FFV1 in Matroska (lossless RGB, so decoding
    gives back exactly these frames; the container does not store a frame count) or H.264 in MP4 (what users
    send; lossy)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska" if lossless else "mp4") as container:
        stream = container.add_stream("ffv1" if lossless else "libx264", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "bgr0" if lossless else "yuv420p"
        container.start_encoding()  # the header, even for no frames
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def hf_greedy_logprobs(reference, inputs: dict, max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens after `inputs`' prompt (no stop token) and the log-probability of each."""
    with torch.no_grad():
        generated = reference.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = generated.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(generated.logits, tokens)]


def assert_greedy_is_the_references(reference, outputs, inputs: list[dict]) -> None:
    """Each engine output (greedy, logprobs=0, ignore_eos) against transformers' generate over the same prompt:
    the prompt ids, the tokens, their log-probabilities within 1e-4."""
    for out, given in zip(outputs, inputs, strict=True):
        tokens, theirs = hf_greedy_logprobs(reference, given, len(out.outputs[0].token_ids))
        ours = [entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
        assert out.prompt_token_ids == given["input_ids"][0].tolist()
        assert out.outputs[0].token_ids == tokens, out.prompt_token_ids
        assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-4, (ours, theirs)


def assert_same_tokens_and_logprobs(expected: list, got: list) -> None:
    """(token ids, logprobs) per output, e.g. one process's and tensor-parallel ranks': the same tokens and
    top-logprob tokens, log-probabilities within 1e-4."""
    for (want_ids, want_logprobs), (ids, logprobs) in zip(expected, got, strict=True):
        assert ids == want_ids
        for want, entry in zip(want_logprobs, logprobs, strict=True):
            assert list(entry) == list(want)
            np.testing.assert_allclose(
                [e.logprob for e in entry.values()], [e.logprob for e in want.values()], atol=1e-4
            )


def internvl_processor(model_dir):
    """transformers' InternVLProcessor with the checkpoint's image processor (PIL) and tokenizer, built without its
    video processor: that needs torchvision, which this machine lacks, and images do not use it."""
    from transformers import InternVLProcessor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    class ImagesOnly(InternVLProcessor):
        def check_argument_for_proper_class(self, name, arg):
            return None if name == "video_processor" else super().check_argument_for_proper_class(name, arg)

    settings = json.loads((model_dir / "processor_config.json").read_text())
    return ImagesOnly(
        GotOcr2ImageProcessorPil.from_pretrained(str(model_dir)),
        hf_tokenizer(model_dir),
        None,
        image_seq_length=settings["image_seq_length"],
        chat_template=(model_dir / "chat_template.jinja").read_text(),
    )


class InternVLFrames:
    """Stands in for transformers' InternVLVideoProcessor (torchvision, which this machine lacks, resizes its
    frames): each frame resized to one tile as InternVL's published code does (torchvision's Resize on a PIL
    image is PIL's bicubic), rescaled and normalised as the checkpoint's images. The prompt text, the frames'
    order among the images and the model's inputs stay transformers' InternVLProcessor's."""

    def __init__(self, image_processor):
        self.side = image_processor.size["height"]
        self.mean, self.std = np.array(image_processor.image_mean), np.array(image_processor.image_std)

    def __call__(self, videos, **kwargs):
        tiles = [
            [np.asarray(Image.fromarray(frame).resize((self.side, self.side), Image.BICUBIC)) for frame in video]
            for video in videos
        ]
        normalised = (np.array(tiles, np.float32) / 255 - self.mean) / self.std  # (videos, frames, side, side, 3)
        return {"pixel_values_videos": torch.from_numpy(normalised.astype(np.float32)).permute(0, 1, 4, 2, 3)}


def internvl_inputs(model_dir, messages, images, videos=()) -> dict:
    """transformers' inputs for InternVL; `videos`: (frames, height, width, 3) uint8 arrays (InternVLFrames)."""
    processor = internvl_processor(model_dir)
    processor.video_processor = InternVLFrames(processor.image_processor)
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return dict(processor(text=text, images=images or None, videos=list(videos) or None, return_tensors="pt"))


def hf_inputs(model_dir, messages, images, max_pixels=None, videos=()):
    """The reference inputs, built with transformers only: its tokenizer + chat template, its PIL image
    processor, and the string-level placeholder expansion its Qwen2.5-VL processor performs. `videos`: (frames as
    our processor sized them, seconds per temporal patch or None for Qwen2-VL): transformers resizes frames with
    torchvision, which this machine lacks; the rest (normalising, the patch layout, the placeholders) is done here
    as published."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = hf_tokenizer(model_dir)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = {}
    if images:
        kwargs = {"max_pixels": max_pixels} if max_pixels else {}
        proc = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir), **kwargs)
        feats = proc(images=images, return_tensors="pt")
        text = expand_placeholders(text, "<|image_pad|>", (feats["image_grid_thw"].prod(-1) // 4).tolist())
        out.update(pixel_values=feats["pixel_values"], image_grid_thw=feats["image_grid_thw"])
    if videos:
        from fovea.config.image import ImageProcessorConfig

        config = ImageProcessorConfig()
        grids = [(len(f) // 2, f.shape[1] // 14, f.shape[2] // 14) for f, _ in videos]
        text = expand_placeholders(text, "<|video_pad|>", [t * h * w // 4 for t, h, w in grids])
        patches = np.concatenate([published_video_patches(frames, config) for frames, _ in videos])
        out.update(pixel_values_videos=torch.from_numpy(patches), video_grid_thw=torch.tensor(grids))
        if videos[0][1] is not None:
            out["second_per_grid_ts"] = torch.tensor([second for _, second in videos])
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    out["input_ids"] = ids
    out["mm_token_type_ids"] = (ids == IMAGE_TOKEN_ID).long() + 2 * (ids == VIDEO_TOKEN_ID).long()
    return out


def expand_placeholders(text: str, placeholder: str, counts: list[int]) -> str:
    pieces = text.split(placeholder)
    assert len(pieces) == len(counts) + 1
    return pieces[0] + "".join(placeholder * n + p for n, p in zip(counts, pieces[1:]))


def published_video_patches(frames: np.ndarray, config) -> np.ndarray:
    """transformers' Qwen2-VL video patch layout, written out: (T, C, H, W) normalized, cut as published."""
    x = (frames.astype(np.float32) / np.float32(255) - np.float32(config.image_mean)) / np.float32(config.image_std)
    x = x.transpose(0, 3, 1, 2)
    t, c, h, w = x.shape
    p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
    x = x.reshape(t // tp, tp, c, h // p // m, m, p, w // p // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t // tp * (h // p) * (w // p), c * tp * p * p)


# Published shapes (shared/reference/qwen2_5_vl-facts.md): hidden, layers, heads, kv heads, intermediate, vocab, tied
QWEN_SHAPES = {
    "3b": (2048, 36, 16, 2, 11008, 151936, True),
    "7b": (3584, 28, 28, 4, 18944, 152064, False),
    "32b": (5120, 64, 40, 8, 27648, 152064, False),
    "72b": (8192, 80, 64, 8, 29568, 152064, False),
}


def published_param_count(size: str) -> int:
    """Parameters of a published Qwen2.5-VL size, counted from the facts: LM (QKV bias, RMSNorms) + vision tower
    (depth 32, hidden 1280, intermediate 3420, patch 1176 values, merger 5120 -> 5120 -> LM hidden)."""
    hidden, layers, heads, kv_heads, intermediate, vocab, tied = QWEN_SHAPES[size]
    qkv = 128 * (heads + 2 * kv_heads)
    lm_layer = hidden * qkv + qkv + heads * 128 * hidden + 3 * hidden * intermediate + 2 * hidden
    lm = layers * lm_layer + vocab * hidden * (1 if tied else 2) + hidden
    v_hidden, v_inter, merged = 1280, 3420, 1280 * 4
    v_block = (
        2 * v_hidden
        + v_hidden * 3 * v_hidden
        + 3 * v_hidden
        + v_hidden * v_hidden
        + v_hidden
        + 2 * (v_hidden * v_inter + v_inter)
        + v_inter * v_hidden
        + v_hidden
    )
    vision = 1176 * v_hidden + 32 * v_block + v_hidden + merged * merged + merged + merged * hidden + hidden
    return lm + vision


def published_shape_dir(root, tiny_dir, size: str):
    """A model directory holding only the config.json of a published size (no weights)."""
    import json
    import shutil

    hidden, layers, heads, kv_heads, intermediate, vocab, tied = QWEN_SHAPES[size]
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(tiny_dir / "preprocessor_config.json", root / "preprocessor_config.json")
    config = json.loads((tiny_dir / "config.json").read_text())
    config.update(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        torch_dtype="bfloat16",
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
    )
    config["vision_config"].update(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=hidden,
        fullatt_block_indexes=[7, 15, 23, 31],
    )
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture
def fovea_log(caplog):
    """caplog, with INFO records of the `fovea` logger (which does not propagate to the root logger)."""
    import logging

    logger = logging.getLogger("fovea")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="fovea"):
            yield caplog
    finally:
        logger.removeHandler(caplog.handler)


@pytest.fixture(scope="module")
def adapters(tiny_dirs, tmp_path_factory):
    """Three adapters of the Qwen2.5-VL checkpoint, written on first use (the draws that turn LoRA on)."""
    written = []

    def make() -> list:
        if not written:
            from test_lora import write_adapter

            from fovea import LoRARequest

            root = tmp_path_factory.mktemp("crosstalk-lora")
            for i, targets in enumerate([["q_proj", "v_proj", "down_proj"], ["k_proj", "o_proj", "qkv"], ["up_proj"]]):
                path = write_adapter(tiny_dirs["tiny-3b"], root / f"l{i}", targets, seed=40 + i, rank=4 + 4 * i)
                written.append(LoRARequest(f"l{i}", i + 1, str(path)))
        return written

    return make


@pytest.fixture(scope="module")
def crosstalk_models(tiny_dirs, tmp_path_factory):
    """The cross-talk fuzzes' models: {name: (directory, max_model_len)}."""
    from fovea.testing.tiny_llava import write_llava_checkpoint

    # LLaVA's images are 576 tokens: a few fill the encoder cache and the KV cache
    llava = write_llava_checkpoint(tmp_path_factory.mktemp("crosstalk") / "llava", seed=3)
    return {"qwen2.5-vl": (tiny_dirs["tiny-3b"], 512), "llava": (llava, 2048)}
