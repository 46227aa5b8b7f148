"""What a sweep runs: its variants (config overrides), their seeds and directories, and training and decoding one
run. The command line over it is transformer_jax/sweep/__main__.py."""

from __future__ import annotations

import functools
import json
import logging
import os
import pathlib
import re
import shlex
import signal
import time
from typing import Any, NamedTuple

import jax
import ml_collections

from transformer_jax.config import checks, loading
from transformer_jax.errors import ConfigError, VariantInterrupted
from transformer_jax.evaluation import run
from transformer_jax.evaluation.command import Model, Translate, write_json, write_lines
from transformer_jax.evaluation.restore import CheckpointChoice
from transformer_jax.evaluation.validation import bleu_evaluator
from transformer_jax.sweep import code
from transformer_jax.sweep.results import REFERENCE_METRICS, RESULT_FILE, decoded
from transformer_jax.sweep.splits import Split
from transformer_jax.training import loop
from transformer_jax.training.checkpoints import list_steps

PROG = "python -m transformer_jax.sweep"  # the command line, and the prefix of its jobs' one-line errors
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
    return loading.load_module(path, f"sweep_config_{pathlib.Path(path).stem}")


def variants(config_arg: str, common: dict[str, Any] | None = None) -> list[Variant]:
    """Every variant with its resolved config, each override and reference validated.

    `common` (--config.KEY=VALUE on the command line) applies to every variant before its own overrides.
    """
    path, _, arg = config_arg.partition(":")
    module = load_config_module(path)
    if not hasattr(module, "get_sweep"):
        raise ConfigError(f"config file {path} defines no get_sweep(arg); add one returning a list of override dicts")
    out, seen = [], set()
    for i, override in enumerate(loading.call(module, path, "get_sweep", arg or None)):
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
        config = loading.call(module, path, "get_config", arg or None)
        config.update_from_flattened_dict(common or {})
        for key, value in override.items():
            try:
                config.update_from_flattened_dict({key: value})
            except (KeyError, AttributeError) as e:
                raise ConfigError(f"{path}: sweep variant {name!r} overrides unknown key {key!r} ({e})") from e
            except TypeError as e:
                raise ConfigError(f"{path}: sweep variant {name!r}: {key}={value!r} has the wrong type ({e})") from e
        try:
            checks.validate(config, training=True)  # as train.py validates its config: the sweep trains them
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
    """The variant's runs. One seed: the variant's own config, in today's layout. Several: copies that differ from
    the validated variant in the seed keys alone, which are checked here."""
    if seeds == 1:
        return [Run(variant, 0, variant.name, {}, variant.config)]
    out = []
    for i in range(seeds):
        overrides = seed_overrides(variant.config, i)
        config = variant.config.copy_and_resolve_references()
        config.update_from_flattened_dict(overrides)
        try:
            for key, value in overrides.items():
                checks.check_value(key, value)
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
    result_path = workdir / RESULT_FILE
    if result_path.exists():
        result = json.loads(result_path.read_text())
        if result.get("num_steps") == config.train.num_steps:
            logging.info("sweep: %s already finished; skipping", name)
            return result
    start = time.time()
    stopped_early_at = loop.train_and_evaluate(config, workdir, bleu=bleu_evaluator).get(loop.STOPPED_EARLY_AT)
    # train_and_evaluate returns early on SIGTERM; such a variant is not finished and must not be skipped later.
    # One that early stopping ended is finished (a rerun would train nothing).
    reached = max(list_steps(workdir), default=0)
    if reached < config.train.num_steps and stopped_early_at is None:
        raise VariantInterrupted(f"variant {name} stopped at step {reached} of {config.train.num_steps}")
    # Wall time of the attempt that finished (a resumed variant's earlier attempts are not counted).
    result = {"name": name, "num_steps": config.train.num_steps, "wall_s": time.time() - start}
    if stopped_early_at is not None:
        result[loop.STOPPED_EARLY_AT] = stopped_early_at
    result_path.write_text(json.dumps(result))
    return result


class _Terminated(Exception):
    """SIGTERM arrived while a run was decoding."""


def _raise_terminated(*_) -> None:
    raise _Terminated


def decode_run(name: str, run_dir: pathlib.Path, split: Split) -> None:
    """Translates the whole split with a finished run's last checkpoint and stores hypotheses and scores
    (valid.hyp, then valid_scores.json; test.*); skips a run already decoded. SIGTERM raises VariantInterrupted."""
    if decoded(run_dir, split):
        return
    logging.info("sweep: %s: decoding the %s split", name, split.description)
    # The last checkpoint: the paper's Table 3 averages none.
    mode = Translate(Model(str(run_dir), choice=CheckpointChoice(average_last=1)), split=split.name)
    (run_dir / split.scores_file).unlink(missing_ok=True)  # a stale report must not pass for the new hypotheses
    # Unlike training, a decode cannot save its progress; SIGTERM abandons it (hypotheses are written only at its end).
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        translation = translate(mode)
    except _Terminated:
        raise VariantInterrupted(f"variant {name} stopped while decoding the {split.description} split") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    hypotheses = run_dir / split.hypotheses_file
    write_lines(hypotheses, translation.hypotheses)
    write_json(run_dir / split.scores_file, {**translation.report, "hypotheses_file": str(hypotheses)})


def configure_logging() -> None:
    """The sweep's logging, in its command line and in its jobs: INFO, absl's only from WARNING (orbax logs every
    file it renames at INFO)."""
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("absl").setLevel(logging.WARNING)


def train_and_decode(label: str, config: ml_collections.ConfigDict, run_dir: pathlib.Path, split: Split) -> None:
    """One run as every launcher runs it (in the sweep's process, or as a job): records the code version, trains
    (resuming; a finished run is skipped) and decodes the splits the reported split needs (split.decodes: the
    validation split, then the test split for --split test; each one skipped if already decoded). SIGTERM raises
    VariantInterrupted."""
    if jax.process_index() == 0:  # the hosts of a multi-host run share its directory
        code.record(run_dir)
    run_variant(label, config, run_dir)
    for each in split.decodes:
        decode_run(label, run_dir, each)


def translate(mode: Translate) -> run.Translation:
    """evaluate.py's translation and scores (the library, evaluation.run), with a progress bar."""
    return run.translate(mode, run.load(mode), progress=True)
