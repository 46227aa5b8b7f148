"""Run a config's sweep: python -m transformer_jax.sweep --config configs/<file>.py[:arg] --workdir DIR

A config file's `get_sweep(arg)` returns a list of dicts: {"name": readable-name, "<dotted.key>": value, ...}.
An entry may also hold "reference": {"valid_perplexity": x, "valid_bleu": y}, a published result to compare with
(the file's REFERENCE string names its source); the results then gain ref_* columns and the chart shows each
variant's change from the first one, ours beside the reference.
Each variant trains in DIR/<name> with its resolved config saved there; a finished variant is skipped and an
interrupted one resumes from its checkpoints. --dry_run lists the variants, --print_commands prints one train.py
command per variant (for a cluster launcher), --only NAME runs one, --config.KEY=VALUE sets a config value in every
variant (a shared tokenizer, a data directory), as for train.py. Results are aggregated into DIR/results.csv,
DIR/results.md and DIR/results.png from the runs' metrics.jsonl and stored validation translations. SIGTERM saves
the running variant's checkpoint and stops the sweep (exit status 1, results so far aggregated); the same command
resumes it.

Seeds: --seeds N (or a top-level `SEEDS = N` in the config file; the flag wins) runs every variant N times. Seed i
(0 .. N-1) sets train.seed and data.shuffle_seed to the config's values plus i, so it changes the parameter init,
the dropout masks and the data order, and seed i of every variant shares them. With N > 1 run i of NAME trains in
DIR/NAME/seed<i> (with N = 1 in DIR/NAME, as before seeds existed); each run is skipped or resumed on its own, and
--only NAME runs all seeds of NAME. The results then give mean ± standard deviation over the finished seeds with
Δ and its confidence interval against the first variant (transformer_jax/sweep_results.py says how).

Decoding: after a run's training finishes, the sweep translates the whole validation split with the run's last
checkpoint, no averaging (as the paper's Table 3), and the config's beam search (config.eval: beam_size, alpha,
max_extra_len, batch_size), through evaluate.py's path (`evaluation.run.evaluate_model`). The hypotheses and the
report go in the run directory (valid.hyp, valid_scores.json); a run is finished once both exist, and a finished
run from before this step gets them on the next invocation. BLEU and chrF in the results come from them, and so
does the paired bootstrap of each variant against the first (transformer_jax/sweep_significance.py), which
--aggregate_only recomputes without decoding. SIGTERM while decoding stops the sweep like SIGTERM while training;
the decoding starts anew next time.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pathlib
import re
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import ml_collections
from absl import flags
from ml_collections import config_flags

from transformer_jax import config_checks, config_files, sweep_significance
from transformer_jax.cli import USAGE_STATUS, fail, parse_flags
from transformer_jax.errors import ConfigError, VariantInterrupted, exit_on_user_error
from transformer_jax.sweep_results import (
    HYPOTHESES_FILE,
    REFERENCE_METRICS,
    RESULT_FILE,
    SCORES_FILE,
    aggregate_seeds,
    decoded,
    parameter_count,
    run_metrics,
    summarize_variant,
    write_results,
)

# A variant's name is a directory inside the sweep's workdir: no path separator, and never '.' or '..'.
NAME_PATTERN = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9_.=-]+")  # used with fullmatch


class Variant(NamedTuple):
    name: str
    overrides: dict[str, Any]
    config: ml_collections.ConfigDict
    reference: dict[str, float]  # published numbers for this variant; empty if none


@functools.cache
def load_config_module(path: str):
    """Imports a config file by path (the part before ':'), once per path, with the loader of every command.

    The --config flag hands back only get_config()'s result; the sweep also needs the module's get_sweep(arg) and
    REFERENCE, and a fresh get_config(arg) for each variant.
    """
    return config_files.load_module(path, f"sweep_config_{pathlib.Path(path).stem}")


def variants(config_arg: str, common: dict[str, Any] | None = None) -> list[Variant]:
    """Every variant with its resolved config, each override and reference validated.

    `common` (--config.KEY=VALUE on the command line) applies to every variant before its own overrides.
    """
    path, _, arg = config_arg.partition(":")
    module = load_config_module(path)
    if not hasattr(module, "get_sweep"):
        raise ConfigError(f"config file {path} defines no get_sweep(arg); add one returning a list of override dicts")
    out, seen = [], set()
    for i, override in enumerate(config_files.call(module, path, "get_sweep", arg or None)):
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
        config = config_files.call(module, path, "get_config", arg or None)
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


def train_command(config_arg: str, run_dir: pathlib.Path, overrides: dict[str, Any]) -> str:
    args = ["python", "train.py", f"--config={config_arg}", f"--workdir={run_dir}"]
    args += [f"--config.{k}={v}" for k, v in overrides.items()]
    return shlex.join(args)


def num_seeds(config_arg: str, flag: int | None) -> int:
    """--seeds if given, else the config file's top-level SEEDS, else 1."""
    if flag is not None:
        return flag
    path = config_arg.partition(":")[0]
    seeds = getattr(load_config_module(path), "SEEDS", 1)
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ConfigError(f"{path}: SEEDS = {seeds!r}; it must be a whole number >= 1 (seeds per variant)")
    return seeds


def seed_overrides(config: ml_collections.ConfigDict, index: int) -> dict[str, int]:
    """Seed `index` of a variant: train.seed (parameter init and dropout) and data.shuffle_seed (data order) of its
    config, each plus `index`. Seed 0 is the config itself, so seed i of every variant shares init and data order."""
    return {"train.seed": config.train.seed + index, "data.shuffle_seed": config.data.shuffle_seed + index}


class Run(NamedTuple):
    """One (variant, seed) training run."""

    variant: Variant
    seed: int  # index: 0 .. seeds-1
    label: str  # "NAME" with one seed, else "NAME/seedI"
    overrides: dict[str, Any]  # the seed's config values on top of the variant's overrides ({} with one seed)
    config: ml_collections.ConfigDict


def runs(variant: Variant, seeds: int) -> list[Run]:
    """The variant's runs, each config validated. One seed: the variant's own config, in today's layout."""
    if seeds == 1:
        return [Run(variant, 0, variant.name, {}, variant.config)]
    out = []
    for i in range(seeds):
        overrides = seed_overrides(variant.config, i)
        config = variant.config.copy_and_resolve_references()
        config.update_from_flattened_dict(overrides)
        try:
            config_checks.validate(config)
        except ConfigError as e:
            raise ConfigError(f"sweep variant {variant.name!r}, seed {i} of --seeds {seeds}: {e}") from e
        out.append(Run(variant, i, f"{variant.name}/seed{i}", overrides, config))
    return out


def run_dir(workdir: pathlib.Path, run: Run, seeds: int) -> pathlib.Path:
    """DIR/NAME with one seed (so sweeps from before seeds resume), DIR/NAME/seedI with several."""
    directory = variant_dir(workdir, run.variant.name)
    return directory if seeds == 1 else directory / f"seed{run.seed}"


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


class _Terminated(Exception):
    """SIGTERM arrived while a run was decoding."""


def _raise_terminated(*_) -> None:
    raise _Terminated


def decode_run(name: str, run_dir: pathlib.Path) -> None:
    """Translates the whole validation split with a finished run's last checkpoint and stores hypotheses and scores
    (valid.hyp, then valid_scores.json); skips a run already decoded. SIGTERM raises VariantInterrupted."""
    from transformer_jax.evaluation.run import Options, evaluate_model

    if decoded(run_dir):
        return
    logging.info("sweep: %s: decoding the validation split", name)
    options = Options(
        workdir=str(run_dir),
        split="valid",
        average_last=1,  # the last checkpoint: the paper's Table 3 averages none
        output_file=str(run_dir / HYPOTHESES_FILE),
        scores_file=str(run_dir / SCORES_FILE),
    )
    (run_dir / SCORES_FILE).unlink(missing_ok=True)  # a stale report must not pass for the new hypotheses
    # Unlike training, a decode cannot save its progress; SIGTERM abandons it (hypotheses are written only at its end).
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        evaluate_model(options)
    except _Terminated:
        raise VariantInterrupted(f"variant {name} stopped while decoding the validation split") from None
    finally:
        signal.signal(signal.SIGTERM, previous)


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
    flags.DEFINE_integer(
        "seeds",
        None,
        "run every variant with this many seeds (default: the config file's SEEDS, else 1); "
        "seed i adds i to train.seed and data.shuffle_seed",
        lower_bound=1,
        flag_values=fv,
    )
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
    seeds = num_seeds(config_arg, fv.seeds)
    all_runs = {v.name: runs(v, seeds) for v in all_variants}
    names = [v.name for v in all_variants]
    if fv.only is not None and fv.only not in names:
        raise ConfigError(f"--only {fv.only!r}: no such variant; the variants are {names}")
    chosen = [r for v in all_variants if fv.only in (None, v.name) for r in all_runs[v.name]]
    if fv.dry_run:
        for r in chosen:
            print(f"{r.label}: {json.dumps({**r.variant.overrides, **r.overrides})}")
        return 0
    if fv.print_commands:
        for r in chosen:
            print(
                train_command(config_arg, run_dir(workdir, r, seeds), {**common, **r.variant.overrides, **r.overrides})
            )
        return 0
    config_checks.check_workdir(workdir)
    interrupted = None
    if not fv.aggregate_only:
        for r in chosen:
            logging.info("sweep: variant %s", r.label)
            try:
                run_variant(r.label, r.config, run_dir(workdir, r, seeds))
                decode_run(r.label, run_dir(workdir, r, seeds))
            except VariantInterrupted as e:
                interrupted = e
                break
    if seeds == 1:
        rows = [summarize_variant(v, variant_dir(workdir, v.name)) for v in all_variants]
    else:
        rows = aggregate_seeds([_seed_runs(v, all_runs[v.name], workdir, seeds) for v in all_variants], seeds)
    finished = [
        [d if decoded(d) else None for d in (run_dir(workdir, r, seeds) for r in all_runs[v.name])]
        for v in all_variants
    ]
    rows = sweep_significance.add_significance(rows, finished, _references(all_variants, finished))
    label = getattr(load_config_module(config_arg.partition(":")[0]), "REFERENCE", "reference")
    write_results(rows, workdir, reference_label=label)
    print((workdir / "results.md").read_text())
    if interrupted:
        print(f"sweep interrupted: {interrupted}; run the same command to resume it", file=sys.stderr)
        return 1
    return 0


def _references(all_variants: list[Variant], finished: list[list[pathlib.Path | None]]) -> list[list[str] | None]:
    """Each variant's validation references (None for a variant with no finished run), read once per data config."""
    cache: dict[str, list[str]] = {}
    out = []
    for variant, runs_done in zip(all_variants, finished, strict=True):
        if not any(runs_done):
            out.append(None)
            continue
        key = json.dumps(variant.config.data.to_dict(), sort_keys=True, default=str)
        if key not in cache:
            cache[key] = sweep_significance.references_of(variant.config)
        out.append(cache[key])
    return out


def _seed_runs(variant: Variant, variant_runs: list[Run], workdir: pathlib.Path, seeds: int) -> dict[str, Any]:
    """aggregate_seeds' input for one variant: its description and each seed's metrics."""
    entry: dict[str, Any] = {
        "variant": variant.name,
        "overrides": " ".join(f"{k}={v}" for k, v in variant.overrides.items()) or "(none)",
        "parameters": parameter_count(variant.config),
        "runs": [run_metrics(run_dir(workdir, r, seeds)) for r in variant_runs],
    }
    entry.update({"ref_" + key: variant.reference.get(key, "") for key in REFERENCE_METRICS})
    return entry


if __name__ == "__main__":
    sys.exit(main())
