"""Model configuration read once from a Hugging Face model directory and passed down to every layer, and where
that directory comes from (a local path, the Hugging Face cache or hub, or the embedded demo model).

`ModelConfig.from_dir` reads config.json and preprocessor_config.json once; the parser of the family that
`architectures` names (families.py) turns them into these dataclasses.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from fovea.config.image import ImageProcessorConfig
from fovea.config.quant import QuantConfig
from fovea.config.video import TiledVideoOptions, TimestampedVideoOptions, VideoOptions

logger = logging.getLogger("fovea")

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float": torch.float32,
}


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (Qwen3-VL-MoE): each token's top_k experts out of num_experts, SwiGLU each.
    GPT-OSS's: a router with a bias, experts with biases, their gate and up columns stored alternating, and a
    clamped SwiGLU (`swiglu`: its alpha and limit)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    sparse_layers: tuple[int, ...]  # the decoder layers whose MLP is the experts (the others are dense)
    norm_topk_prob: bool = True  # the chosen experts' weights renormalised to sum to 1
    # the released checkpoints (transformers 4) store gate_up (E, hidden, 2 x inter) and down (E, inter, hidden);
    # transformers 5 writes both transposed
    hub_layout: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    interleaved: bool = False  # gate|up's columns alternate gate, up (GPT-OSS's layout)
    swiglu: tuple[float, float] | None = None  # (alpha, limit): GPT-OSS's clamped SwiGLU


@dataclass(frozen=True)
class RopeScaling:
    """How a decoder's RoPE frequencies are scaled for longer contexts (config.json's rope_scaling or
    rope_parameters), as transformers computes them: `linear` divides every frequency by `factor`; `yarn` divides
    the low ones and keeps the high ones, ramping between (beta_fast/beta_slow rotations over
    original_max_position_embeddings), and scales cos and sin by `attention_factor`; `llama3` does the same
    by wavelength (low_freq_factor/high_freq_factor)."""

    kind: str = "default"  # default, linear, yarn or llama3
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    attention_factor: float | None = None  # yarn; None: from factor (and mscale / mscale_all_dim)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def longest(self, max_position_embeddings: int) -> int:
        """The longest context the scaled model takes, as vLLM derives it: yarn the original length times
        the factor, linear the model's length times it; llama3 leaves the model's length."""
        if self.kind == "yarn":
            return int(self.original_max_position_embeddings * self.factor)
        return int(max_position_embeddings * (self.factor if self.kind == "linear" else 1))


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]  # 1-D RoPE: (head_dim / 2, 0, 0)
    max_position_embeddings: int
    attention_bias: bool = True  # biases on q/k/v (Qwen2); Llama and Qwen3 have none unless configured
    output_bias: bool = False  # and on o_proj (Llama's and Qwen3's attention_bias, Gemma 3's)
    mlp_bias: bool = False  # on the MLP's three projections (Llama's mlp_bias)
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and of k, before rotary
    mrope_interleaved: bool = False  # Qwen3-VL: the frequencies cycle t, h, w instead of running in three chunks
    moe: MoEConfig | None = None  # experts in place of some layers' MLP
    quant: QuantConfig | None = None  # the checkpoint's quantized linear layers (config/quant.py)
    rope_scaling: RopeScaling = RopeScaling()  # (Gemma 3: its global layers')
    # layers that see only their last `sliding_window` keys (Gemma 3's mostly, Qwen2's where configured); Gemma 3's
    # rotate with `local_rope_theta` unscaled, and its scores are scaled by `attention_scale`
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float = 10000.0
    attention_scale: float | None = None  # None: 1 / sqrt(head_dim)
    hidden_act: str = "silu"
    attention_sinks: bool = False  # GPT-OSS: a learned logit per head in each softmax's denominator


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    out_hidden_size: int
    tokens_per_second: float | None  # M-RoPE time index per second of video; None: one per temporal patch
    rope_theta: float
    hidden_act: str = "silu"
    norm_eps: float = 1e-6
    image_size: int = 0  # a fixed input side (CLIP); 0: any size (Qwen's dynamic resolution)
    patch_bias: bool = False  # the patch embedding's conv has a bias (Qwen3-VL)
    num_position_embeddings: int = 0  # learned positions, a square table resampled to each grid (Qwen3-VL); 0: none
    deepstack_indexes: tuple[int, ...] = ()  # blocks whose output also feeds the first decoder layers (Qwen3-VL)
    # InternViT: q/k/v biases (off in InternViT-300M), an RMSNorm over all of q's and k's heads (InternViT-6B's),
    # RMSNorm in place of LayerNorm (6B), a LayerNorm after the last layer (when it does not mean-pool)
    attention_bias: bool = True
    qk_norm: bool = False
    rms_norm: bool = False
    post_norm: bool = False
    projector_act: str = "gelu"  # LLaVA's projector_hidden_act and multimodal_projector_bias
    projector_bias: bool = True

    @property
    def output_width(self) -> int:
        """Values per image token the tower hands over: its embedding, then one DeepStack feature per entry of
        deepstack_indexes (what the encoder cache stores)."""
        return self.out_hidden_size * (1 + len(self.deepstack_indexes))

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x temporal x patch x patch (3*2*14*14 = 1176)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def frame_patch_dim(self) -> int:
        """Values in one patch of one frame (3*14*14 = 588): what a still image sends, see VisionPatchEmbed."""
        return self.in_channels * self.patch_size**2

    @property
    def window_merged(self) -> int:
        """Side of an attention window counted in merged tokens (112 px / 14 / 2 = 4)."""
        return self.window_size // self.patch_size // self.spatial_merge_size


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    text: TextConfig
    vision: VisionConfig
    tie_word_embeddings: bool
    torch_dtype: torch.dtype
    image_token_id: int
    video_token_id: int | None  # None: the model takes no videos
    vision_start_token_id: int | None
    vision_end_token_id: int | None
    eos_token_ids: tuple[int, ...]
    image: ImageProcessorConfig = ImageProcessorConfig()  # the checkpoint's preprocessing, as its family reads it
    mrope: bool = True  # position rule: M-RoPE (t, h, w) for vision tokens, or 1-D for every token
    # the family's video rule, where it takes videos
    video: VideoOptions | TimestampedVideoOptions | TiledVideoOptions = VideoOptions()
    # an image's tokens see each other both ways (Gemma 3): a prefill chunk holds an image whole, and the step
    # names each image's span to the attention backend
    bidirectional_images: bool = False
    # what a chat template writes for an image where that is not image_token_id (Gemma 3: <start_of_image>, which
    # becomes "\n\n<start_of_image>" + the image's tokens + "<end_of_image>\n\n", multimodal/prompt.py)
    image_placeholder_id: int | None = None
    # text tokens the prompt's expansion puts around each image's tokens (InternVL's <img> and </img>), where the
    # chat template writes the image token alone
    image_wrap: tuple[str, str] | None = None
    # text a prompt may write for an image in place of the image token (InternVL's own uploads: "<image>", as vLLM
    # takes it); each of a prompt's first ones, one per image, becomes the image token before tokenizing
    image_text: str | None = None
    # text a prompt writes for a video whose frames are images to the model (InternVL's "<video>"): each becomes
    # its frames' images, "Frame1: <image>" and so on (video_token_id is None for these)
    video_text: str | None = None

    @property
    def max_context(self) -> int:
        """The most positions a sequence may take, as vLLM derives it: the model's, extended by its RoPE
        scaling (Gemma 3's max_position_embeddings counts its scaling already)."""
        text = self.text
        if self.architecture.startswith("Gemma3"):
            return text.max_position_embeddings
        return text.rope_scaling.longest(text.max_position_embeddings)

    @classmethod
    def from_dir(cls, model_dir: str | Path, hf_overrides: dict | None = None) -> ModelConfig:
        """`hf_overrides`: keys laid over config.json's (vLLM's --hf-overrides)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory: no config.json")
        preprocessor = read_json(Path(model_dir) / "preprocessor_config.json")
        video = read_json(Path(model_dir) / "video_preprocessor_config.json")
        if video:  # newer checkpoints keep the video processor's settings apart (Qwen3-VL)
            preprocessor["video_preprocessor"] = video
        raw = with_overrides(json.loads(path.read_text()), hf_overrides or {})
        return cls.from_dict(raw, preprocessor, Path(model_dir))

    @classmethod
    def from_dict(cls, raw: dict, preprocessor: dict | None = None, model_dir: Path | None = None) -> ModelConfig:
        """`model_dir`: where fields config.json leaves null are looked up (the EOS tokens)."""
        from fovea.config.families import parse_model_config  # its parsers build these dataclasses

        return parse_model_config(raw, preprocessor or {}, model_dir)


def with_overrides(raw: dict, overrides: dict) -> dict:
    """config.json's keys with `overrides` laid over them as vLLM lays them over transformers' config: a
    sub-config (a key ending in _config, such as text_config) takes a dict's keys one by one, and a flat
    checkpoint's decoder keys are its text_config; any other key is replaced whole."""
    merged = dict(raw)
    for key, value in overrides.items():
        if isinstance(value, dict) and key.endswith("_config") and isinstance(raw.get(key) or {}, dict):
            merged[key] = with_overrides(raw.get(key) or {}, value)
        else:
            merged[key] = value
    return merged


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of auto, bfloat16, float16, float32") from None


def serving_dtype(checkpoint: torch.dtype, requested: str | torch.dtype, device_type: str) -> torch.dtype:
    """The dtype weights and activations run in: `requested`, or for auto the checkpoint's; an fp32 checkpoint
    serves in bf16 on a GPU (as published ones are), and fp16 runs as fp32 on the CPU (slow or missing there)."""
    dtype = checkpoint if requested == "auto" else resolve_dtype(requested)
    if requested == "auto" and device_type == "cuda" and dtype == torch.float32:
        return torch.bfloat16
    if device_type == "cpu" and dtype == torch.float16:
        return torch.float32
    return dtype


# what a model directory needs; not the .bin / .pt copies some repositories carry beside the safetensors
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def resolve_model_dir(model: str | Path | None, revision: str | None = None, download_dir: str | None = None) -> Path:
    """None -> the embedded demo model; a local directory; or a hub id: from the local Hugging Face cache (or
    `download_dir`), else downloaded unless HF_HUB_OFFLINE is set."""
    if model is None:
        from fovea.testing.tiny import demo_model_dir  # writing it needs tokenizers and safetensors

        return demo_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if str(model).count("/") != 1 or str(model).startswith((".", "/", "~")):
        raise FileNotFoundError(f"model {str(model)!r} is neither a local directory nor a hub id (org/name)")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = dict(repo_id=str(model), revision=revision, cache_dir=download_dir, allow_patterns=HUB_FILES)
    try:
        return Path(snapshot_download(**where, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    fetch = f"Fetch it with `hf download {model}` where a network is available, or pass a local model directory."
    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(
            f"{model!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set. " + fetch
        ) from None
    logger.info("downloading %s from %s", model, constants.ENDPOINT)
    try:
        return Path(snapshot_download(**where))
    except Exception as error:  # noqa: BLE001 - no network, unknown repository, gated model, ...
        raise FileNotFoundError(
            f"{model!r} could not be downloaded ({type(error).__name__}: {str(error).splitlines()[0][:300]}). {fetch}"
        ) from None
