"""A server's memory over days (issue 56; the figures are in benchmarks/README "Memory under mixed traffic"): glibc
asked to hand back the memory it keeps, and an opt-in report of where Python allocations grow.

glibc keeps what a process frees for its next allocations, and gives back only what lies at the top of a heap.
Image traffic allocates and frees pixel and activation arrays of every size from several threads, so the freed
memory sits between live blocks and stays resident: the front end and the engine grow by hundreds of MB with no
object alive. `malloc_trim` hands the free pages inside the heaps back to the kernel. A thread of the front end
and of the engine calls it every FOVEA_MALLOC_TRIM_S seconds (10 by default; 0: never), and sooner when the
process's resident memory has risen FOVEA_MALLOC_TRIM_MB (32 by default; 0: no sooner) above its lowest since the
last trim, which it reads every second: a busy CPU engine frees tens of MB a second, and between trims 10 s apart
its memory swung by ~200 MB. The clock stays for what a burst leaves: once it is over, memory no longer rises. A
trim holds each heap's lock while it runs (~10 ms under load), so it is not simply run every second. The same
thread logs each new high of the process's Python threads, by name.

glibc also gives each new thread an arena of its own (up to 8 per core), which keeps its own working set: the front
end stepped up by ~40 MB for good when its pools reached their size. fovea's processes use two arenas
(MALLOC_ARENA_MAX=2, set with mallopt at start and in the environment of the processes they start); a
MALLOC_ARENA_MAX the environment already has is glibc's and wins (0 gives glibc's own count back). Mapping every
array from 128 KB on kept memory as low as trimming but cost 28 % of image throughput (benchmarks/allocator_cost.py).

The cyclic garbage collector's full passes walk every container object alive, and a process that has imported torch
and transformers and built a model holds hundreds of thousands of them: a pass stopped the step it fell in for far
longer than the step (benchmarks/README, "The garbage collector's passes"). What was made at start-up lives until
the process ends, so each process freezes it once started (`freeze_startup_heap`: gc.freeze, after one collection so
that no garbage is frozen with it); the passes then walk only what was made since. `LLM` runs in its caller's
process, whose objects are the caller's to free: it freezes the heap while it generates (`heap_frozen`; freezing and
unfreezing move lists, they cost nothing) and gives everything back to the collector when it is done.

FOVEA_TRACEMALLOC=SECONDS makes the front end and the engine trace Python's allocations (slower) and log, every
SECONDS, the sites whose memory grew most since the first report: what a soak run that grows should look at first.
Memory that torch or glibc hold for arrays is not Python's and does not show there.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
import threading
import time
import tracemalloc

logger = logging.getLogger("fovea")

TRIM_EVERY_S = 10.0
TRIM_PAST_MB = 32.0
LOOK_EVERY_S = 1.0
TOP_SITES = 15
ARENAS = 2
M_ARENA_MAX = -8  # mallopt's parameter number in glibc's malloc.h


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only (musl and macOS lack it)
        return libc
    except (OSError, AttributeError):
        return None


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:  # sizes in pages: total, resident, ...
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _log_new_thread_high(process: str, most: int) -> int:
    """Logs the Python threads by name when there are more than ever before: pools start threads as they need
    them, up to their size, and a count that rises is told from a leak by what the new threads are."""
    threads = threading.enumerate()
    if len(threads) > most:
        names = sorted(thread.name.rsplit("_", 1)[0] for thread in threads)  # a pool's threads: prefix_N
        counted = ", ".join(f"{name} x{names.count(name)}" for name in dict.fromkeys(names))
        logger.info("%s: %d Python threads, the most so far: %s", process, len(threads), counted)
    return max(most, len(threads))


def _bound_arenas(libc) -> None:
    """Threads that start after this share ARENAS arenas; glibc reads the variable in each process started later."""
    if "MALLOC_ARENA_MAX" not in os.environ:
        libc.mallopt(M_ARENA_MAX, ARENAS)
        os.environ["MALLOC_ARENA_MAX"] = str(ARENAS)


def freeze_startup_heap() -> None:
    """A process of fovea's own, started: every object alive now, once collected, out of the garbage collector's
    passes for good (see above)."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def heap_frozen():
    """The objects alive at the block's start out of the garbage collector's passes while it runs (see above);
    nothing happens where the heap is frozen already (a process's own, or an outer block's)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def watch_memory(process: str) -> None:
    """In the front end and the engine process, first thing: the arenas' bound, the periodic trim, the threads'
    high marks, and the report if asked for."""
    every_s = float(os.environ.get("FOVEA_MALLOC_TRIM_S", TRIM_EVERY_S) or 0)
    rise = float(os.environ.get("FOVEA_MALLOC_TRIM_MB", TRIM_PAST_MB) or 0) * 2**20 or float("inf")
    libc = _glibc()
    if libc is not None:
        _bound_arenas(libc)
    if every_s <= 0:
        libc = None

    def upkeep() -> None:
        most, lowest, trimmed = 0, _resident_bytes() if libc is not None else 0, time.monotonic()
        while True:
            time.sleep(min(every_s, LOOK_EVERY_S) if libc is not None else LOOK_EVERY_S)
            if libc is not None:
                resident = _resident_bytes()
                lowest = min(lowest, resident)
                if resident - lowest >= rise or time.monotonic() - trimmed >= every_s:
                    libc.malloc_trim(0)
                    lowest, trimmed = _resident_bytes(), time.monotonic()
            most = _log_new_thread_high(process, most)

    threading.Thread(target=upkeep, name="fovea-memory", daemon=True).start()
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
