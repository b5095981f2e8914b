"""Expected tensor-parallel communication per step, from the bytes moved (no GPU needed).

Each decoder layer all-reduces its hidden states twice (after o_proj and after down_proj), the vocab-parallel
embedding once per step, and the LM head all-gathers the logits of the sampled rows. A ring all-reduce of S bytes
moves 2 (N-1)/N x S through each GPU; its time is modelled as latency + that traffic / bus bandwidth. The two
link figures are assumptions to check against `nccl-tests all_reduce_perf` on the machine:
NVLink 4 (H100 SXM, 8 GPUs, NVSwitch) ~360 GB/s bus bandwidth for large messages, ~15 us latency for small ones.

    python benchmarks/allreduce_estimate.py
"""

from __future__ import annotations

MODELS = {  # hidden, layers, attention heads, KV heads, vocab (Qwen2.5-VL)
    "7B": (3584, 28, 28, 4, 152064),
    "72B": (8192, 80, 64, 8, 152064),
}
BUS_GBPS, LATENCY_US = 360.0, 15.0
TOKENS = {"decode x1": 1, "decode x64": 64, "decode x256": 256, "prefill 8192": 8192}


def step_cost_us(hidden: int, layers: int, vocab: int, size: int, tokens: int, sampled: int) -> tuple[float, float]:
    """(MB through each GPU, microseconds) for one step of `tokens` tokens with `sampled` logits rows."""
    reduce_bytes = tokens * hidden * 2  # bf16
    reduces = 2 * layers + 1
    ring = 2 * (size - 1) / size
    moved = reduces * ring * reduce_bytes + (size - 1) / size * sampled * vocab * 2  # + logits all-gather
    time_us = (reduces + 1) * LATENCY_US + moved / (BUS_GBPS * 1e3)
    return moved / 1e6, time_us


def main() -> None:
    print("| model | TP | step | MB per GPU | expected us | all-reduces |")
    print("|---|---|---|---|---|---|")
    for name, (hidden, layers, heads, kv, vocab) in MODELS.items():
        for size in (2, 4, 8):
            if heads % size:
                print(f"| {name} | {size} | - | - | not possible: {heads} heads do not divide | - |")
                continue
            for label, tokens in TOKENS.items():
                mb, us = step_cost_us(hidden, layers, vocab, size, tokens, min(tokens, 256))
                print(f"| {name} | {size} | {label} | {mb:.2f} | {us:.0f} | {2 * layers + 1} |")


if __name__ == "__main__":
    main()
