"""Run a config's sweep: python -m transformer_jax.sweep --config configs/<file>.py[:arg] --workdir DIR

A config file's `get_sweep(arg)` returns a list of dicts: {"name": readable-name, "<dotted.key>": value, ...}.
An entry may also hold "reference": {"valid_perplexity": x, "valid_bleu": y}, a published result to compare with
(the file's REFERENCE string names its source); the results then gain ref_* columns and the chart shows each
variant's change from the first one, ours beside the reference.
Each variant trains in DIR/<name> with its resolved config saved there; a finished variant is skipped and an
interrupted one resumes from its checkpoints. --dry_run lists the variants, --print_commands prints one train.py
command per variant (for a cluster launcher), --only NAME runs one, --config.KEY=VALUE sets a config value in every
variant (a shared tokenizer, a data directory), as for train.py. Results are aggregated into DIR/results.csv,
DIR/results.md and DIR/results.png from the variants' metrics.jsonl. SIGTERM saves the running variant's checkpoint
and stops the sweep (exit status 1, results so far aggregated); the same command resumes it.
"""

from __future__ import annotations

import csv
import functools
import importlib.util
import json
import logging
import math
import os
import pathlib
import re
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import ml_collections
from absl import flags
from ml_collections import config_flags

from transformer_jax import config_checks
from transformer_jax.cli import USAGE_STATUS, fail, parse_flags
from transformer_jax.errors import ConfigError, VariantInterrupted, exit_on_user_error

RESULT_FILE = "sweep_result.json"
# A variant's name is a directory inside the sweep's workdir: no path separator, and never '.' or '..'.
NAME_PATTERN = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9_.=-]+")  # used with fullmatch
REFERENCE_METRICS = ("valid_perplexity", "valid_bleu")


class Variant(NamedTuple):
    name: str
    overrides: dict[str, Any]
    config: ml_collections.ConfigDict
    reference: dict[str, float]  # published numbers for this variant; empty if none


@functools.cache
def load_config_module(path: str):
    """Imports a config file by path (the part before ':'), once per path.

    config_flags loads the same file for --config but hands back only get_config()'s result; the sweep also needs
    the module's get_sweep(arg) and REFERENCE, and a fresh get_config(arg) for each variant.
    """
    file = pathlib.Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"sweep_config_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def variants(config_arg: str, common: dict[str, Any] | None = None) -> list[Variant]:
    """Every variant with its resolved config, each override and reference validated.

    `common` (--config.KEY=VALUE on the command line) applies to every variant before its own overrides.
    """
    path, _, arg = config_arg.partition(":")
    module = load_config_module(path)
    if not hasattr(module, "get_sweep"):
        raise ConfigError(f"config file {path} defines no get_sweep(arg); add one returning a list of override dicts")
    out, seen = [], set()
    for i, override in enumerate(module.get_sweep(arg or None)):
        override = dict(override)
        name = override.pop("name", None)
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise ConfigError(
                f"{path}: sweep entry {i} needs a 'name' of letters, digits, '_.=-' other than '.' and '..' "
                f"(it names a directory inside the sweep's workdir); got {name!r}"
            )
        if name in seen:
            raise ConfigError(f"{path}: sweep variant name {name!r} is used twice")
        seen.add(name)
        reference = dict(override.pop("reference", {}))
        unknown = sorted(set(reference) - set(REFERENCE_METRICS))
        if unknown:
            raise ConfigError(f"{path}: sweep variant {name!r}: reference keys {unknown}; known: {REFERENCE_METRICS}")
        config = module.get_config(arg or None)
        config.update_from_flattened_dict(common or {})
        for key, value in override.items():
            try:
                config.update_from_flattened_dict({key: value})
            except (KeyError, AttributeError) as e:
                raise ConfigError(f"{path}: sweep variant {name!r} overrides unknown key {key!r} ({e})") from e
            except TypeError as e:
                raise ConfigError(f"{path}: sweep variant {name!r}: {key}={value!r} has the wrong type ({e})") from e
        try:
            config_checks.validate(config)
        except ConfigError as e:
            raise ConfigError(f"{path}: sweep variant {name!r}: {e}") from e
        out.append(Variant(name, override, config, reference))
    return out


def variant_dir(workdir: pathlib.Path, name: str) -> pathlib.Path:
    """DIR/<name>; ConfigError if that is not a directory directly inside DIR (a name such as '..' or 'a/b')."""
    inside = pathlib.Path(os.path.normpath(workdir / name))
    if not NAME_PATTERN.fullmatch(name) or inside.parent != pathlib.Path(os.path.normpath(workdir)):
        raise ConfigError(f"sweep variant name {name!r} is not a directory name inside the sweep workdir {workdir}")
    return inside


def train_command(config_arg: str, workdir: pathlib.Path, name: str, overrides: dict[str, Any]) -> str:
    args = ["python", "train.py", f"--config={config_arg}", f"--workdir={variant_dir(workdir, name)}"]
    args += [f"--config.{k}={v}" for k, v in overrides.items()]
    return shlex.join(args)


def run_variant(name: str, config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict[str, Any]:
    """Trains one variant (resuming if interrupted) and writes its result file; skips a finished one."""
    from transformer_jax.training import loop
    from transformer_jax.training.checkpoints import list_steps

    result_path = workdir / RESULT_FILE
    if result_path.exists():
        result = json.loads(result_path.read_text())
        if result.get("num_steps") == config.train.num_steps:
            logging.info("sweep: %s already finished; skipping", name)
            return result
    start = time.time()
    loop.train_and_evaluate(config, workdir)
    # train_and_evaluate returns early on SIGTERM; such a variant is not finished and must not be skipped later.
    reached = max(list_steps(workdir), default=0)
    if reached < config.train.num_steps:
        raise VariantInterrupted(f"variant {name} stopped at step {reached} of {config.train.num_steps}")
    # Wall time of the attempt that finished (a resumed variant's earlier attempts are not counted).
    result = {"name": name, "num_steps": config.train.num_steps, "wall_s": time.time() - start}
    result_path.write_text(json.dumps(result))
    return result


def summarize_variant(variant: Variant, run_dir: pathlib.Path) -> dict:
    """One results row from a variant's directory (empty fields where it has not run)."""
    name, overrides, config, reference = variant
    import jax
    from flax import nnx

    from transformer_jax.model import build_model
    from transformer_jax.training.metrics import read_metrics

    model = nnx.eval_shape(lambda: build_model(config, rngs=nnx.Rngs(0)))
    row: dict[str, Any] = {
        "variant": name,
        "overrides": " ".join(f"{k}={v}" for k, v in overrides.items()) or "(none)",
        "parameters": sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
        "steps": "",
        "valid_perplexity": "",
        "valid_bleu": "",
        "tokens_per_s": "",
        "wall_s": "",
    }
    metrics_file = run_dir / "metrics.jsonl"
    if metrics_file.exists():
        records = read_metrics(metrics_file)
        train = [r for r in records if "tokens_per_s" in r]
        if train:
            row["steps"] = train[-1]["step"]
            row["tokens_per_s"] = round(sum(r["tokens_per_s"] for r in train) / len(train), 1)
        for key, column in (("valid_perplexity", "valid_perplexity"), ("valid_bleu", "valid_bleu")):
            found = [r[key] for r in records if key in r]
            if found:
                row[column] = round(found[-1], 2)
    if (run_dir / RESULT_FILE).exists():
        row["wall_s"] = round(json.loads((run_dir / RESULT_FILE).read_text())["wall_s"], 1)
    for key in REFERENCE_METRICS:
        row["ref_" + key] = reference.get(key, "")
    return row


def write_results(rows: list[dict], workdir: pathlib.Path, reference_label: str = "reference") -> None:
    """results.csv, results.md and results.png (validation perplexity and BLEU per variant)."""
    if not any(row["ref_" + key] != "" for row in rows for key in REFERENCE_METRICS):
        rows = [{k: v for k, v in row.items() if not k.startswith("ref_")} for row in rows]
    columns = list(rows[0])
    with open(workdir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    (workdir / "results.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, max(3, 0.35 * len(rows) + 1.5)), dpi=100)
    if "ref_valid_bleu" not in columns:
        for ax, key, label in ((axes[0], "valid_perplexity", "validation perplexity"), (axes[1], "valid_bleu", "BLEU")):
            ax.barh(names, [_number(r[key]) for r in rows], color="tab:blue")
            ax.set_xlabel(label)
    else:
        # Scales differ (model size, data, steps), so compare each variant's change from the first variant.
        panels = (
            (axes[0], "valid_perplexity", lambda x, x0: 100 * (x / x0 - 1), "validation perplexity, % change from "),
            (axes[1], "valid_bleu", lambda x, x0: x - x0, "BLEU, change in points from "),
        )
        positions = range(len(rows))
        for ax, key, change, label in panels:
            largest = 0.0
            for offset, prefix, color, who in ((-0.2, "", "tab:blue", "this run"), (0.2, "ref_", "tab:gray", "")):
                x0 = _number(rows[0][prefix + key])
                values = [change(_number(r[prefix + key]), x0) if x0 and r[prefix + key] != "" else 0.0 for r in rows]
                ax.barh([p + offset for p in positions], values, height=0.4, color=color, label=who or reference_label)
                largest = max([largest, *map(abs, values)])
            ax.axvline(0.0, color="black", linewidth=0.8)
            ax.set_yticks(list(positions), names)
            ax.set_xlabel(label + names[0])
            if key == "valid_perplexity" and largest > 100:
                # One run that failed to learn (+300%) would flatten every other bar to a sliver.
                ax.set_xscale("symlog", linthresh=50)
                ticks = [-50, -25, 0, 25, 50] + [100 * 2**k for k in range(int(math.log2(largest / 100)) + 2)]
                ax.set_xticks(ticks, [f"{t:+d}" if t else "0" for t in ticks])
                ax.set_xlabel(label + names[0] + " (linear to ±50%, logarithmic beyond)")
        axes[0].legend(loc="lower right")
    for ax in axes:
        ax.invert_yaxis()
    axes[1].set_yticklabels([])
    fig.tight_layout()
    fig.savefig(workdir / "results.png")
    plt.close(fig)


def _number(value: Any) -> float:
    return float(value) if value != "" else 0.0


PROG = "python -m transformer_jax.sweep"


def _flag_values(argv: Sequence[str]) -> flags.FlagValues:
    """The sweep's flags, in a FlagValues of their own: each call of `main` parses afresh (tests call it many
    times in one process), and importing this module defines nothing in the global absl FLAGS."""
    fv = flags.FlagValues()
    # config_flags reads argv to define the --config.KEY=VALUE override flags.
    config_flags.DEFINE_config_file(
        "config", None, "configs/<file>.py[:arg] defining get_sweep(arg)", flag_values=fv, sys_argv=list(argv)
    )
    flags.DEFINE_string("workdir", None, "one sub-directory per variant is made here", flag_values=fv)
    flags.DEFINE_bool("dry_run", False, "list the variants and their overrides, run nothing", flag_values=fv)
    flags.DEFINE_bool("print_commands", False, "print one train.py command per variant", flag_values=fv)
    flags.DEFINE_string("only", None, "run only the variant with this name", flag_values=fv)
    flags.DEFINE_bool("aggregate_only", False, "only rebuild results.csv/md/png", flag_values=fv)
    flags.mark_flags_as_required(["config", "workdir"], flag_values=fv)
    return fv


def main(argv: Sequence[str] | None = None) -> int:
    """argv: the flags (sys.argv[1:] when None). Exit status 1 if a variant was interrupted, 2 for a bad input."""
    argv = [PROG, *(sys.argv[1:] if argv is None else argv)]
    fv = _flag_values(argv)
    rest = parse_flags(PROG, argv, fv, usage=__doc__)
    if len(rest) > 1:
        fail(PROG, f"unexpected arguments: {rest[1:]}")
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("absl").setLevel(logging.WARNING)
    with exit_on_user_error(PROG, USAGE_STATUS):
        return _run(fv)


def _run(fv: flags.FlagValues) -> int:
    config_arg = config_flags.get_config_filename(fv["config"])
    common = config_flags.get_override_values(fv["config"])
    workdir = pathlib.Path(fv.workdir)
    all_variants = variants(config_arg, common)
    names = [v.name for v in all_variants]
    if fv.only is not None and fv.only not in names:
        raise ConfigError(f"--only {fv.only!r}: no such variant; the variants are {names}")
    chosen = [v for v in all_variants if fv.only in (None, v.name)]
    if fv.dry_run:
        for v in chosen:
            print(f"{v.name}: {json.dumps(v.overrides)}")
        return 0
    if fv.print_commands:
        for v in chosen:
            print(train_command(config_arg, workdir, v.name, {**common, **v.overrides}))
        return 0
    config_checks.check_workdir(workdir)
    interrupted = None
    if not fv.aggregate_only:
        for v in chosen:
            logging.info("sweep: variant %s", v.name)
            try:
                run_variant(v.name, v.config, variant_dir(workdir, v.name))
            except VariantInterrupted as e:
                interrupted = e
                break
    rows = [summarize_variant(v, variant_dir(workdir, v.name)) for v in all_variants]
    label = getattr(load_config_module(config_arg.partition(":")[0]), "REFERENCE", "reference")
    write_results(rows, workdir, reference_label=label)
    print((workdir / "results.md").read_text())
    if interrupted:
        print(f"sweep interrupted: {interrupted}; run the same command to resume it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
