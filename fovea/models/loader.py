"""Loading a model directory's safetensors weights into our model."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from fovea.config.model import ModelConfig, resolve_dtype, resolve_model_dir
from fovea.distributed import SINGLE, TPGroup, tensor_parallel
from fovea.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from fovea.layers.moe import Experts, expert_pieces
from fovea.models.base import ModelOptions, VisionLanguageModel
from fovea.models.registry import family

logger = logging.getLogger("fovea")


# what quantized layers store beside (or instead of) a weight (fovea/layers/quantized.py)
QUANTIZED_SUFFIXES = {"weight_scale", "weight_scale_inv", "input_scale", "qweight", "qzeros", "scales"}


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not fit the model its config describes."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return found


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _required_shards(module, name: str) -> list[set]:
    """Ways a parameter can be complete: loaded whole, or from all of its separate pieces."""
    if isinstance(module, Experts):
        return [{None}, expert_pieces(module, name)]
    if isinstance(module, QKVParallelLinear):
        return [{None}, {"q", "k", "v"}]
    if isinstance(module, MergedColumnParallelLinear):
        return [{None}, set(range(len(module.output_sizes)))]
    return [{None}]


def load_weights(model: VisionLanguageModel, model_dir: Path, only: str = "") -> None:
    """`only`: the parameters whose names start with it (the checkpoint's other tensors are skipped)."""
    params = {name: param for name, param in model.named_parameters() if name.startswith(only)}
    # buffers a checkpoint may set: a float8 KV cache's per-layer scales (1.0 where it has none)
    optional = {name: b for name, b in model.named_buffers() if name.endswith((".k_scale", ".v_scale"))}
    params.update(optional)
    loaded: dict[str, set] = {}
    unexpected = []
    for name, tensor in iter_checkpoint(model_dir):
        mapped = model.map_checkpoint_name(name)
        if mapped is None:
            continue
        pname, shard = mapped
        if not pname.startswith(only) or (pname.startswith("visual.") and model.visual is None):
            continue  # not asked for, or a tower that encoder workers hold
        param = params.get(pname)
        if param is None:
            unexpected.append(name)
            continue
        loader = getattr(param, "weight_loader", None)
        try:
            if loader is None:
                if param.numel() == tensor.numel() == 1:
                    tensor = tensor.reshape(param.shape)  # a scale stored as () or (1,)
                if param.shape != tensor.shape:
                    raise ValueError(f"checkpoint {tuple(tensor.shape)}, model expects {tuple(param.shape)}")
                param.data.copy_(tensor)
            else:
                loader(param, tensor, shard)  # copy_ converts the dtype of just this rank's slice
        except (ValueError, RuntimeError) as exc:
            raise CheckpointMismatchError(f"tensor {name} does not fit the model: {exc}") from None
        loaded.setdefault(pname, set()).add(shard)
    missing = []
    for pname in params:
        owner_name, _, own_name = pname.rpartition(".")
        if (
            loaded.get(pname) not in _required_shards(model.get_submodule(owner_name), own_name)
            and pname not in optional
        ):
            missing.append(pname)
    if missing or unexpected:

        def show(names: list[str]) -> str:
            return ", ".join(names[:12]) + (f" ... ({len(names)} in all)" if len(names) > 12 else "")

        parts = []
        if missing:
            parts.append(f"missing tensors (our parameter names): {show(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {show(unexpected)}")
            if any(name.rsplit(".", 1)[-1] in QUANTIZED_SUFFIXES for name in unexpected):
                parts.append(
                    "quantized tensors of a module fovea keeps in the model's dtype (the vision tower, the "
                    "embeddings and the LM head, as every published quantized checkpoint has them)"
                )
        raise CheckpointMismatchError(f"checkpoint {model_dir} does not fit its config: " + "; ".join(parts))


def load_model(
    model: str | Path | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    lm_tp: TPGroup = SINGLE,
    vision_tp: TPGroup = SINGLE,
    options: ModelOptions = ModelOptions(),
    config: ModelConfig | None = None,
) -> tuple[VisionLanguageModel, Path]:
    """Builds the model its config.json names (or `config`, the engine's, read once with its overrides), split
    over the tensor-parallel groups (this rank's slices), and loads the weights; returns (model, model_dir)."""
    model_dir = resolve_model_dir(model)
    config = config or ModelConfig.from_dir(model_dir)
    cls = family(config.architecture).Model
    torch_dtype = config.torch_dtype if dtype == "auto" else resolve_dtype(dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device), tensor_parallel(lm_tp):
            net = cls(config, options, vision_tp)
    finally:
        torch.set_default_dtype(previous)
    load_weights(net, model_dir)
    return net.eval(), model_dir


def load_tower(
    model: str | Path | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    options: ModelOptions = ModelOptions(),
    config: ModelConfig | None = None,
) -> tuple[torch.nn.Module, ModelConfig]:
    """The vision tower alone (its projector included), whole, its weights loaded: what an encoder worker runs.
    The rest of the model is not built: mapping the checkpoint's names takes the family's class and its config
    alone (a model built on the meta device instead computes its rotary tables there, through torch's
    decompositions: 2.5 s of imports in every worker)."""
    model_dir = resolve_model_dir(model)
    config = config or ModelConfig.from_dir(model_dir)
    cls = family(config.architecture).Model
    names = cls.__new__(cls)
    VisionLanguageModel.__init__(names, config, options)
    torch_dtype = config.torch_dtype if dtype == "auto" else resolve_dtype(dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device), tensor_parallel(SINGLE):
            names.visual = cls.make_tower(config, options)
    finally:
        torch.set_default_dtype(previous)
    load_weights(names, model_dir, only="visual.")
    return names.visual.eval(), config
