"""The engine's heap under image traffic, in-process (issue 56): rounds of chats with fresh images through the
offline `LLM`, and after each round glibc's live heap (mallinfo2: what is allocated and not freed) and the
resident memory once glibc has handed its free pages back (malloc_trim). Live memory that rises round after round
is something kept; resident memory that rises while the live heap does not is the allocator's.

    python benchmarks/offline_heap.py --rounds 16 [--images 60] [--kv-blocks 400]

The demo model, float32, no processor cache; images of 256x256 or 1280x720, random pixels, drawn from --seed.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import time

import numpy as np
import psutil
import torch
from PIL import Image

from fovea import LLM, SamplingParams


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--images", type=int, default=60, help="chats per round, one fresh image each")
    parser.add_argument("--kv-blocks", type=int, default=400, help="(the demo's default KV cache is 1 GB)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    llm = LLM(None, dtype="float32", mm_processor_cache_gb=0, num_gpu_blocks_override=args.kv_blocks)
    draw, process = random.Random(args.seed), psutil.Process()

    def image() -> Image.Image:
        width, height = draw.choice([(256, 256), (1280, 720)])
        pixels = np.random.default_rng(draw.randrange(1 << 30)).integers(0, 256, (height, width, 3), dtype=np.uint8)
        return Image.fromarray(pixels)

    print("round  seconds  live heap MB  glibc heap MB  RSS after trim MB")
    for round_index in range(args.rounds):
        chats = [
            [{"role": "user", "content": [{"type": "image_pil", "image_pil": image()}, {"type": "text", "text": "Hi"}]}]
            for _ in range(args.images)
        ]
        start = time.perf_counter()
        llm.chat(chats, SamplingParams(max_tokens=4), use_tqdm=False)
        seconds = time.perf_counter() - start
        del chats
        heap = libc.mallinfo2()
        libc.malloc_trim(0)
        rss = process.memory_info().rss
        print(f"{round_index:5d}  {seconds:7.1f}  {heap.uordblks >> 20:12d}  {heap.arena >> 20:13d}  {rss >> 20:17d}")


if __name__ == "__main__":
    main()
