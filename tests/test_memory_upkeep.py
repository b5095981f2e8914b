"""The front end's and the engine's memory upkeep (fovea/core/memory.py): memory freed between live blocks is
handed back once the process has grown by FOVEA_MALLOC_TRIM_MB or FOVEA_MALLOC_TRIM_S have passed, whichever comes
first, and never with FOVEA_MALLOC_TRIM_S=0; the Python threads are logged by name at each new high; threads share
two glibc arenas unless the environment says otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# 200 MB in 64 KB blocks (glibc's heap, not mappings of their own), then all but every 100th freed: the free
# memory lies between live blocks, where glibc keeps it. Then 48 MB of a mapping of its own, touched: a rise that
# comes after the frees, whenever the upkeep looked (a trim at the peak, before the frees, would leave them to the
# clock). The RSS at the peak (nothing free yet, so nothing a trim could take), after the mapping, and 3 s later, in
# MB. A trim may come before the second reading (the upkeep looks every second), so what went back is measured from
# the peak.
FRAGMENTED = textwrap.dedent(
    """
    import mmap, os, threading, time
    from fovea.core.memory import watch_memory
    def resident_mb():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    watch_memory("the test")
    time.sleep(0.5)
    threading.Thread(target=time.sleep, args=(5,), name="pool-of-one_0").start()
    blocks = [b"x" * (64 * 1024) for _ in range(3200)]
    peak = resident_mb()
    kept = blocks[::100]
    del blocks
    grown = mmap.mmap(-1, 48 * 2**20)
    grown.write(b"x" * len(grown))
    before = resident_mb()
    time.sleep(3)
    print(peak, before, resident_mb())
    """
)


def rss_peak_before_and_after(**env: str) -> tuple[float, float, float, str]:
    done = subprocess.run(
        [sys.executable, "-c", FRAGMENTED], env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    peak, before, after = map(float, done.stdout.split())
    assert peak > 200, peak
    return peak, before, after, done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_freed_memory_goes_back_once_the_process_has_grown_enough_or_in_time():
    peak, _, after, log = rss_peak_before_and_after(FOVEA_MALLOC_TRIM_MB="32")
    assert after < peak + 48 - 150, (peak, after)
    assert "the test: 3 Python threads, the most so far: MainThread x1, fovea-memory x1, pool-of-one x1" in log
    _, before, after, _ = rss_peak_before_and_after(FOVEA_MALLOC_TRIM_MB="1000")  # grown less, 10 s not passed: kept
    assert after > before - 20, (before, after)
    peak, _, after, _ = rss_peak_before_and_after(FOVEA_MALLOC_TRIM_MB="1000", FOVEA_MALLOC_TRIM_S="2")  # 2 s passed
    assert after < peak + 48 - 150, (peak, after)
    peak, before, after, _ = rss_peak_before_and_after(FOVEA_MALLOC_TRIM_S="0")  # never
    assert before > peak + 48 - 20 and after > before - 20, (peak, before, after)


# eight threads allocate at once after the upkeep starts; glibc's malloc_stats lists its arenas ("Arena N:")
EIGHT_THREADS = textwrap.dedent(
    """
    import ctypes, os, sys, threading
    from fovea.core.memory import watch_memory
    watch_memory("the test")
    together = threading.Barrier(8)
    def allocate():
        together.wait()
        kept = [bytearray(4096 + size) for size in range(200)]
        together.wait()
    threads = [threading.Thread(target=allocate) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(os.environ.get("MALLOC_ARENA_MAX"))
    sys.stdout.flush()
    ctypes.CDLL("libc.so.6").malloc_stats()
    """
)


def arenas_and_inherited(**env: str) -> tuple[int, str]:
    clean = {key: value for key, value in os.environ.items() if key != "MALLOC_ARENA_MAX"}
    done = subprocess.run(
        [sys.executable, "-c", EIGHT_THREADS], env={**clean, **env}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stderr.count("Arena "), done.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="arenas are glibc's")
def test_threads_share_two_arenas_and_the_processes_started_later_too():
    assert arenas_and_inherited() == (2, "2")
    assert arenas_and_inherited(MALLOC_ARENA_MAX="3") == (3, "3")  # the environment's own bound wins
    arenas, inherited = arenas_and_inherited(MALLOC_ARENA_MAX="0")  # glibc's own count: one per thread here
    assert arenas > 3 and inherited == "0", arenas


def test_generate_runs_with_the_heap_frozen_and_gives_it_back(tiny_dirs, monkeypatch):
    """While LLM.generate runs, the garbage collector's passes skip the objects alive when it began (the model,
    the libraries, the caller's: a full pass walked them all, 100-200 ms on this CPU); a cycle of the caller's that
    becomes garbage meanwhile stays until the run is over, and goes at the next pass after it."""
    import gc
    import weakref

    from fovea import LLM, SamplingParams

    class Node:
        pass

    cycle = Node()
    cycle.itself = cycle
    alive, held = weakref.ref(cycle), [cycle]
    del cycle
    kept_during_run = []
    with LLM(str(tiny_dirs["tiny-3b"]), max_model_len=256) as llm:
        step = llm.engine.step

        def step_dropping_the_cycle():
            if held:
                held.clear()  # garbage from here on
                gc.collect()
                kept_during_run.append(alive() is not None)
            return step()

        monkeypatch.setattr(llm.engine, "step", step_dropping_the_cycle)
        assert gc.get_freeze_count() == 0
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
        assert gc.get_freeze_count() == 0
    assert kept_during_run == [True]
    gc.collect()
    assert alive() is None
