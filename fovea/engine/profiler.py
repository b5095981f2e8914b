"""vLLM's /start_profile and /stop_profile: the torch profiler over the engine process's steps, its trace written
where VLLM_TORCH_PROFILER_DIR (vLLM's variable; FOVEA_TORCH_PROFILER_DIR too) says, one gzipped Chrome/Perfetto
JSON file per profile (open it in https://ui.perfetto.dev). Unset, the server has no such routes."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger("fovea")
PROFILER_DIR_VARIABLES = ("VLLM_TORCH_PROFILER_DIR", "FOVEA_TORCH_PROFILER_DIR")


def profiler_dir() -> Path | None:
    found = next((os.environ[name] for name in PROFILER_DIR_VARIABLES if os.environ.get(name)), None)
    return None if found is None else Path(found)


class StepProfiler:
    def __init__(self, folder: Path):
        self.folder, self.running = folder, None

    def start(self) -> None:
        import torch

        if self.running is not None:
            return  # one at a time: a second start goes on with the first
        kinds = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            kinds.append(torch.profiler.ProfilerActivity.CUDA)
        self.running = torch.profiler.profile(activities=kinds, record_shapes=True, with_stack=True)
        self.running.start()
        logger.info("profiling the engine's steps (until /stop_profile)")

    def stop(self) -> Path | None:
        """Writes the trace; None when no profile ran."""
        if self.running is None:
            return None
        running, self.running = self.running, None
        running.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        # (nanoseconds too: two profiles of one process within a second would have had one name)
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**9:09d}"
        path = self.folder / f"engine-{os.getpid()}-{stamp}.pt.trace.json.gz"
        partial = path.with_name("." + path.name)  # (still .gz: torch gzips by the name) renamed once whole
        running.export_chrome_trace(str(partial))
        partial.replace(path)
        logger.info("profile written to %s", path)
        return path
