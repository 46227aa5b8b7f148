"""What a sweep runs: its variants (config overrides), their seeds and directories, training and decoding one run,
and the code version each run records (with the package snapshot queued jobs import)."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import time
from typing import Any, NamedTuple

import jax
import ml_collections

import transformer_jax
from transformer_jax import cli, runtime
from transformer_jax.errors import ConfigError, VariantInterrupted
from transformer_jax.evaluation import run
from transformer_jax.evaluation.restore import CheckpointChoice
from transformer_jax.evaluation.run import Model, Translate
from transformer_jax.evaluation.translate import bleu_evaluator
from transformer_jax.sweep.results import REFERENCE_METRICS, RESULT_FILE, Split, decoded
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
    """Imports a config file by path (the part before ':') once: the sweep needs its get_sweep(arg), SEEDS and
    REFERENCE, and a fresh get_config(arg) for each variant, where --config hands back one get_config() result."""
    return cli.load_module(path, f"sweep_config_{pathlib.Path(path).stem}")


def variants(config_arg: str, common: dict[str, Any] | None = None) -> list[Variant]:
    """Every variant with its resolved config, each override and reference validated; `common` (--config.KEY=VALUE
    on the command line) applies to every variant before its own overrides."""
    path, _, arg = config_arg.partition(":")
    module = load_config_module(path)
    if not hasattr(module, "get_sweep"):
        raise ConfigError(f"config file {path} defines no get_sweep(arg); add one returning a list of override dicts")
    out: list[Variant] = []
    for i, override in enumerate(cli.call(module, path, "get_sweep", arg or None)):
        override = dict(override)
        name = override.pop("name", None)
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise ConfigError(
                f"{path}: sweep entry {i} needs a 'name' of letters, digits, '_.=-' other than '.' and '..' "
                f"(it names a directory inside the sweep's workdir); got {name!r}"
            )
        if any(v.name == name for v in out):
            raise ConfigError(f"{path}: sweep variant name {name!r} is used twice")
        reference = dict(override.pop("reference", {}))
        unknown = sorted(set(reference) - set(REFERENCE_METRICS))
        if unknown:
            raise ConfigError(f"{path}: sweep variant {name!r}: reference keys {unknown}; known: {REFERENCE_METRICS}")
        config = cli.call(module, path, "get_config", arg or None)
        config.update_from_flattened_dict(common or {})
        for key, value in override.items():
            try:
                config.update_from_flattened_dict({key: value})
            except (KeyError, AttributeError) as e:
                raise ConfigError(f"{path}: sweep variant {name!r} overrides unknown key {key!r} ({e})") from e
            except TypeError as e:
                raise ConfigError(f"{path}: sweep variant {name!r}: {key}={value!r} has the wrong type ({e})") from e
        try:
            cli.validate(config, training=True)  # as train.py validates its config: the sweep trains them
        except ConfigError as e:
            raise ConfigError(f"{path}: sweep variant {name!r}: {e}") from e
        out.append(Variant(name, override, config, reference))
    return out


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


class Run(NamedTuple):
    """One (variant, seed) training run."""

    variant: Variant
    label: str  # "NAME" with one seed, else "NAME/seedI": also its directory inside the sweep's DIR
    overrides: dict[str, Any]  # the seed's config values on top of the variant's overrides ({} with one seed)
    config: ml_collections.ConfigDict


def runs(variant: Variant, seeds: int) -> list[Run]:
    """The variant's runs. One seed: the variant's own config. Several: seed i adds i to train.seed (parameter init
    and dropout) and data.shuffle_seed (data order), so seed 0 is the config itself and seed i of every variant
    shares init and data order; only these keys differ from the validated variant, and are checked here."""
    if seeds == 1:
        return [Run(variant, variant.name, {}, variant.config)]
    out = []
    for i in range(seeds):
        overrides = {
            "train.seed": variant.config.train.seed + i,
            "data.shuffle_seed": variant.config.data.shuffle_seed + i,
        }
        config = variant.config.copy_and_resolve_references()
        config.update_from_flattened_dict(overrides)
        try:
            for key, value in overrides.items():
                cli.check_value(key, value)
        except ConfigError as e:
            raise ConfigError(f"sweep variant {variant.name!r}, seed {i} of --seeds {seeds}: {e}") from e
        out.append(Run(variant, f"{variant.name}/seed{i}", overrides, config))
    return out


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
    runtime.write_lines(hypotheses, translation.hypotheses)
    runtime.write_json(run_dir / split.scores_file, {**translation.report, "hypotheses_file": str(hypotheses)})


def configure_logging() -> None:
    """The sweep's logging (command line and jobs): INFO; absl's from WARNING (orbax logs every rename at INFO)."""
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("absl").setLevel(logging.WARNING)


def train_and_decode(label: str, config: ml_collections.ConfigDict, run_dir: pathlib.Path, split: Split) -> None:
    """One run as every launcher runs it: records the code version, trains (resuming; skipped when finished) and
    decodes split.decodes (validation, then test for --split test; each skipped if decoded). SIGTERM raises
    VariantInterrupted."""
    if jax.process_index() == 0:  # the hosts of a multi-host run share its directory
        record_code_version(run_dir)
    run_variant(label, config, run_dir)
    for each in split.decodes:
        decode_run(label, run_dir, each)


def translate(mode: Translate) -> run.Translation:
    """evaluate.py's translation and scores (the library, evaluation.run), with a progress bar."""
    return run.translate(mode, run.load(mode), progress=True)


# The code a run ran. A job of the local or SLURM launcher may start hours after submission, when the checkout has
# changed, so it imports a copy of the package taken at submission (`snapshot_code`). submitit's RsyncSnapshot needs
# rsync and copies only files git tracks (a module not yet added would be missing); copying the folder keeps all.
VERSION_FILE = "code_version.json"  # in a run directory: one entry per attempt that ran different code
SNAPSHOT_VERSION = "version.json"  # in a snapshot: the version of the checkout it was copied from
SNAPSHOT_DIFF = "code.diff"


def package_root() -> pathlib.Path:
    """The folder of the transformer_jax package this process imported (a checkout's, or a snapshot's)."""
    return pathlib.Path(transformer_jax.__file__).resolve().parent


def _git(root: pathlib.Path, *args: str, ok: tuple[int, ...] = (0,)) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
    except OSError:  # no git on this machine
        return None
    return done.stdout if done.returncode in ok else None


def code_version() -> tuple[dict[str, Any], str]:
    """The version of the code this process runs and its uncommitted diff (text, possibly empty).

    In a snapshot: the version recorded when it was taken. Otherwise from git: {"commit", "dirty", "untracked"
    (files git does not track, whose content the diff includes), "source"}; commit is None outside a git checkout.
    """
    root = package_root().parent
    if (root / SNAPSHOT_VERSION).exists():
        return json.loads((root / SNAPSHOT_VERSION).read_text()), (root / SNAPSHOT_DIFF).read_text()
    commit = _git(root, "rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None, "untracked": [], "source": str(root)}, ""
    diff = _git(root, "diff", "HEAD", "--binary") or ""
    untracked = sorted(
        name
        for name in (_git(root, "ls-files", "--others", "--exclude-standard") or "").splitlines()
        if name.startswith(f"{package_root().name}/") and "__pycache__" not in name
    )
    for name in untracked:  # `git diff` leaves out files it does not track; a new module is code that ran
        diff += _git(root, "diff", "--no-index", "--binary", "--", "/dev/null", name, ok=(0, 1)) or ""
    version = {"commit": commit.strip(), "dirty": bool(diff), "untracked": untracked, "source": str(root)}
    return version, diff


def record_code_version(run_dir: pathlib.Path) -> dict[str, Any]:
    """Adds this process's code version to run_dir/code_version.json unless the last attempt recorded ran the same
    code; its diff goes in run_dir/code-<hash>.diff. Returns the entry."""
    version, diff = code_version()
    entry = {**version, "diff_file": f"code-{hashlib.sha256(diff.encode()).hexdigest()[:12]}.diff" if diff else None}
    path = run_dir / VERSION_FILE
    attempts = json.loads(path.read_text()) if path.exists() else []
    if not attempts or attempts[-1] != entry:
        run_dir.mkdir(parents=True, exist_ok=True)
        if diff:
            (run_dir / entry["diff_file"]).write_text(diff)
        path.write_text(json.dumps([*attempts, entry], indent=1) + "\n")
    return entry


def snapshot_code(directory: pathlib.Path) -> pathlib.Path:
    """A copy of the package in directory/<content hash>/transformer_jax, with the checkout's version beside it;
    returns directory/<content hash>, the folder a job puts first on its import path. Taken once per content."""
    source = package_root()
    files = sorted(p for p in source.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(source)).encode() + b"\0" + path.read_bytes())
    target = directory / digest.hexdigest()[:16]
    if (target / SNAPSHOT_VERSION).exists():
        return target
    version, diff = code_version()
    staging = directory / f".{target.name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging / "transformer_jax", ignore=shutil.ignore_patterns("__pycache__"))
    (staging / SNAPSHOT_DIFF).write_text(diff)
    (staging / SNAPSHOT_VERSION).write_text(json.dumps({**version, "snapshot": str(target)}, indent=1) + "\n")
    try:
        os.replace(staging, target)  # whole or not at all: a job never imports a half-copied package
    except OSError:  # another sweep command took the same snapshot meanwhile
        shutil.rmtree(staging, ignore_errors=True)
    return target
