"""What a newcomer's install gets: every third-party module a command imports is a dependency of the core package
or of the extra the README names for that command, with a version range."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# imported only where present, each behind its own check: not a dependency of any extra
OPTIONAL = {
    "flashinfer": "fovea bench kernels compares with it when installed",
    "triton": "our GPU kernels; torch's Linux builds bring it",
    "ray": "only with --ray / --distributed-executor-backend ray (the ray extra)",
}


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def imported_modules(folder: Path) -> set[str]:
    names = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("fovea", "__future__")}


@pytest.mark.parametrize(
    "folder, extra",
    [("bench", "bench"), ("eval", "eval"), ("server", None), ("engine", None), ("models", None), ("multimodal", None)],
)
def test_every_import_is_a_declared_dependency(folder, extra):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = requirement_names(project["dependencies"])
    if extra:
        declared |= requirement_names(project["optional-dependencies"][extra])
    dists = packages_distributions()
    missing = {}
    for module in imported_modules(ROOT / "fovea" / folder) - set(OPTIONAL):
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if not names & declared:
            missing[module] = sorted(names)
    assert not missing, f"fovea/{folder} imports modules no dependency declares: {missing}"


def test_every_dependency_has_an_upper_bound():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    unbounded = [r for r in requirements if not r.startswith("fovea[") and "<" not in r.split(";")[0]]
    assert not unbounded, unbounded
