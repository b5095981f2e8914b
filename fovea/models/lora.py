"""PEFT LoRA adapter directories (adapter_config.json + adapter_model.safetensors) read into a model's layers.

An adapter's tensor `base_model.model.<module>.lora_A.weight` belongs to the checkpoint module `<module>`: the
model maps that name as it maps its own checkpoint's (`map_checkpoint_name`, both transformers layouts), onto one
of our linear layers and, for fused layers, the piece (q, k, v, gate, up). `plan_adapter` checks an adapter against
a model without reading its weights: the front end runs it on a model built on the meta device, so that a bad
adapter is a clear error before anything reaches the engine. `load_adapter` reads the weights for one rank: its
share of A's inputs (row-parallel layers) or of B's outputs (column-parallel ones), scaling folded into B.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from torch import nn

from fovea.config.model import ModelConfig
from fovea.core.request import LoRARequest
from fovea.layers.linear import ColumnParallelLinear, LinearBase, QKVParallelLinear, RowParallelLinear
from fovea.layers.lora import LoRAWeights
from fovea.models.base import ModelOptions
from fovea.models.registry import family

ADAPTER_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<kind>[AB])(?:\.[^.]+)?\.weight$")
# adapter_config.json settings that change what the adapter computes, which fovea does not implement
UNSUPPORTED = {
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save (whole trained copies of modules)",
    "alpha_pattern": "alpha_pattern",
    "target_parameters": "target_parameters",
    "trainable_token_indices": "trainable_token_indices",
    "use_qalora": "QALoRA",
}


class LoRAError(ValueError):
    """An adapter that cannot be served: the message names the adapter and what is wrong."""


# one piece of a layer's adapter: (shard id, A tensor name, B tensor name, scaling)
Piece = tuple[object, str, str, float]


MAX_ALPHA = 1e4  # lora_alpha; released adapters use 8 to 512
MAX_WEIGHT = 1e4  # |A| and |B x scaling|: trained LoRA weights are small, and the logits must stay finite


@dataclass
class AdapterFiles:
    """An adapter directory read once: its settings, its tensors, and a digest of the bytes they came from (the
    engine loads only bytes with the digest the front end checked: a file replaced since is refused)."""

    config: dict
    tensors: dict[str, torch.Tensor]
    digest: str


def read_adapter(path: Path) -> AdapterFiles:
    settings, file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not settings.is_file():
        raise LoRAError(f"{path} is not a PEFT adapter directory: it has no adapter_config.json")
    if not file.is_file():
        found = (
            "adapter_model.bin (a pickle, which fovea does not load)" if (path / "adapter_model.bin").is_file() else ""
        )
        raise LoRAError(f"no adapter_model.safetensors in {path}" + (f"; it has {found}" if found else ""))
    raw_config, raw_weights = settings.read_bytes(), file.read_bytes()
    digest = hashlib.sha256(raw_config + b"\0" + raw_weights).hexdigest()
    try:
        tensors = safetensors.torch.load(raw_weights)
    except Exception as error:  # noqa: BLE001 - the library's parse errors have no common type
        raise LoRAError(f"adapter {path}: adapter_model.safetensors does not parse ({type(error).__name__})") from None
    return AdapterFiles(adapter_settings(raw_config, path), tensors, digest)


def adapter_settings(raw: bytes, path: Path) -> dict:
    """adapter_config.json, with the settings fovea reads checked for type and range."""
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError):
        raise LoRAError(f"adapter {path}: adapter_config.json is not JSON") from None
    if not isinstance(config, dict):
        raise LoRAError(f"adapter {path}: adapter_config.json must hold an object, not {type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"adapter {path} is a {str(config['peft_type'])[:40]} adapter; fovea serves LoRA adapters")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise LoRAError(f"adapter {path} uses {what}, which fovea does not support")
    if config.get("bias", "none") != "none":
        raise LoRAError(
            f"adapter {path} trains biases (bias={str(config['bias'])[:40]!r}), which fovea does not support"
        )
    alpha = config.setdefault("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= MAX_ALPHA:
        raise LoRAError(f"adapter {path}: lora_alpha must be a number in (0, {MAX_ALPHA:g}]")
    if not isinstance(config.setdefault("use_rslora", False), bool):
        raise LoRAError(f"adapter {path}: use_rslora must be true or false")
    return config


def plan_adapter(
    model: nn.Module, path: Path, adapter: AdapterFiles, max_rank: int, whole: bool = True, values: bool = True
):
    """The model's layers the adapter changes, with its tensors for each: {layer: [Piece]}. `whole`: the layers
    are whole (the front end's meta model), and every shape is checked against them; a rank's layers hold
    slices. `values`: read every weight's range (not again for bytes the front end checked)."""
    config = adapter.config
    alpha, rslora = config["lora_alpha"], config["use_rslora"]
    modules: dict[str, dict[str, str]] = {}
    for name in adapter.tensors:
        match = ADAPTER_KEY.match(name)
        if match is None:
            raise LoRAError(f"adapter {path}: tensor {name[:200]} is not a LoRA A or B matrix (embedding adapters and "
                            "trained copies of modules are not supported)")  # fmt: skip
        modules.setdefault(match["module"], {})[match["kind"]] = name
    plan: dict[LinearBase, list[Piece]] = {}
    unused = 0  # modules the model never runs
    for module, pair in modules.items():
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"adapter {path}: {module} has lora_{''.join(pair)} without its other half")
        found = find_layer(model, module, path)
        if found is None:
            unused += 1
            continue
        layer, shard = found
        a, b = (adapter.tensors[pair[kind]] for kind in "AB")
        outputs = layer.output_size if shard is None else layer.output_piece(shard)[1]
        shapes_fit = a.dim() == 2 and b.dim() == 2 and a.shape[0] == b.shape[1] >= 1
        if not shapes_fit or whole and (a.shape[1], b.shape[0]) != (layer.input_size, outputs):
            raise LoRAError(
                f"adapter {path}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; the model's layer needs A "
                f"(rank, {layer.input_size}) and B ({outputs}, rank), rank at least 1"
            )
        rank = a.shape[0]
        if rank > max_rank:
            raise LoRAError(f"adapter {path} has rank {rank}, more than max_lora_rank {max_rank} (--max-lora-rank)")
        scaling = alpha / (rank**0.5 if rslora else rank)
        for tensor, factor, kind in ((a, 1.0, "A"), (b, scaling, "B")) if values else ():
            if not tensor.is_floating_point():
                raise LoRAError(f"adapter {path}: {module}'s lora_{kind} holds {tensor.dtype}, not floating point")
            largest = float(tensor.float().abs().max()) * factor
            if not largest <= MAX_WEIGHT:  # NaN too
                raise LoRAError(f"adapter {path}: {module}'s lora_{kind} (scaled) holds values beyond {MAX_WEIGHT:g}")
        plan.setdefault(layer, []).append((shard, pair["A"], pair["B"], scaling))
    if not plan:
        runs = f" for modules this model runs ({unused} of its modules it never runs)" if unused else ""
        raise LoRAError(f"adapter {path} holds no LoRA tensors{runs}")
    return plan


def find_layer(model: nn.Module, module: str, path: Path) -> tuple[LinearBase, object] | None:
    """Our linear layer (and piece of it) that the adapter's checkpoint module name stands for; None for a module
    the model never runs (a tower layer past the one its features come from: PEFT adapts it, to no effect)."""
    if model.rename(module + ".weight") is None:
        return None
    mapped = model.map_checkpoint_name(module + ".weight")
    if mapped is None:  # a head tied to the embeddings
        raise LoRAError(f"adapter {path} changes {module}: LoRA there is not supported")
    try:
        layer = model.get_submodule(mapped[0].removesuffix(".weight"))
    except AttributeError:
        raise LoRAError(f"adapter {path} changes {module}, which this model does not have") from None
    if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
        raise LoRAError(f"adapter {path} changes {module} ({type(layer).__name__}): LoRA there is not supported")
    return layer, mapped[1]


def load_adapter(model: nn.Module, lora: LoRARequest, max_rank: int, dtype, device) -> LoRAWeights:
    """The adapter's pairs for this rank's layers: one (A, B) per layer, its pieces stacked (see layers/lora.py).
    Only the bytes the front end checked (`lora.digest`) are loaded."""
    path = Path(lora.lora_path)
    adapter = read_adapter(path)
    if lora.digest and adapter.digest != lora.digest:
        raise LoRAError(f"adapter {lora.lora_name!r}: its files at {path} changed since it was loaded; load it again")
    plan = plan_adapter(model, path, adapter, max_rank, whole=False, values=not lora.digest)  # checked whole
    weights = LoRAWeights(lora.lora_name)
    for layer, pieces in plan.items():
        a_parts, b_parts = [], []  # B's parts: (offset in our outputs, rows) per rank block of A
        for shard, a_name, b_name, scaling in pieces:
            a, b = adapter.tensors[a_name].float(), adapter.tensors[b_name].float() * scaling
            share = layer.input_share()
            a_parts.append(a if share is None else a[:, share[0] : share[0] + share[1]])
            whole = isinstance(layer, QKVParallelLinear) and shard is None
            outs = layer.split_fused(b).items() if whole else [(shard, b)]
            rows = []
            for sid, part in outs:
                offset, size, start = layer.output_piece(sid)
                rows.append((offset, part[start : start + size]))
            b_parts.append(rows)
        stacked_a = torch.cat(a_parts)
        stacked_b = torch.zeros(layer.output_size, stacked_a.shape[0])
        column = 0
        for a, rows in zip(a_parts, b_parts):
            for offset, part in rows:
                stacked_b[offset : offset + part.shape[0], column : column + a.shape[0]] = part
            column += a.shape[0]
        weights.pairs[layer] = (stacked_a.to(device, dtype), stacked_b.to(device, dtype))
    return weights


def changes_vision(model: nn.Module, plan: dict) -> bool:
    return any(module in plan for module in model.visual.modules())


class AdapterCheck:
    """The front end's check of an adapter before any request of it is sent: `plan_adapter` on the model built
    on the meta device (no memory, whole layers), once per adapter. Says whether it changes the vision tower."""

    def __init__(self, model_config: ModelConfig, max_rank: int):
        self.model_config, self.max_rank = model_config, max_rank
        self._model: nn.Module | None = None
        self._checked: dict[tuple[int, str], tuple[LoRARequest, bool]] = {}
        self._lock = threading.Lock()  # the preparation pool's threads

    def __call__(self, lora: LoRARequest) -> tuple[LoRARequest, bool]:
        """The adapter as the engine is to load it (with the digest of the bytes checked), and whether it changes
        the vision tower."""
        key = (lora.lora_int_id, lora.lora_path)
        with self._lock:
            if key not in self._checked:
                if self._model is None:
                    with torch.device("meta"):
                        self._model = family(self.model_config.architecture).Model(self.model_config, ModelOptions())
                path = Path(lora.lora_path)
                adapter = read_adapter(path)
                plan = plan_adapter(self._model, path, adapter, self.max_rank)
                self._checked[key] = dataclasses.replace(lora, digest=adapter.digest), changes_vision(self._model, plan)
            return self._checked[key]


class LoadedAdapters:
    """The adapters a rank holds, least recently used dropped beyond `capacity` (vLLM's max_cpu_loras). A step or
    an encoder job that took an adapter keeps its weights alive until it is done, dropped or not."""

    def __init__(self, model: nn.Module, capacity: int, max_rank: int, dtype, device):
        self.model, self.capacity, self.max_rank, self.dtype, self.device = model, capacity, max_rank, dtype, device
        self._held: OrderedDict[int, LoRAWeights] = OrderedDict()
        self._lock = threading.Lock()  # the engine's step and the image encoder's thread both take adapters

    def get(self, lora: LoRARequest) -> LoRAWeights:
        with self._lock:
            weights = self._held.get(lora.lora_int_id)
            if weights is None:
                weights = load_adapter(self.model, lora, self.max_rank, self.dtype, self.device)
                self._held[lora.lora_int_id] = weights
                while len(self._held) > self.capacity:
                    self._held.popitem(last=False)
            self._held.move_to_end(lora.lora_int_id)
            return weights

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._held

    def drop(self, lora_int_id: int) -> None:
        with self._lock:
            self._held.pop(lora_int_id, None)
