"""Pictures of a model and its training: attention weights, positional encodings, learning-rate schedules, curves.

    python -m transformer_jax.visualize attention --workdir W [--config C] [--checkpoint latest|STEP]
        --source "..." --target "..." [--layer L] [--head H] --output_dir DIR
    python -m transformer_jax.visualize positional --d_model D --max_len L [--positions 0,10,20] --output_dir DIR
    python -m transformer_jax.visualize schedule --config C [--num_steps N] --output_dir DIR
    python -m transformer_jax.visualize curves --metrics RUN1/metrics.jsonl [RUN2 ...] [--keys loss,valid_loss]
        --output_dir DIR

Each subcommand is also a function of `transformer_jax.visualization` (`attention`, `positional`, `schedule`,
`curves`) that writes the PNGs and returns their paths together with the arrays drawn. Errors in the arguments are
printed as one line without a traceback, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformer_jax.visualization import VisualizeError, attention, curves, positional, schedule


def load_config_file(spec: str) -> Any:
    """A config file as train.py takes it: 'path/to/file.py[:arg]' -> get_config(arg)."""
    path, sep, arg = spec.partition(":")
    if not Path(path).is_file():
        raise VisualizeError(f"--config {spec}: no such file {path}")
    module_spec = importlib.util.spec_from_file_location(f"_visualize_config_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise VisualizeError(f"--config {spec}: {path} defines no get_config(arg)")
    try:
        return module.get_config(arg) if sep else module.get_config()
    except ValueError as e:
        raise VisualizeError(f"--config {spec}: {e}") from e


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from e


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m transformer_jax.visualize", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("attention", help="attention weights of a sentence pair, per kind, layer and head")
    p.add_argument("--workdir", required=True, help="training directory with checkpoints/ and spm.model")
    p.add_argument("--config", help="config file[:arg]; default: the config saved with the checkpoint")
    p.add_argument("--checkpoint", default="latest", help="latest, or a checkpoint step")
    p.add_argument("--source", required=True, help="source sentence")
    p.add_argument("--target", required=True, help="target sentence (fed to the decoder after <s>)")
    p.add_argument("--layer", type=int, help="only this layer (0-based); default: every layer")
    p.add_argument("--head", type=int, help="only this head (0-based), drawn large; default: a grid of all heads")

    p = commands.add_parser("positional", help="the sinusoidal positional encoding and its dot products")
    p.add_argument("--d_model", type=int, default=512, help="model width (even)")
    p.add_argument("--max_len", type=int, default=100, help="positions to draw")
    p.add_argument("--positions", type=_int_list, help="positions whose dot products are drawn, e.g. 0,10,50")

    p = commands.add_parser("schedule", help="the learning rate over a config's training steps")
    p.add_argument("--config", required=True, help="config file[:arg], as for train.py")
    p.add_argument("--num_steps", type=int, help="steps to draw; default: config.train.num_steps")

    p = commands.add_parser("curves", help="training and validation curves of one or more runs")
    p.add_argument("--metrics", nargs="+", required=True, help="metrics.jsonl files (or run directories)")
    p.add_argument("--keys", help="comma-separated metrics keys; default: those of loss,valid_loss,... present")

    for p in commands.choices.values():
        p.add_argument("--output_dir", required=True, help="directory for the PNG files")
    return parser


def run(args: argparse.Namespace) -> list[Path]:
    """Runs one parsed command; returns the files written."""
    if args.command == "attention":
        config = load_config_file(args.config) if args.config else None
        result = attention(
            args.workdir,
            args.source,
            args.target,
            args.output_dir,
            config=config,
            checkpoint=args.checkpoint,
            layer=args.layer,
            head=args.head,
        )
        return result.paths
    if args.command == "positional":
        return positional(args.d_model, args.max_len, args.output_dir, args.positions).paths
    if args.command == "schedule":
        return [schedule(load_config_file(args.config), args.output_dir, args.num_steps).path]
    keys = [k.strip() for k in args.keys.split(",") if k.strip()] if args.keys else None
    return [curves(args.metrics, args.output_dir, keys).path]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    from transformer_jax.errors import ConfigError, DataError

    try:
        paths = run(args)
    except (VisualizeError, ConfigError, DataError) as e:
        parser.exit(2, f"{parser.prog} {args.command}: error: {e}\n")
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
