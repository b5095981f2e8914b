"""Imports flow one way: server -> frontend -> engine -> runner -> models -> attention, layers; config and core
(shared types) below them all. The upward imports that remain (issue 31) are listed, so that none is added and
each one removed is struck off here; the goal is an empty list."""

from __future__ import annotations

import re
from pathlib import Path

FOVEA = Path(__file__).parents[1] / "fovea"
# higher imports lower; equal ranks may import each other
RANK = {"cli": 9, "__main__": 9, "entrypoints": 9, "__init__": 9, "bench": 8, "eval": 8, "demo": 8, "server": 7,
        "llm": 7, "frontend": 6, "engine": 5, "runner": 4, "multimodal": 3.5, "testing": 3.2, "models": 3,
        "attention": 2, "layers": 2, "core": 1.5, "config": 1, "distributed": 0, "worker_pool": 0}
STILL_UPWARD = {  # (importer, imported): to be removed, not added to
    ("config/engine.py", "fovea.models.loader"), ("config/engine.py", "fovea.multimodal.video"),
    ("config/memory_plan.py", "fovea.models.registry"), ("config/memory_plan.py", "fovea.multimodal.video"),
    ("config/model.py", "fovea.models.registry"),
    ("models/loader.py", "fovea.testing.tiny"),
}


def upward_imports() -> set[tuple[str, str]]:
    found = set()
    for path in FOVEA.rglob("*.py"):
        importer = path.relative_to(FOVEA).as_posix()
        source = importer.split("/")[0].removesuffix(".py")
        for match in re.finditer(r"^\s*(?:from (fovea(?:\.\w+)+) import|import (fovea(?:\.\w+)+))", path.read_text(),
                                 re.MULTILINE):
            module = match.group(1) or match.group(2)
            target = module.split(".")[1]
            assert source in RANK and target in RANK, f"{importer} or {module}: give its package a rank"
            if target != source and RANK[target] > RANK[source]:
                found.add((importer, module))
    return found


def test_no_new_upward_imports():
    found = upward_imports()
    assert not found - STILL_UPWARD, f"new upward imports: {sorted(found - STILL_UPWARD)}"
    assert not STILL_UPWARD - found, f"gone (strike them off STILL_UPWARD): {sorted(STILL_UPWARD - found)}"
