"""Quantized copies of a tiny dense checkpoint, in the published formats fovea loads (fovea/config/quant.py), each
written by its format's rule, with the dense checkpoint of exactly the dequantized weights beside it: what the
quantized model must compute.

The language model's projections (q, k, v, o, gate, up, down of every decoder layer) are quantized; the vision
tower, its projector, the embeddings and the LM head stay as they are, as in the published FP8, W8A8 and AWQ
checkpoints of every family (Qwen's own, llm-compressor's of Gemma 3 and LLaVA), and the ignore lists name them
in every family's layout:
- `fp8-block`: transformers' FineGrainedFP8 (Qwen's FP8 uploads): float8_e4m3fn weights, a float32
  `weight_scale_inv` per block (the factor that multiplies them back), scale = block max / 448;
- `fp8-tensor`: AutoFP8's form: one float32 `weight_scale` per tensor, no block size in the config;
- `int8-channel` and `fp8-channel`: llm-compressor's W8A8 and FP8_DYNAMIC schemes (compressed-tensors, format
  int-quantized / float-quantized): a `weight_scale` (rows, 1) per output channel, activations dynamic per token;
- `awq`: AutoAWQ's GEMM layout: per group of input features and output feature, scale = (max - min) / 15 and
  zero = round(-min / scale), q = round(w / scale) + zero in 0..15; eight 4-bit values to an int32, output
  feature AWQ_ORDER[i] in bits 4i..4i+3, for the values (`qweight`, input x output / 8) and the zeros (`qzeros`);
  `scales` in fp16.
Stacked MoE experts (Qwen3-VL-MoE's bf16 layout) are written one tensor per expert, as Qwen's FP8 MoE uploads are.
Published checkpoints use blocks of 128 x 128 and AWQ groups of 128; tiny models need smaller ones (`block`,
`group_size`), which the formats allow.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FORMATS = ("fp8-block", "fp8-tensor", "int8-channel", "fp8-channel", "awq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_MAX = 448.0  # float8_e4m3fn's largest value


TOWERS = ("visual", "vision_tower", "multi_modal_projector")  # the families' towers and projectors, any layout


def is_projection(name: str) -> bool:
    return ".layers." in name and not any(t in name for t in TOWERS) and name.rsplit(".", 2)[-2] in PROJECTIONS


def write_quantized_checkpoint(
    dense_dir: str | Path, out_dir: str | Path, fmt: str, block: tuple[int, int] = (16, 16), group_size: int = 16
) -> tuple[Path, Path]:
    """Writes `out_dir/quantized` (the format) and `out_dir/dequantized` (the same model, dense) from a tiny
    fp32 checkpoint; returns both directories."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {FORMATS}")
    dense_dir, out = Path(dense_dir), Path(out_dir)
    quantized_dir, reference_dir = out / "quantized", out / "dequantized"
    for target in (quantized_dir, reference_dir):
        shutil.copytree(dense_dir, target, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for file in sorted(dense_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    quantized, reference = {}, {}
    config = json.loads((quantized_dir / "config.json").read_text())
    hidden = config.get("text_config", config)["hidden_size"]
    for name, tensor in tensors.items():
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):  # Qwen3-VL-MoE's stacked experts
            parts, reference[name] = quantize_experts(name, tensor, hidden, fmt, block, group_size)
            quantized.update(parts)
            continue
        if not (name.endswith(".weight") and is_projection(name)):
            quantized[name] = reference[name] = tensor
            continue
        stem = name.removesuffix(".weight")
        parts, dequantized = quantize(tensor.float(), fmt, block, group_size)
        quantized.update({f"{stem}.{key}": value.contiguous() for key, value in parts.items()})
        reference[name] = dequantized.to(tensor.dtype).contiguous()
    save_file(quantized, quantized_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(reference, reference_dir / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = quantization_config(fmt, block, group_size)
    (quantized_dir / "config.json").write_text(json.dumps(config, indent=2))
    return quantized_dir, reference_dir


def quantize_experts(name: str, stacked: torch.Tensor, hidden: int, fmt: str, block, group_size: int):
    """Stacked experts (E, 2 x inter, hidden) gate|up or (E, hidden, inter) down, either orientation (a square one
    as transformers 5 writes it), quantized one expert's matrix at a time under Qwen3-MoE's per-expert names, as
    Qwen's FP8 MoE uploads store them: (checkpoint tensors, the dequantized stack as it was stored)."""
    stem, kind = name.rsplit(".", 1)
    flipped = stacked.shape[2 if kind == "gate_up_proj" else 1] != hidden
    ours = stacked.transpose(1, 2) if flipped else stacked
    tensors, experts = {}, []
    for expert, matrix in enumerate(ours.float()):
        pieces = matrix.chunk(2) if kind == "gate_up_proj" else (matrix,)
        names = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
        dequantized = []
        for piece, weight in zip(names, pieces):
            parts, restored = quantize(weight, fmt, block, group_size)
            tensors.update({f"{stem}.{expert}.{piece}.{key}": value.contiguous() for key, value in parts.items()})
            dequantized.append(restored)
        experts.append(torch.cat(dequantized))
    restacked = torch.stack(experts).to(stacked.dtype)
    return tensors, (restacked.transpose(1, 2) if flipped else restacked).contiguous()


def quantize(weight: torch.Tensor, fmt: str, block: tuple[int, int], group_size: int):
    """(checkpoint tensors, the dequantized weight) of one (output, input) weight."""
    if fmt == "fp8-block":
        rows, cols = block
        out_blocks, in_blocks = -(-weight.shape[0] // rows), -(-weight.shape[1] // cols)
        padded = torch.zeros(out_blocks * rows, in_blocks * cols)
        padded[: weight.shape[0], : weight.shape[1]] = weight
        tiles = padded.reshape(out_blocks, rows, in_blocks, cols)
        scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
        values = (tiles / scale[:, None, :, None]).reshape_as(padded)[: weight.shape[0], : weight.shape[1]]
        values = values.to(torch.float8_e4m3fn)
        per_element = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: weight.shape[0], : weight.shape[1]]
        return {"weight": values, "weight_scale_inv": scale}, values.float() * per_element
    if fmt in ("fp8-tensor", "fp8-channel"):
        amax = weight.abs().amax() if fmt == "fp8-tensor" else weight.abs().amax(dim=1, keepdim=True)
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        values = (weight / scale).to(torch.float8_e4m3fn)
        return {
            "weight": values,
            "weight_scale": scale.reshape(-1) if fmt == "fp8-tensor" else scale,
        }, values.float() * scale
    if fmt == "int8-channel":
        scale = (weight.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
        values = (weight / scale).round().clamp(-128, 127).to(torch.int8)
        return {"weight": values, "weight_scale": scale}, values.float() * scale
    return awq(weight, group_size)


def awq(weight: torch.Tensor, group_size: int):
    columns = weight.t().contiguous()  # (input, output), as AWQ stores it
    inputs, outputs = columns.shape
    groups = columns.reshape(inputs // group_size, group_size, outputs)
    low, high = groups.amin(dim=1), groups.amax(dim=1)
    scale = ((high - low) / 15).clamp(min=1e-5).half().float()  # as stored: fp16
    zero = (-low / scale).round().clamp(0, 15)
    values = ((groups / scale[:, None]).round() + zero[:, None]).clamp(0, 15).reshape(inputs, outputs)
    dequantized = (values.reshape_as(groups) - zero[:, None]) * scale[:, None]
    tensors = {"qweight": pack(values), "qzeros": pack(zero), "scales": scale.half()}
    return tensors, dequantized.reshape(inputs, outputs).t()


def pack(values: torch.Tensor) -> torch.Tensor:
    """(rows, 8 x columns) values 0..15 -> (rows, columns) int32, eight to a word in AutoAWQ's order."""
    nibbles = values.to(torch.int64).numpy().astype(np.uint32).reshape(values.shape[0], -1, 8)
    words = np.zeros(nibbles.shape[:2], dtype=np.uint32)
    for i, column in enumerate(AWQ_ORDER):
        words |= nibbles[:, :, column] << np.uint32(4 * i)
    return torch.from_numpy(words.view(np.int32))


def quantization_config(fmt: str, block: tuple[int, int], group_size: int) -> dict:
    if fmt == "fp8-block":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(block),
            "modules_to_not_convert": [*TOWERS, "lm_head"],
        }
    if fmt == "fp8-tensor":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": [*TOWERS, "lm_head"]}
    if fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": list(TOWERS),
        }
    kind = "int" if fmt == "int8-channel" else "float"
    scheme = {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": False, "strategy": "channel"}
    activations = {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": True, "strategy": "token"}
    return {
        "quant_method": "compressed-tensors",
        "format": f"{kind}-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme, "input_activations": activations}},
        "ignore": ["lm_head", *(f"re:.*{tower}.*" for tower in TOWERS)],
        "kv_cache_scheme": None,
    }
