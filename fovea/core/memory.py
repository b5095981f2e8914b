"""A server's memory over days (issue 56; the figures are in benchmarks/README "Memory under mixed traffic"): glibc
asked to hand back the memory it keeps, and an opt-in report of where Python allocations grow.

glibc keeps what a process frees for its next allocations, and gives back only what lies at the top of a heap.
Image traffic allocates and frees pixel and activation arrays of every size from several threads, so the freed
memory sits between live blocks and stays resident: the front end and the engine grow by hundreds of MB with no
object alive. `malloc_trim` hands the free pages inside the heaps back to the kernel; every
FOVEA_MALLOC_TRIM_S seconds (10 by default, 0: never) the front end and the engine call it. Fixed allocator
settings (two arenas, mmap from 128 KB) kept memory as low but cost 28 % of image throughput (benchmarks/
allocator_cost.py); the trim costs none measurable.

FOVEA_TRACEMALLOC=SECONDS makes the front end and the engine trace Python's allocations (slower) and log, every
SECONDS, the sites whose memory grew most since the first report: what a soak run that grows should look at first.
Memory that torch or glibc hold for arrays is not Python's and does not show there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
import tracemalloc

logger = logging.getLogger("fovea")

TRIM_EVERY_S = 10.0
TOP_SITES = 15


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only (musl and macOS lack it)
        return libc
    except (OSError, AttributeError):
        return None


def watch_memory(process: str) -> None:
    """In the front end and the engine process, at start: the periodic trim, and the report if asked for."""
    trim_s, libc = float(os.environ.get("FOVEA_MALLOC_TRIM_S", TRIM_EVERY_S) or 0), _glibc()
    if trim_s > 0 and libc is not None:

        def trim() -> None:
            while True:
                time.sleep(trim_s)
                libc.malloc_trim(0)

        threading.Thread(target=trim, name="fovea-malloc-trim", daemon=True).start()
    interval = float(os.environ.get("FOVEA_TRACEMALLOC") or 0)
    if interval <= 0:
        return
    tracemalloc.start()

    def report() -> None:
        time.sleep(interval)
        first = tracemalloc.take_snapshot()
        while True:
            time.sleep(interval)
            growth = tracemalloc.take_snapshot().compare_to(first, "lineno")[:TOP_SITES]
            lines = [
                f"{stat.size_diff / 2**20:+.1f} MB in {stat.count_diff:+d} blocks at {stat.traceback}"
                for stat in growth
            ]
            logger.warning(
                "%s: Python allocations grown most since the first report:\n  %s", process, "\n  ".join(lines)
            )

    threading.Thread(target=report, name="fovea-tracemalloc", daemon=True).start()
