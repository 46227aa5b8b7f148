"""Starting a run from another run's parameters (fine-tuning): `train.init_from=WORKDIR`, `train.init_step`.

The source's checkpoint gives the model's parameters; step, optimizer state, schedule, dropout RNG and data order
start fresh. The `architecture` keys of config/schema.py come from the source's saved config; every other key is
the run's own. The one exception: data.add_languages grows model.vocab_size by exactly the languages it adds and
appends their codes to model.language_codes (training/add_languages.py); an override of either is still refused.
The source's tokenizer is copied into the workdir, so a run with a checkpoint of its own never reads
the source again, but under LoRA (opt.lora_rank > 0): the source is its frozen base, read again at every restart
and checked against the checkpoint's record of it (training/checkpoints.py load_base). `prepare` checks everything
before writing anything; the source is only read.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import ml_collections
from flax.traverse_util import flatten_dict

from transformer_jax import cli
from transformer_jax.config import schema
from transformer_jax.data import languages
from transformer_jax.data.sources import atomic_write
from transformer_jax.data.tokenizer import MODEL_FILENAME, tokenizer_files
from transformer_jax.errors import CheckpointError, ConfigError
from transformer_jax.model.lora import LoRASpec
from transformer_jax.training import add_languages, checkpoints
from transformer_jax.training.step import abstract_train_state

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Start:
    """How a run starts: its config (with the source's architecture when it fine-tunes) and, for a fine-tuning run
    without a checkpoint of its own yet, the source's model parameters (a pure dict) and their step."""

    config: ml_collections.ConfigDict
    params: dict | None = None
    source_step: int | None = None


def prepare(config: ml_collections.ConfigDict, workdir: str | os.PathLike, overrides: Iterable[str] = ()) -> Start:
    """A fine-tuning run's start (config.train.init_from set): the architecture keys and the tokenizer come from the
    run's own latest checkpoint, else from the source, whose parameters are then read; `overrides` (--config.KEY)
    may not differ."""
    workdir = pathlib.Path(workdir)
    source = pathlib.Path(config.train.init_from).expanduser().resolve()
    config = _copy(config, {"train.init_from": str(source)})  # a restart from another directory names the same
    overrides = set(overrides)
    own = _own_config(workdir)
    if own is not None:
        _check_same_run(own, config, workdir)
        where = f"the checkpoint in --workdir {workdir}"
        merged = _merged(config, own, overrides, where, _workdir_tokenizer(own, workdir))
        return Start(_inherited(merged, own.train.get("source_directions", ()), overrides, where))
    if checkpoints.list_steps(workdir):  # none of its own checkpoints is readable: restore_latest says which
        return Start(config)

    def read(step: int) -> tuple[int, ml_collections.ConfigDict, ml_collections.ConfigDict, dict]:
        source_config = checkpoints.load_config(source, step)
        if LoRASpec.of(source_config):
            raise ConfigError(
                f"config key train.init_from: {source} holds LoRA adapters, not a model (its checkpoints leave out "
                f"their base); start from that base instead: train.init_from={source_config.train.init_from}"
            )
        tokenizer = _workdir_tokenizer(source_config, workdir)
        where = f"train.init_from {source}"
        merged = _merged(config, source_config, overrides, where, tokenizer)
        merged = _inherited(merged, languages.trained(source_config), overrides, where)
        grown = add_languages.extend(merged, source_config, source) if add_languages.count(merged) else merged
        params = checkpoints.load_model_params(source, step, abstract_train_state(merged)[1])
        return step, source_config, grown, add_languages.grow(params, grown) if grown is not merged else params

    step, source_config, merged, params = _first_readable(config, source, read)
    _copy_tokenizer(source, source_config, workdir, merged)
    logging.info("starting from the parameters of the checkpoint at step %d in %s", step, source)
    return Start(merged, params, step)


def _copy(config: ml_collections.ConfigDict, values: dict[str, Any]) -> ml_collections.ConfigDict:
    """A copy of the config with dotted keys set (ConfigDict keeps each key's type)."""
    new = ml_collections.ConfigDict(config.to_dict())
    for key, value in values.items():
        group, _, leaf = key.rpartition(".")
        (new[group] if group else new)[leaf] = value
    return new.lock() if config.is_locked else new


def _saved_value(flat: dict[str, Any], key: str) -> Any:
    """A key of a saved config; one the config lacks (added since) holds its default, as config_differences reads it."""
    default = schema.BY_NAME[key].default
    return flat.get(key, None if callable(default) else default)


def _own_config(workdir: pathlib.Path) -> ml_collections.ConfigDict | None:
    """The config of the newest checkpoint in workdir whose config can be read, or None."""
    for step in reversed(checkpoints.list_steps(workdir)):
        try:
            return checkpoints.load_config(workdir, step)
        except CheckpointError as e:
            logging.warning("%s; trying the checkpoint before it", e)
    return None


def _check_same_run(own: ml_collections.ConfigDict, config: ml_collections.ConfigDict, workdir: pathlib.Path) -> None:
    """ConfigError unless the workdir's checkpoints were written by a run started from the same source and step."""
    flat = flatten_dict(own.to_dict(), sep=".")
    saved = (_saved_value(flat, "train.init_from"), _saved_value(flat, "train.init_step"))
    if saved != (config.train.init_from, config.train.init_step):
        began = f"from {saved[0]} (init_step {saved[1]})" if saved[0] else "from random parameters"
        raise ConfigError(
            f"--workdir {workdir} holds checkpoints of another run (started {began}); fine-tune from "
            f"{config.train.init_from} into a new --workdir"
        )


def planned_config(config: ml_collections.ConfigDict, overrides: Iterable[str] = ()) -> ml_collections.ConfigDict:
    """The config a run will train, for `--dry_run` and `--plan`: with train.init_from, the architecture keys of
    the source checkpoint train.init_step names, from its saved config only; refused as `prepare` would refuse."""
    if not config.train.init_from:
        return config
    source = pathlib.Path(config.train.init_from).expanduser().resolve()
    reference = _first_readable(config, source, lambda step: checkpoints.load_config(source, step))
    where = f"train.init_from {source}"
    merged = _merged(config, reference, set(overrides), where, config.data.tokenizer_model)
    merged = _inherited(merged, languages.trained(reference), set(overrides), where)
    return add_languages.extend(merged, reference, source) if add_languages.count(merged) else merged


def _candidate_steps(config: ml_collections.ConfigDict, source: pathlib.Path) -> list[int]:
    """The source's checkpoint steps to try, in order, for train.init_step: `latest` newest first (a damaged one
    falls back to the one before it), `best` best first (checkpoints.best_steps), N exactly N."""
    where = f"config key train.init_from: {source}"
    if not source.is_dir():
        raise ConfigError(
            f"{where} {'is not a directory' if source.exists() else 'does not exist'}; give the workdir "
            "of a trained run"
        )
    steps = checkpoints.list_steps(source)
    if not steps:
        raise ConfigError(
            f"{where} holds no checkpoint (nothing in {checkpoints.checkpoint_dir(source)}); train it "
            "first or give another workdir"
        )
    init_step = config.train.init_step
    if init_step == "best":
        candidates = checkpoints.best_steps(source)
        if not candidates:
            raise ConfigError(
                f"config key train.init_step: {source} has no best-checkpoint record (it was trained without "
                f"ckpt.keep_best); use latest or a step number (its steps: {steps})"
            )
        return candidates
    if init_step == "latest":
        return list(reversed(steps))
    if int(init_step) in steps:
        return [int(init_step)]
    raise ConfigError(f"config key train.init_step: {source} has no checkpoint at step {init_step}; its steps: {steps}")


def _first_readable(config: ml_collections.ConfigDict, source: pathlib.Path, read: Callable[[int], T]) -> T:
    """read(step) of the first of the source's candidate steps that reads without CheckpointError (each damaged one
    is logged); one CheckpointError naming them all if none does."""
    errors = []
    for step in _candidate_steps(config, source):
        try:
            return read(step)
        except CheckpointError as e:
            errors.append(f"step {step}: {e}")
            best = config.train.init_step == "best"
            logging.error("%s; trying %s", e, "the next best" if best else "the checkpoint before it")
    raise CheckpointError(
        f"config key train.init_from: {source}: no checkpoint could be read ({'; '.join(errors)}); give another "
        "train.init_from or train.init_step"
    )


def _workdir_tokenizer(reference: ml_collections.ConfigDict, workdir: pathlib.Path) -> str:
    """data.tokenizer_model for the workdir's copy of the source's tokenizer: empty, as the source's, if the source
    trained it into its workdir (exactly model.vocab_size pieces), so the workdir's spm.model wherever the workdir
    moves; the copy's path if the source was given a file (which may have fewer pieces: get_tokenizer accepts it)."""
    return str(workdir.resolve() / MODEL_FILENAME) if reference.data.tokenizer_model else ""


def _merged(
    config: ml_collections.ConfigDict,
    reference: ml_collections.ConfigDict,
    overrides: set[str],
    where: str,
    tokenizer: str,
) -> ml_collections.ConfigDict:
    """The config with every architecture key of `reference` and data.tokenizer_model = `tokenizer`; ConfigError
    listing the command-line overrides that contradict them."""
    flat, current = flatten_dict(reference.to_dict(), sep="."), flatten_dict(config.to_dict(), sep=".")
    values = {key: _saved_value(flat, key) for key in schema.ARCHITECTURE}
    contradicting = [
        f"{key}={current[key]!r} (source: {values[key]!r})"
        for key in schema.ARCHITECTURE
        if key in overrides and current[key] != values[key]
    ]
    if "data.tokenizer_model" in overrides and current["data.tokenizer_model"] != tokenizer:
        contradicting.append(f"data.tokenizer_model={current['data.tokenizer_model']!r} (source: its own tokenizer)")
    if contradicting:
        raise ConfigError(
            f"{where}: --config overrides contradict the architecture and tokenizer it fixes: "
            f"{', '.join(contradicting)}; remove them (a fine-tuning run takes these keys from its source)"
        )
    merged = _copy(config, {**values, "data.tokenizer_model": tokenizer})
    # Every value was checked, the run's by its command line and the source's when it trained; the rules between
    # keys may not hold for the two together (data.max_len against the source's learned positions).
    cli.check_between(dict(cli.leaves(merged)))
    return merged


def _inherited(
    config: ml_collections.ConfigDict, directions: tuple[str, ...], overrides: set[str], where: str
) -> ml_collections.ConfigDict:
    """The config with train.source_directions = `directions` (a fact of the source, like the architecture keys);
    ConfigError if the command line set it otherwise."""
    if "train.source_directions" in overrides and tuple(config.train.source_directions) != tuple(directions):
        raise ConfigError(
            f"{where}: --config.train.source_directions={config.train.source_directions!r} contradicts the "
            f"directions the source trained ({directions!r}); remove it (the run takes it from its source)"
        )
    return _copy(config, {"train.source_directions": tuple(directions)})


def _copy_tokenizer(
    source: pathlib.Path,
    source_config: ml_collections.ConfigDict,
    workdir: pathlib.Path,
    config: ml_collections.ConfigDict,
) -> None:
    """Copies the source's tokenizer files into workdir (spm.model; a converted model's MARIAN_* or FAIRSEQ_* files,
    vocab.json with the codes of data.add_languages), each whole or not at all; ConfigError if one is missing or the
    workdir holds another file under its name."""
    for tokenizer in tokenizer_files(source_config.data, source):
        if not tokenizer.is_file():
            raise ConfigError(
                f"config key train.init_from: the tokenizer of {source} ({tokenizer}) is missing; a "
                "fine-tuning run needs the tokenizer its source was trained with"
            )
        # A given SentencePiece file (data.tokenizer_model) becomes the workdir's spm.model, as its config says.
        target = workdir / (MODEL_FILENAME if source_config.data.tokenizer == "spm" else tokenizer.name)
        added = add_languages.count(config) and add_languages.is_vocab(tokenizer)
        content = add_languages.vocab_json(tokenizer, config) if added else tokenizer.read_bytes()
        if target.exists():
            if target.read_bytes() != content:
                raise ConfigError(
                    f"--workdir {workdir} holds a tokenizer ({target}) other than the source's "
                    f"({tokenizer}); fine-tune into a new --workdir"
                )
            continue
        with atomic_write(target) as tmp:
            pathlib.Path(tmp).write_bytes(content)
