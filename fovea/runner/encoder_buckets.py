"""Encoder shape buckets (--mm-buckets): the vision tower only ever runs on a few patch counts.

One step's images are encoded together; their patches are padded up to the smallest bucket that holds them with
blank filler images (the tower's `filler_grids`: one image of grid 1 x 2 x pad/2 for a dynamic-resolution tower,
whole images for a fixed-size one) that are their own attention segments in every layer, so the real images'
embeddings do not change; the fillers' rows are dropped. A fixed-size encoder thus gets one bucket per image count.
Each bucket is warmed up at start-up and, on a GPU with our kernels, captured as a CUDA graph whose inputs
(pixels, and the tower's layout: window order, rotary positions, tile tables) live in static buffers. Steps with
more patches than the largest bucket run eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

logger = logging.getLogger("fovea")


class EncoderBuckets:
    def __init__(
        self, visual: torch.nn.Module, buckets: list[int], dtype: torch.dtype, device: torch.device, capture: bool
    ):
        self.visual, self.buckets, self.dtype, self.device, self.capture = visual, buckets, dtype, device, capture
        self.unit = visual.cfg.spatial_merge_size**2
        self.tile_rows = {}  # bucket -> rows of the kernel's tile tables (a fixed launch grid per bucket)
        if visual.use_kernel:
            from fovea.attention.triton_varlen import max_tiles

            self.tile_rows = {size: max_tiles(size, self.unit) for size in buckets}
        self.inputs: dict[int, tuple[torch.Tensor, dict]] = {}  # bucket -> the static buffers a graph reads
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None  # one memory pool for all buckets' graphs: replays never overlap, outputs are copied out

    def bucket(self, num_patches: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_patches)
        return self.buckets[i] if i < len(self.buckets) else None

    def warm_up(self) -> None:
        """Runs (and on a GPU captures) every bucket once, so no shape is compiled while serving."""
        for size in reversed(self.buckets):  # largest first, so the smaller graphs fit in its pool
            start = time.perf_counter()
            self.encode(torch.zeros(0, self.visual.cfg.frame_patch_dim, dtype=self.dtype, device=self.device), [], size)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            logger.info(
                "vision encoder bucket %d patches: %s in %.2f s",
                size,
                "captured" if size in self.graphs else "warmed up",
                time.perf_counter() - start,
            )

    @torch.inference_mode()
    def encode(self, patches: torch.Tensor, grids: list[tuple[int, int, int]], size: int) -> torch.Tensor:
        """Merged embeddings (num_patches / 4, hidden) of `grids` (patches on the device), computed at bucket
        `size`."""
        real = patches.shape[0]
        pad = size - real
        layout_grids = list(grids) + (self.visual.filler_grids(pad) if pad else [])
        layout = self.visual.layout(layout_grids, self.tile_rows.get(size))
        values = torch.zeros(size, patches.shape[1], dtype=self.dtype, device=self.device)
        values[:real] = patches
        if not (self.capture and self.visual.use_kernel):
            return self.visual.run(values, layout)[: real // self.unit]
        if size not in self.graphs:
            self._capture(size, values, layout)
        static_values, static_layout = self.inputs[size]
        static_values.copy_(values)
        for key, value in layout.items():  # index tensors, and attention metadata whose tile table is the input
            target = static_layout[key]
            (target if isinstance(target, torch.Tensor) else target.tiles).copy_(
                value if isinstance(value, torch.Tensor) else value.tiles
            )
        self.graphs[size].replay()
        return self.outputs[size][: real // self.unit].clone()

    def _capture(self, size: int, values: torch.Tensor, layout: dict) -> None:
        static = {key: value.to(self.device) for key, value in layout.items()}
        values = values.clone()
        self.visual.run(values, static)  # compiles the kernels before recording
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[size] = self.visual.run(values, static)
        self.inputs[size], self.graphs[size] = (values, static), graph
