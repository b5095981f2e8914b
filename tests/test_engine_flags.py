"""One default per engine setting: `fovea serve`, `fovea bench throughput|latency`, `fovea plan`, `fovea eval` and
`LLM(**kwargs)` (EngineConfig) agree, and `--help` shows each (fovea/config/flags.py)."""

from __future__ import annotations

import argparse

import pytest
import torch

from fovea.cli import build_parser
from fovea.config import flags
from fovea.config.engine import EngineConfig
from fovea.plan import plan_memory

COMMANDS = {  # argv that parses, and the engine settings the command takes
    "serve": (["serve"], [flag.name for flag in flags.FLAGS]),
    "bench throughput": (["bench", "throughput"], [flag.name for flag in flags.FLAGS]),
    "bench latency": (["bench", "latency"], [flag.name for flag in flags.FLAGS]),
    "plan": (["plan", "MODEL", "--gpu-memory", "80"], list(flags.PLAN_FLAGS)),
    "eval": (["eval"], list(flags.EVAL_FLAGS)),
}


def subparser(argv: list[str]) -> argparse.ArgumentParser:
    parser = build_parser()
    for word in argv:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or word not in actions[0].choices:
            break
        parser = actions[0].choices[word]
    return parser


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_has_the_engine_defaults(command):
    argv, names = COMMANDS[command]
    args = build_parser().parse_args(argv)
    helps = {action.dest: action.help for action in subparser(argv)._actions}
    for name in names:
        expected = flags.default(name)
        if command == "eval":  # laid over the registry entry: only what the user gave counts
            assert getattr(args, name) is None, name
        else:
            assert getattr(args, name) == expected, (command, name, getattr(args, name), expected)
        assert "(default: " in helps[name], (command, name, helps[name])  # shown in --help
        if not isinstance(expected, dict) and "(default: none)" not in helps[name]:
            assert f"(default: {expected})" in helps[name] or expected is None, (command, name, helps[name])


def test_llm_and_the_table_agree(tiny_dirs):
    """What LLM(model) gets with no arguments is the table's default, field by field."""
    config = EngineConfig.from_args(str(tiny_dirs["tiny-3b"]))
    for flag in flags.FLAGS:
        if flag.group == "hub" or flag.name in ("dtype", "max_model_len"):
            continue
        if flag.name == "mm_buckets":
            assert config.mm_buckets == [] and flags.default("mm_buckets") is None  # none given: no buckets
            continue
        if flag.name == "gpu_memory_utilization" and torch.cuda.is_available():
            continue  # conftest gives this run's engines a small share of the card (small_gpu_share)
        assert getattr(config, flag.name) == flags.default(flag.name), flag.name
    assert config.max_model_len == config.model.text.max_position_embeddings  # default: the model's own
    with pytest.raises(Exception):  # frozen: built once, never patched afterwards
        config.max_num_seqs = 1  # type: ignore[misc]


def test_plan_takes_the_engine_defaults(tiny_dirs):
    model = tiny_dirs["tiny-3b"]
    given = {name: flags.default(name) for name in flags.PLAN_FLAGS}
    assert plan_memory(model, 80) == plan_memory(model, 80, **given)
