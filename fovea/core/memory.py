"""A server's memory over days (issue 56; the figures are in benchmarks/README "Memory under mixed traffic"): glibc's
allocator set up for it, and an opt-in report of where Python allocations grow.

Left to its defaults, glibc gives threads that allocate at once arenas of their own (up to eight per core) and
raises its mmap threshold each time a large block is freed, up to 32 MB. Image traffic allocates and frees pixel
arrays of every size from several threads, so after a while those arrays come from arenas instead of mmap, and
the freed ones stay there in pieces that no later array fits: memory grows without any object being alive. Fixed
settings keep large blocks in mmap (given back when freed) and few arenas, trimmed sooner.

`fovea serve` applies them to its own process with mallopt and to every process it starts (the engine, the image
decoders, the template sandbox, tensor-parallel ranks) through the environment, which glibc reads at start. A
variable the user set wins; FOVEA_MALLOC=default leaves glibc's defaults everywhere. Ray actors on other hosts
start from their node's environment, not this one.

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

TOP_SITES = 15
# glibc's mallopt parameters (malloc.h) and the values this server runs with
SETTINGS = (
    ("MALLOC_ARENA_MAX", -8, 2),
    ("MALLOC_MMAP_THRESHOLD_", -3, 128 * 1024),
    ("MALLOC_TRIM_THRESHOLD_", -1, 256 * 1024),
)


def settle_allocator() -> list[str]:
    """Applies the settings to this process and its children-to-be; returns the ones applied (none off glibc)."""
    libc = _glibc()
    if os.environ.get("FOVEA_MALLOC") == "default" or libc is None:
        return []
    applied = []
    for variable, parameter, value in SETTINGS:
        if variable in os.environ:
            continue  # glibc read the user's value when this process started
        if libc.mallopt(parameter, value) == 1:  # returns 1 on success
            os.environ[variable] = str(value)
            applied.append(f"{variable}={value}")
    return applied


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only (musl and macOS lack it)
        return libc
    except (OSError, AttributeError):
        return None


def watch_memory(process: str) -> None:
    """In the front end and the engine: FOVEA_MALLOC_TRIM_S=SECONDS hands glibc's free pages back that often
    (malloc_trim); FOVEA_TRACEMALLOC=SECONDS traces and reports Python's allocations."""
    trim_s, libc = float(os.environ.get("FOVEA_MALLOC_TRIM_S") or 0), _glibc()
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
