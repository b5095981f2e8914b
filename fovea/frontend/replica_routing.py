"""Which data-parallel replica takes a request: the least busy, or the one whose encoder cache likely holds its
images."""

from __future__ import annotations

import collections

# A request whose images a replica encoded last goes there while that replica has at most this many requests more
# in flight than the least busy one: its encoder cache likely still holds them, so they skip its encoder
AFFINITY_SLACK = 4
IMAGE_HOMES = 65536  # images whose replica is remembered (~100 bytes each), the least recently seen forgotten


def pick_replica(live: list[int], in_flight: list[int], homes: collections.OrderedDict, hashes: list[str]) -> int:
    """The replica for a request with these images' content hashes: the least busy live one, unless a live one
    that encoded some of them last is within AFFINITY_SLACK of it. `homes` (hash -> replica) learns the choice."""
    least = min(live, key=in_flight.__getitem__)
    known = [homes[h] for h in hashes if h in homes and homes[h] in live]
    chosen = least
    if known:
        home = max(set(known), key=known.count)
        if in_flight[home] <= in_flight[least] + AFFINITY_SLACK:
            chosen = home
    for h in hashes:
        homes[h] = chosen
        homes.move_to_end(h)
    while len(homes) > IMAGE_HOMES:
        homes.popitem(last=False)
    return chosen
