"""The `fovea` command."""

from __future__ import annotations

import argparse
import sys

from fovea.config.flags import PLAN_FLAGS, add_engine_flags, dotted_flags, engine_kwargs


def _demo(args: argparse.Namespace) -> None:
    import torch

    from fovea.demo import run_demo

    if args.threads:
        torch.set_num_threads(args.threads)
    run_demo(args.model, args.image, args.prompt, args.max_tokens, args.dtype)


def _tiny(args: argparse.Namespace) -> None:
    from fovea.testing.tiny import write_tiny_checkpoint
    from fovea.testing.tiny_gemma3 import write_gemma3_checkpoint
    from fovea.testing.tiny_internvl import write_internvl_checkpoint
    from fovea.testing.tiny_llava import LLAVA_SHAPES, write_llava_checkpoint
    from fovea.testing.tiny_qwen3_vl import QWEN3_VL_SHAPES, write_qwen3_vl_checkpoint

    writers = {
        **dict.fromkeys(LLAVA_SHAPES, write_llava_checkpoint),
        **dict.fromkeys(QWEN3_VL_SHAPES, write_qwen3_vl_checkpoint),
        "tiny-gemma3": write_gemma3_checkpoint,
        "tiny-internvl": write_internvl_checkpoint,
    }
    write = writers.get(args.config, write_tiny_checkpoint)
    out = write(
        args.out_dir,
        args.config,
        seed=args.seed,
        layout=args.layout,
        shards=args.shards,
        dtype=args.dtype,
        device=args.device,
    )
    print(f"wrote a random-weight {args.config} checkpoint to {out}")


def _plan(args: argparse.Namespace) -> None:
    from fovea.config.model import resolve_model_dir
    from fovea.plan import format_plan, plan_memory, smallest_fitting_size

    model_dir = resolve_model_dir(args.model)
    options = {**engine_kwargs(args, PLAN_FLAGS), "max_pixels": args.max_pixels}
    tensor_parallel_size = options.pop("tensor_parallel_size")
    plan = plan_memory(model_dir, args.gpu_memory, tensor_parallel_size=tensor_parallel_size, **options)
    print(
        format_plan(
            plan,
            f"{model_dir}: {plan.dtype}, {args.gpu_memory:g} GiB x {args.gpu_memory_utilization:g}"
            f" per GPU, tensor_parallel_size {tensor_parallel_size} (figures per GPU)",
        )
    )
    smallest = smallest_fitting_size(model_dir, args.gpu_memory, **options)
    print(
        f"smallest tensor_parallel_size that fits: {smallest}"
        if smallest
        else "no tensor_parallel_size up to 32 both splits the model and fits these limits"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fovea", description="Fast serving of vision-language models.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")

    demo = sub.add_parser("demo", help="offline generation with an image (default: the embedded demo model)")
    demo.add_argument("model", nargs="?", default=None, help="model directory or hub id in the local HF cache")
    demo.add_argument("--image", default=None, help="image path or data URL (default: a synthetic picture)")
    demo.add_argument("--prompt", default="Describe this image.")
    demo.add_argument("--max-tokens", type=int, default=24)
    demo.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    demo.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    demo.set_defaults(func=_demo)

    from fovea.bench.cli import add_bench_parser
    from fovea.eval.cli import add_eval_parser
    from fovea.server.cli import add_serve_parser

    add_serve_parser(sub)
    add_bench_parser(sub)
    add_eval_parser(sub)
    parser.subcommands = sub.choices  # main() shows a subcommand's own usage for its unknown flags

    plan = sub.add_parser("plan", help="what fits on a GPU (weights, activations, KV cache), from config.json alone")
    plan.add_argument("model", help="model directory (config.json is enough) or hub id in the local HF cache")
    plan.add_argument("--gpu-memory", type=float, required=True, help="GiB per GPU, e.g. 80")
    add_engine_flags(plan, PLAN_FLAGS)
    plan.add_argument("--max-pixels", type=int, default=None, help="image resize cap (default: the checkpoint's)")
    plan.set_defaults(func=_plan)

    tiny = sub.add_parser(
        "tiny", help="write a random-weight checkpoint in the HF layout (Qwen2.5-VL, Qwen2-VL, Qwen3-VL, LLaVA-1.5)"
    )
    tiny.add_argument("out_dir")
    tiny.add_argument(
        "--config",
        default="tiny-3b",
        choices=[
            "tiny-3b",
            "cpu-512",
            "tiny-7b",
            "qwen2.5-vl-7b",
            "tiny-qwen2-vl",
            "qwen2-vl-7b",
            "tiny-qwen3-vl",
            "tiny-qwen3-vl-moe",
            "qwen3-vl-8b",
            "qwen3-vl-32b",
            "qwen3-vl-30b-a3b",
            "tiny-llava",
            "llava-1.5-7b",
            "tiny-gemma3",
            "tiny-internvl",
        ],
        help="the 7b/8b/30b/32b ones: the published shapes (16-67 GB in bf16; use --device cuda)",
    )
    tiny.add_argument("--device", default="cpu", help="where the random weights are drawn")
    tiny.add_argument("--layout", default="published", choices=["published", "transformers5"])
    tiny.add_argument("--shards", type=int, default=1)
    tiny.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_tiny)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; for serve with `--config FILE` (vLLM's YAML of flags), the file's values as the flags'
    defaults, then the command line again over them."""
    argv = dotted_flags(sys.argv[1:] if argv is None else list(argv))  # vLLM's --flag.key value
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "config", None) and args.command == "serve":
        from fovea.server.cli import with_config_file

        try:
            with_config_file(parser.subcommands["serve"], args.config)
        except ValueError as exc:
            parser.subcommands["serve"].error(str(exc))
        args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported with the usage of the subcommand they were given to, not the top-level one
        parser.subcommands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    if args.version:
        from fovea import __version__

        print(__version__)
        return
    if not getattr(args, "func", None):
        parser.print_help()
        sys.exit(2)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"fovea: error: {exc}")


if __name__ == "__main__":
    main()
