"""The hardware floor of a serving workload: the time no engine can beat on a GPU of measured speeds.

Prefill and the vision tower are compute-bound: their FLOPs (matrix products + attention) divided by the
measured bf16 matmul rate. A decode step is bound by the larger of its FLOPs over that rate and the bytes it must
read (every language-model weight once, plus the KV cache of every sequence in the batch) over the measured copy
bandwidth. A workload is all prompts prefilled, then decoded in waves of at most max_num_seqs sequences; the
floor adds the phases (a real engine overlaps some prefill with decode, so this is a bound only up to that).
"""

from __future__ import annotations

from dataclasses import dataclass

from fovea.config.model import ModelConfig


@dataclass
class Hardware:
    matmul_flops: float  # FLOP/s of a large bf16 matrix product
    bandwidth: float  # bytes/s a device-to-device copy moves (read + written)


def lm_matmul_params(config: ModelConfig) -> tuple[int, int]:
    """(per-token matrix-product parameters of the decoder layers, of the LM head)."""
    t = config.text
    q, kv = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
    layer = t.hidden_size * (q + 2 * kv) + q * t.hidden_size + 3 * t.hidden_size * t.intermediate_size
    return t.num_layers * layer, t.hidden_size * t.vocab_size


def vision_flops(config: ModelConfig, patches: int) -> float:
    """One image of `patches` patches through the vision tower (8x8-patch windows, full attention elsewhere)."""
    v = config.vision
    e, blocks = v.hidden_size, v.depth
    per_patch = v.frame_patch_dim * e + blocks * (4 * e * e + 3 * e * v.intermediate_size)  # a still image: 1 frame
    per_patch += (4 * e * 4 * e + 4 * e * v.out_hidden_size) / 4  # merger, per merged group of 4
    full = len(v.fullatt_block_indexes)
    attention = 4 * e * patches * (full * patches + (blocks - full) * 64)
    return 2 * per_patch * patches + attention


def decode_step_bytes(config: ModelConfig, batch: int, mean_context: float, dtype_bytes: int = 2) -> float:
    layers, lm_head = lm_matmul_params(config)
    t = config.text
    kv_per_token = 2 * t.num_layers * t.num_kv_heads * t.head_dim * dtype_bytes
    return (layers + lm_head) * dtype_bytes + batch * mean_context * kv_per_token


def workload_floor(
    config: ModelConfig,
    hw: Hardware,
    input_len: int,
    output_len: int,
    num_prompts: int,
    max_num_seqs: int = 256,
    image_patches: int = 0,
    dtype_bytes: int = 2,
) -> dict[str, float]:
    """Seconds: prefill (+ images), decode, total; and the mean decode-step floor (the TPOT floor) in ms.
    input_len counts every prompt token, image tokens included."""
    layers, lm_head = lm_matmul_params(config)
    t = config.text
    attn_width = t.num_heads * t.head_dim
    prefill = num_prompts * (
        2 * layers * input_len + 2 * lm_head + 4 * t.num_layers * attn_width * input_len * input_len / 2
    )
    if image_patches:
        prefill += num_prompts * vision_flops(config, image_patches)
    prefill_s = prefill / hw.matmul_flops
    decode_s, steps = 0.0, 0
    remaining = num_prompts
    while remaining > 0:
        batch = min(remaining, max_num_seqs)
        for i in range(1, output_len):  # the prefill step samples the first token
            context = input_len + i
            flops = batch * (2 * (layers + lm_head) + 4 * t.num_layers * attn_width * context)
            decode_s += max(
                flops / hw.matmul_flops, decode_step_bytes(config, batch, context, dtype_bytes) / hw.bandwidth
            )
            steps += 1
        remaining -= batch
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": prefill_s + decode_s,
        "tpot_floor_ms": 1000 * decode_s / max(steps, 1),
    }
