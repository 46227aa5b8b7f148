"""Pictures of a model and its training: attention weights, positional encodings, learning-rate schedules, curves.

    python -m transformer_jax.visualize attention --workdir W [--config C] [--checkpoint latest|STEP]
        --source "..." --target "..." [--layer L] [--head H] --output_dir DIR
    python -m transformer_jax.visualize positional --d_model D --max_len L [--positions 0,10,20] --output_dir DIR
    python -m transformer_jax.visualize schedule --config C [--num_steps N] --output_dir DIR
    python -m transformer_jax.visualize curves --metrics RUN1/metrics.jsonl [RUN2 ...] [--keys loss,valid_loss]
        --output_dir DIR

Each command is also a function of `transformer_jax.visualize` (`attention`, `positional`, `schedule`,
`curves`) that writes the PNGs and returns their paths together with the arrays drawn. Errors in the arguments are
printed as one line without a traceback, exit status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from absl import flags
from ml_collections import config_flags

from transformer_jax import cli
from transformer_jax.cli import USAGE_STATUS, exit_on_user_error, fail, parse_flags
from transformer_jax.errors import VisualizeError
from transformer_jax.visualize import attention, curves, positional, schedule

PROG = "python -m transformer_jax.visualize"
# command -> (what it draws, flags it needs, flags it also takes); every command needs --output_dir.
COMMANDS = {
    "attention": (
        "attention weights of a sentence pair, per kind, layer and head",
        {"workdir", "source", "target"},
        {"config", "checkpoint", "layer", "head"},
    ),
    "positional": (
        "the sinusoidal positional encoding and its dot products",
        set(),
        {"d_model", "max_len", "positions"},
    ),
    "schedule": ("the learning rate over a config's training steps", {"config"}, {"num_steps"}),
    "curves": ("training and validation curves of one or more runs", {"metrics"}, {"keys"}),
}


def _flag_values(argv: Sequence[str]) -> flags.FlagValues:
    """The flags of every command, in a FlagValues of their own (absl has no sub-commands): each call of `main`
    parses afresh, and importing this module defines nothing in the global absl FLAGS."""
    fv = flags.FlagValues()
    on = {"flag_values": fv}
    # config_flags reads argv to define the --config.KEY=VALUE override flags.
    config_flags.DEFINE_config_file(
        "config", None, "attention: config file[:arg], default the saved one; schedule: as for train.py",
        sys_argv=list(argv), **on,
    )  # fmt: skip
    flags.DEFINE_string("workdir", None, "attention: training directory with checkpoints/ and spm.model", **on)
    flags.DEFINE_string("checkpoint", "latest", "attention: latest, or a checkpoint step", **on)
    flags.DEFINE_string("source", None, "attention: source sentence", **on)
    flags.DEFINE_string("target", None, "attention: target sentence (fed to the decoder after <s>)", **on)
    flags.DEFINE_integer("layer", None, "attention: only this layer (0-based); default every layer", **on)
    flags.DEFINE_integer("head", None, "attention: only this head (0-based), drawn large", **on)
    flags.DEFINE_integer("d_model", 512, "positional: model width (even)", **on)
    flags.DEFINE_integer("max_len", 100, "positional: positions to draw", **on)
    flags.DEFINE_list("positions", None, "positional: positions whose dot products are drawn, e.g. 0,10,50", **on)
    flags.DEFINE_integer("num_steps", None, "schedule: steps to draw; default config.train.num_steps", **on)
    flags.DEFINE_list("metrics", None, "curves: metrics.jsonl files or run directories (more may follow)", **on)
    flags.DEFINE_list("keys", None, "curves: metrics keys; default those of loss,valid_loss,... present", **on)
    flags.DEFINE_string("output_dir", None, "directory for the PNG files", **on)
    return fv


def _parse(argv: Sequence[str]) -> tuple[str, flags.FlagValues, list[str]]:
    """(command, parsed flags, positional arguments after the command); a wrong command line ends the program."""
    argv = [PROG, *argv]
    fv = _flag_values(argv)
    commands = "\n".join(f"  {name}: {what}" for name, (what, *_) in COMMANDS.items())
    rest = parse_flags(PROG, argv, fv, usage=f"{__doc__}\ncommands:\n{commands}\n")[1:]
    if not rest or rest[0] not in COMMANDS:
        got = f"unknown command {rest[0]!r}" if rest else "no command"
        fail(PROG, f"{got}; the first argument is one of {', '.join(COMMANDS)} (--help lists their flags)")
    command, rest = rest[0], rest[1:]
    _, required, optional = COMMANDS[command]
    given = {name for name in fv if fv[name].present and "." not in name}  # "config.x": overrides of --config
    missing = sorted({*required, "output_dir"} - given)
    if missing:
        fail(f"{PROG} {command}", "the following flags are required: " + ", ".join(f"--{n}" for n in missing))
    foreign = sorted(given - required - optional - {"output_dir"})
    if foreign:
        fail(f"{PROG} {command}", f"{', '.join(f'--{n}' for n in foreign)}: not a flag of the {command} command")
    if rest and command != "curves":  # curves: `--metrics A B` lists more files after the flag
        fail(f"{PROG} {command}", f"unexpected arguments: {rest}")
    return command, fv, rest


def run(command: str, fv: flags.FlagValues, more_metrics: Sequence[str] = ()) -> list[Path]:
    """Runs one parsed command, its --config validated first; returns the files written."""
    if fv.config is not None:
        cli.validate(fv.config)
    if command == "attention":
        return attention(
            fv.workdir,
            fv.source,
            fv.target,
            fv.output_dir,
            config=fv.config,
            checkpoint=fv.checkpoint,
            layer=fv.layer,
            head=fv.head,
        ).paths
    if command == "positional":
        try:
            positions = [int(p) for p in fv.positions] if fv.positions else None
        except ValueError as e:
            raise VisualizeError(f"--positions: expected integers separated by commas, got {fv.positions}") from e
        return positional(fv.d_model, fv.max_len, fv.output_dir, positions).paths
    if command == "schedule":
        return [schedule(fv.config, fv.output_dir, fv.num_steps).path]
    keys = [k.strip() for k in fv.keys if k.strip()] if fv.keys else None
    return [curves([*fv.metrics, *more_metrics], fv.output_dir, keys).path]


def main(argv: Sequence[str] | None = None) -> int:
    """argv: the command and its flags (sys.argv[1:] when None). Prints the files written."""
    command, fv, rest = _parse(sys.argv[1:] if argv is None else argv)
    with exit_on_user_error(f"{PROG} {command}", USAGE_STATUS):
        paths = run(command, fv, rest)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
