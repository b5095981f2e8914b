"""Every code block of README.md and docs/ is an example that is run or checked, so none can drift from the code
(issue 59). The line before each block says which:

    <!-- example: run -->     run as written (python or bash), with the embedded demo model
    <!-- example: server -->  run as written against a demo-model server started here on a free port, whose
                              address replaces localhost:8000; a reply with an error body fails it
    <!-- example: check (why) -->  syntax only: it needs a GPU, a hub download or a dataset, or serves until stopped

A block without a mark fails `test_every_block_is_marked`, naming its file and line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from serving import running_server

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(r"<!-- example: (run|server|check)\b.*-->")
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    mark: str | None

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    lines, found, index = path.read_text().splitlines(), [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
        before = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        mark = MARK.match(before.strip())
        code = "\n".join(lines[index + 1 : end]) + "\n"
        found.append(Block(path, index + 1, opening.group(1), code, mark.group(1) if mark else None))
        index = end + 1
    return found


BLOCKS = [block for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] for block in blocks_of(path)]


def marked(kind: str) -> list[Block]:
    return [block for block in BLOCKS if block.mark == kind]


def test_every_block_is_marked():
    assert len(BLOCKS) >= 8
    assert [str(b) for b in BLOCKS if b.mark is None] == []
    assert [str(b) for b in BLOCKS if b.mark != "check" and b.lang not in ("python", "bash")] == []


def check_syntax(block: Block) -> None:
    if block.lang == "python":
        compile(block.code, str(block), "exec")
    elif block.lang == "bash":
        done = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    elif block.lang == "yaml":
        yaml.safe_load(block.code)
    elif block.lang == "json":
        json.loads(block.code)
    else:
        raise AssertionError(f"{block}: no syntax check for {block.lang or 'an unnamed language'}")


@pytest.mark.parametrize("block", marked("check"), ids=str)
def test_checked_blocks_parse(block):
    check_syntax(block)


@pytest.fixture(scope="module")
def environment(tmp_path_factory) -> dict:
    """The `fovea` command of this interpreter first on PATH, one demo-model cache for every example."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    cache = str(tmp_path_factory.mktemp("fovea-cache"))
    return {**os.environ, "PATH": path, "FOVEA_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}


def run_example(block: Block, environment: dict, address: str | None = None) -> subprocess.CompletedProcess:
    code = block.code if address is None else re.sub(r"(localhost|127\.0\.0\.1):8000", address, block.code)
    command = [sys.executable, "-c", code] if block.lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment, cwd=ROOT)


@pytest.mark.parametrize("block", marked("run"), ids=str)
def test_run_blocks_run_as_written(block, environment):
    done = run_example(block, environment)
    assert done.returncode == 0, f"{block}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def demo_server(environment):
    with running_server(None, env=environment, startup_s=300) as (base, _):
        yield base.removeprefix("http://")


@pytest.mark.parametrize("block", marked("server"), ids=str)
def test_server_blocks_run_against_a_demo_server(block, environment, demo_server):
    done = run_example(block, environment, demo_server)
    assert done.returncode == 0 and '"error"' not in done.stdout, f"{block}:\n{done.stdout[-2000:]}\n{done.stderr}"


def test_a_broken_example_fails(environment):
    """The check can fail: the README's offline example with a misspelt name."""
    [offline] = [b for b in marked("run") if b.path.name == "README.md" and b.lang == "python"]
    broken = Block(
        offline.path, offline.line, "python", offline.code.replace("SamplingParams(", "SamplingParam("), "run"
    )
    done = run_example(broken, environment)
    assert done.returncode != 0 and "NameError" in done.stderr
