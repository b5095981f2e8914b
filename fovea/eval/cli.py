"""`fovea eval --model NAME_OR_PATH --task TASK_OR_YAML [--base-url URL] [--ray --num-replicas N] [--limit N]
[--output-dir DIR]`: accuracy of a VLM on an image task, in process, against a server, or over Ray replicas."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace

from fovea.config.flags import EVAL_FLAGS, add_engine_flags, engine_kwargs


def add_eval_parser(sub) -> None:
    parser = sub.add_parser(
        "eval", help="evaluate a VLM's accuracy on an image task", description=__doc__.split(":", 1)[1].strip()
    )
    parser.add_argument("--model", help="a registry name (see --list), a model directory, or a served model name")
    parser.add_argument("--task", help="a task YAML file or a shipped task's name (see --list)")
    parser.add_argument("--list", action="store_true", help="list the registered models and shipped tasks")
    parser.add_argument(
        "--registry",
        action="append",
        default=[],
        metavar="FILE",
        help="more model entries: a YAML file or a Python file using @register_model (repeatable)",
    )
    parser.add_argument(
        "--data", help="the task's dataset at this path instead (a class folder, or a .jsonl, .csv or .parquet file)"
    )
    parser.add_argument("--limit", type=int, help="at most N samples per run, spread evenly over the dataset")
    parser.add_argument("--output-dir", help="where the outputs go (default: eval-results/TASK/MODEL)")
    parser.add_argument("--runs", type=int, help="override the task's number of runs")
    parser.add_argument("--samples-per-class", type=int, help="override the task's balanced sampling")
    parser.add_argument("--seed", type=int, help="override the task's sampling seed")
    asking = parser.add_argument_group("asking (override the registry entry)")
    asking.add_argument("--max-tokens", type=int)
    asking.add_argument("--temperature", type=float)
    asking.add_argument("--system-prompt")
    asking.add_argument(
        "--structured-answer",
        action="store_true",
        default=None,
        help="generate the answer under a JSON schema of the task's options (structured outputs)",
    )
    engine = add_engine_flags(
        parser,
        EVAL_FLAGS,
        given_only=True,
        title="engine (in-process and Ray; laid over the registry entry where given)",
    )
    engine.add_argument("--max-pixels", type=int, help="resize images to at most this many pixels")
    server = parser.add_argument_group("server backend")
    server.add_argument("--base-url", help="an OpenAI-compatible server, e.g. http://localhost:8000")
    server.add_argument("--api-key", help="sent as a bearer token")
    server.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    ray = parser.add_argument_group("Ray backend (pip install 'fovea[ray]')")
    ray.add_argument("--ray", action="store_true", help="shard the dataset over engine replicas with Ray")
    ray.add_argument("--num-replicas", type=int, default=1, help="one per GPU (times tensor_parallel_size)")
    ray.add_argument("--ray-address", help="an existing cluster (default: start a local one)")
    ray.add_argument("--cpus-per-replica", type=int, default=1, help="CPU replicas, when the cluster has no GPU")
    parser.set_defaults(func=run_eval)


def run_eval(args: argparse.Namespace) -> None:
    from fovea.eval.registry import MODELS, find_model, load_registry
    from fovea.eval.report import summary_table
    from fovea.eval.runner import evaluate
    from fovea.eval.tasks import SHIPPED_TASKS, Task

    for path in args.registry:
        load_registry(path)
    if args.list:
        print(
            "models:",
            *(f"  {name}: {m.path} (tensor_parallel_size {m.tensor_parallel_size})" for name, m in MODELS.items()),
            sep="\n",
        )
        print("tasks:", *(f"  {p.stem}" for p in sorted(SHIPPED_TASKS.glob("*.yaml"))), sep="\n")
        return
    if not args.model or not args.task:
        raise ValueError("--model and --task are required")
    if args.ray and args.base_url:
        raise ValueError("--ray and --base-url are two different backends: choose one")
    task = Task.find(args.task)
    if args.data:
        task = task.with_data(args.data)
    task = replace(task, **_given(args, "runs", "samples_per_class", "seed", "structured_answer"))
    task.validate()
    entry = find_model(args.model)
    entry = replace(entry, **_given(args, "max_tokens", "temperature", "system_prompt", "max_pixels"))
    overrides = {name: value for name, value in engine_kwargs(args, EVAL_FLAGS).items() if value is not None}
    backend = _backend(args, entry, overrides)
    output_dir = args.output_dir or f"eval-results/{_safe(task.name)}/{_safe(entry.name)}"
    try:
        results = evaluate(backend, task, entry, output_dir, args.limit)
    finally:
        if hasattr(backend, "close"):
            backend.close()
    print(summary_table(results))
    print(f"\nwrote predictions.jsonl, results.json and report.md to {output_dir}")
    if results["failed_runs"]:
        sys.exit(f"fovea eval: runs {results['failed_runs']} have more than {task.max_missing:.0%} missing answers")


def _backend(args, entry, overrides):
    if args.base_url:
        from fovea.eval.backends import OpenAIBackend

        return OpenAIBackend(args.base_url, entry, args.api_key, args.concurrency)
    if args.ray:
        from fovea.eval.ray_backend import RayBackend

        return RayBackend(entry, args.num_replicas, args.ray_address, args.cpus_per_replica, **overrides)
    from fovea.eval.backends import InProcessBackend

    return InProcessBackend(entry, **overrides)


def _given(args: argparse.Namespace, *names: str) -> dict:
    """{name: value} for the options the user gave."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _safe(name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", name).strip("_") or "model"
