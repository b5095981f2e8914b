"""A process's resident memory by kind of mapping, from /proc/PID/smaps (Linux): where a server process grows.

    python benchmarks/smaps_kinds.py PID [PID ...]   # one line per process; run it every minute beside a soak

heap: glibc's main arena (the brk heap: the allocations of the process's main thread); arenas: anonymous
mappings 64 MB-aligned and at most 64 MB (glibc's other arenas, one per thread that allocates, up to 8 per core);
anon: other anonymous mappings (chunks glibc maps on their own, torch's, thread stacks); files: the code and
data of loaded libraries and models; shm: /dev/shm segments mapped in (images in flight).
"""

from __future__ import annotations

import re
import sys
import time

ARENA = 64 << 20
MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")


def kind(start: int, end: int, path: str) -> str:
    if path == "[heap]":
        return "heap"
    if path.startswith("/dev/shm/"):
        return "shm"
    if path and not path.startswith("["):
        return "files"
    if not path and end - start <= ARENA and start % ARENA == 0:
        return "arenas"
    return "anon"


def resident_by_kind(pid: int) -> dict[str, int]:
    sizes = dict.fromkeys(("heap", "arenas", "anon", "files", "shm"), 0)
    current = "anon"
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            mapping = MAPPING.match(line)
            if mapping:
                current = kind(int(mapping[1], 16), int(mapping[2], 16), mapping[3].strip())
            elif line.startswith("Rss:"):
                sizes[current] += int(line.split()[1]) << 10
    return sizes


if __name__ == "__main__":
    for pid in sys.argv[1:]:
        sizes = resident_by_kind(int(pid))
        figures = " ".join(f"{name}={size / 2**20:.0f}" for name, size in sizes.items())
        print(f"{time.strftime('%H:%M:%S')} {pid} {figures} total={sum(sizes.values()) / 2**20:.0f} MB", flush=True)
