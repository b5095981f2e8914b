"""One MoE layer's experts, grouped products against the per-expert loop (fovea/layers/moe.py), on the device
given: Qwen3-VL-30B-A3B's text experts (hidden 2048, 128 experts of width 768, 8 per token), random weights, a
router's choice of experts for 1, 16 and 256 tokens. Milliseconds per call, timed as `fovea bench kernels` times
(on CUDA triton's do_bench, the median; on the CPU one call after a warm-up).

    python benchmarks/moe_experts.py [--device cuda --dtype bfloat16] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess

import torch

from fovea.bench.kernels import timed_ms
from fovea.config.model import MoEConfig
from fovea.layers.moe import SparseMoE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", default="1,16,256")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    hidden, cfg = 2048, MoEConfig(num_experts=128, top_k=8, intermediate_size=768, sparse_layers=(0,))
    layer = SparseMoE(hidden, cfg)
    for param in layer.parameters():
        param.data.normal_(0, 0.02)
    layer = layer.to(device, dtype)
    rows = []
    for tokens in map(int, args.tokens.split(",")):
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        weights, chosen = torch.softmax(layer.gate(x), -1, dtype=torch.float).topk(cfg.top_k, -1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
        row = {"tokens": tokens}
        for name, call in (("loop_ms", layer.experts.per_expert), ("grouped_ms", layer.experts.forward)):
            row[name] = round(timed_ms(lambda call=call: call(x, chosen, weights)), 3)
        print(row, flush=True)
        rows.append(row)
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        result = {"commit": commit, "device": str(device), "dtype": args.dtype, "torch": torch.__version__}
        with open(args.out, "w") as out:
            json.dump({**result, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
