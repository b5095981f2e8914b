"""Quantized checkpoints: what config.json's `quantization_config` says, read once into a `QuantConfig` that the
language model's linear layers are built with (fovea/layers/quantized.py), as vLLM detects the method from it.

Three checkpoint formats, one weight layout each:
- `fp8` (transformers' FineGrainedFP8, Qwen's official FP8 uploads): float8_e4m3fn weights with a float32
  `weight_scale_inv` per block of `weight_block_size` (rows, columns); without a block size (AutoFP8's older form),
  one `weight_scale` per tensor. Activation scales are dynamic.
- `compressed-tensors` (llm-compressor): int8 or float8 weights with a `weight_scale` per output channel, per
  tensor or per block; activations dynamic per token (int8 w8a8, fp8), or none (weight-only).
- `awq` (AutoAWQ's GEMM packing): int4 weights, 8 to an int32 `qweight` (input, output / 8), a `qzeros` packed the
  same way and `scales` per group of `group_size` input features; w = (q - zero) x scale.

Weights dequantize exactly: w = q x scale (minus the zero point for AWQ). The vision tower, the embeddings and the
LM head stay in the checkpoint's dtype (every published checkpoint leaves them unquantized); a checkpoint that
quantized them fails to load, naming the tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class QuantConfig:
    method: str  # fp8, int8 or awq: the stored weight type
    source: str  # the checkpoint's quant_method, for messages (fp8, compressed-tensors, awq)
    # scales: one per block (rows, columns), per output channel, or per tensor; awq: per group of input features
    block: tuple[int, int] | None = None
    per_tensor: bool = False
    group_size: int = 0
    scale_name: str = "weight_scale"  # transformers' fp8 checkpoints store the reciprocal's name: weight_scale_inv
    activations: str | None = None  # int8 or fp8: activations quantized per token on the fly (w8a8); None: as is
    ignore: tuple[str, ...] = ()  # module names or patterns ("re:" regexes) left unquantized
    ignore_substrings: bool = False  # HF's modules_to_not_convert: any name containing an entry

    def skips(self, module_names: list[str]) -> bool:
        """Whether a module (known by each name its checkpoint may give it) stays unquantized."""
        for entry in self.ignore:
            for name in module_names:
                if entry.startswith("re:"):
                    if re.match(entry[3:], name):
                        return True
                elif name == entry or (self.ignore_substrings and entry in name):
                    return True
        return False


def decoder_module_names(layer_index: int, module: str) -> list[str]:
    """The names a decoder layer's module has in the checkpoints fovea reads: the published Qwen layout,
    transformers 5's and LLaVA's."""
    tail = f"layers.{layer_index}.{module}"
    return [f"model.{tail}", f"model.language_model.{tail}", f"language_model.model.{tail}"]


def layer_quant(quant: QuantConfig | None, layer_index: int, modules: tuple[str, ...]) -> QuantConfig | None:
    """What a decoder layer's module (fused from `modules`, e.g. q, k and v) is built with: None where the
    checkpoint left it unquantized. The fused pieces must agree."""
    if quant is None:
        return None
    skipped = {quant.skips(decoder_module_names(layer_index, module)) for module in modules}
    if len(skipped) > 1:
        raise ValueError(
            f"decoder layer {layer_index}: {', '.join(modules)} run as one matmul here, but the checkpoint "
            "quantizes only some of them"
        )
    return None if skipped.pop() else quant


def parse_quant_config(raw: dict | None) -> QuantConfig | None:
    """config.json's quantization_config -> QuantConfig (None: not quantized); a format fovea does not run raises
    ValueError naming what it has."""
    if not raw:
        return None
    source = raw.get("quant_method")
    if source == "fp8":
        return _hf_fp8(raw)
    if source == "compressed-tensors":
        return _compressed_tensors(raw)
    if source in ("awq", "awq_marlin"):
        return _awq(raw)
    raise ValueError(f"quantization {source!r} is not supported; fovea loads fp8, compressed-tensors and awq")


def _hf_fp8(raw: dict) -> QuantConfig:
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError("fp8 checkpoints with static activation scales are not supported (dynamic only)")
    ignore = tuple(raw.get("modules_to_not_convert") or raw.get("ignored_layers") or ())
    block = raw.get("weight_block_size")
    if block is None:  # AutoFP8's form: one scale per tensor
        return QuantConfig("fp8", "fp8", per_tensor=True, ignore=ignore, ignore_substrings=True)
    return QuantConfig(
        "fp8", "fp8", block=_pair(block), scale_name="weight_scale_inv", ignore=ignore, ignore_substrings=True
    )


def _compressed_tensors(raw: dict) -> QuantConfig:
    groups = list((raw.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors with {len(groups)} config groups is not supported (one group only)")
    weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations")
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    what = f"compressed-tensors {kind} {bits}-bit weights by {strategy}"
    if bits != 8 or kind not in ("int", "float") or strategy not in ("tensor", "channel", "block"):
        raise ValueError(f"{what} are not supported: 8-bit int or float weights per tensor, channel or block")
    if not weights.get("symmetric", True) or weights.get("dynamic", False):
        raise ValueError(f"{what}: asymmetric or dynamic weight scales are not supported")
    if inputs and not inputs.get("dynamic", False):
        raise ValueError(f"{what}: static activation scales are not supported (dynamic per token only)")
    if "Linear" not in (groups[0].get("targets") or []):
        raise ValueError(f"{what}: the config group must target Linear layers, got {groups[0].get('targets')}")
    block = _pair(weights["block_structure"]) if strategy == "block" else None
    method = "fp8" if kind == "float" else "int8"
    activations = None
    if inputs:
        if inputs.get("num_bits") != 8 or inputs.get("strategy") != "token" or not inputs.get("symmetric", True):
            raise ValueError(f"{what}: activations must be 8-bit, symmetric and per token, got {inputs}")
        activations = "fp8" if inputs.get("type") == "float" else "int8"
    ignore = tuple(raw.get("ignore") or ())
    return QuantConfig(
        method, "compressed-tensors", block, strategy == "tensor", ignore=ignore, activations=activations
    )


def _awq(raw: dict) -> QuantConfig:
    bits, group, version = (
        raw.get("bits", raw.get("w_bit")),
        raw.get("group_size", raw.get("q_group_size")),
        raw.get("version", "gemm"),
    )
    if bits != 4 or not raw.get("zero_point", True) or str(version).lower() != "gemm":
        raise ValueError(
            f"awq with {bits}-bit weights, zero_point {raw.get('zero_point')}, version {version}: only 4-bit GEMM with zero points is supported"
        )
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"awq needs a positive group_size (-1, whole columns, is not supported), got {group}")
    ignore = tuple(raw.get("modules_to_not_convert") or ())
    return QuantConfig("awq", "awq", group_size=group, ignore=ignore, ignore_substrings=True)


def _pair(value) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise ValueError(f"a weight block size must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def check_flag(quantization: str | None, quant: QuantConfig | None) -> None:
    """--quantization (optional, as in vLLM) must name the checkpoint's own method."""
    if quantization is None:
        return
    if quant is None:
        raise ValueError(f"quantization={quantization!r}, but the checkpoint is not quantized (no quantization_config)")
    accepted = {quant.source, quant.method} | ({"awq_marlin"} if quant.method == "awq" else set())
    if quantization not in accepted:
        raise ValueError(
            f"quantization={quantization!r} does not match the checkpoint's {quant.source} ({quant.method}) weights"
        )
