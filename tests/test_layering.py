"""Imports flow one way: server -> frontend -> engine -> runner -> models -> attention, layers; config and core
(shared types) below them all. The tiny checkpoint writers (`testing`) sit beside config: they need only its image
constants, and `model=None` resolves to the demo model they build."""

from __future__ import annotations

import re
from pathlib import Path

FOVEA = Path(__file__).parents[1] / "fovea"
# higher imports lower; equal ranks may import each other
RANK = {
    "cli": 9,
    "__main__": 9,
    "entrypoints": 9,
    "__init__": 9,
    "bench": 8,
    "eval": 8,
    "demo": 8,
    "plan": 8,
    "server": 7,
    "llm": 7,
    "frontend": 6,
    "engine": 5,
    "runner": 4,
    "multimodal": 3.5,
    "models": 3,
    "attention": 2,
    "layers": 2,
    "core": 1.5,
    "config": 1,
    "testing": 1,
    "distributed": 0,
    "worker_pool": 0,
}


def upward_imports() -> set[tuple[str, str]]:
    found = set()
    for path in FOVEA.rglob("*.py"):
        importer = path.relative_to(FOVEA).as_posix()
        source = importer.split("/")[0].removesuffix(".py")
        for match in re.finditer(
            r"^\s*(?:from (fovea(?:\.\w+)+) import|import (fovea(?:\.\w+)+))", path.read_text(), re.MULTILINE
        ):
            module = match.group(1) or match.group(2)
            target = module.split(".")[1]
            assert source in RANK and target in RANK, f"{importer} or {module}: give its package a rank"
            if target != source and RANK[target] > RANK[source]:
                found.add((importer, module))
    return found


def test_no_upward_imports():
    assert not upward_imports(), f"imports against the layering: {sorted(upward_imports())}"


def test_every_parsed_family_has_a_model():
    from fovea.config.families import PARSERS
    from fovea.models.registry import FAMILIES

    assert PARSERS.keys() == FAMILIES.keys()
