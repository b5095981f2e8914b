"""Engine settings, resolved once from the user's arguments and the checkpoint, then passed down."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from fovea.config import ModelConfig, resolve_dtype


@dataclass
class EngineConfig:
    model_dir: Path
    model: ModelConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    enable_prefix_caching: bool = True
    encoder_cache_size: int = 0  # embedding rows; 0 = the largest image plus one step's budget
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    mm_processor_kwargs: dict | None = None
    seed: int = 0
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # overrides the gpu_memory_utilization sizing
    num_gpu_blocks_override: int | None = None

    @property
    def encoder_budget(self) -> int:
        """Image tokens the vision encoder may take per step (at least one whole image always runs)."""
        return self.max_num_batched_tokens

    @classmethod
    def build(cls, model_dir: Path, dtype: str | torch.dtype = "auto", device: str = "auto",
              max_model_len: int | None = None, max_image_tokens: int = 0, **options) -> "EngineConfig":
        model = ModelConfig.from_dir(model_dir)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        torch_dtype = model.torch_dtype if dtype == "auto" else resolve_dtype(dtype)
        if torch.device(device).type == "cpu" and torch_dtype == torch.float16:
            torch_dtype = torch.float32  # fp16 matmuls are slow or missing on CPU
        limit = model.text.max_position_embeddings
        if max_model_len is None:
            max_model_len = limit
        elif max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}")
        config = cls(model_dir=Path(model_dir), model=model, dtype=torch_dtype, device=torch.device(device),
                     max_model_len=max_model_len, **options)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(config, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(config, name)}")
        if not config.encoder_cache_size:
            config.encoder_cache_size = max_image_tokens + config.max_num_batched_tokens
        return config
