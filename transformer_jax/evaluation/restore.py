"""A model from a workdir's checkpoints: choose the steps, average their parameters, into the saved config's model.

Every command that restores a model makes one CheckpointChoice of its flags and calls `restore_model`.

Averaging (paper 6.1: the last 5 checkpoints for base models, the last 20 for big ones) takes the element-wise mean
of the parameter pytrees, accumulated in float64 on the host one checkpoint at a time and cast back to each leaf's
dtype once at the end: the correctly rounded mean whatever the number of checkpoints.

A LoRA run's checkpoints (opt.lora_rank > 0) hold adapters: each is merged into the base its record names
(W + s A B, model/lora.py merge) before averaging, since the mean of the A_i times the mean of the B_i is not the
mean of the products. The model restored is a plain one with merged weights, which evaluation and every export use.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from transformer_jax.config import schema
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.errors import AveragingError, CheckpointError, ConfigError, EvalError
from transformer_jax.model import Transformer, TransformerSpec, build_model, model_rngs
from transformer_jax.model.lora import LoRASpec, add_adapters, merge
from transformer_jax.training import add_languages, checkpoints

# Keys a restart must keep that say only how the training began (the source a fine-tuned run started from, as its
# saved config resolved it, and what it froze): a --config given to evaluate or export need not repeat them.
EVALUATION_MAY_DIFFER = frozenset({"train.init_from", "train.init_step", "opt.freeze"})


@dataclasses.dataclass(frozen=True)
class CheckpointChoice:
    """Which checkpoints make the model: the checkpoint flags, as given (`check_choice` checks them)."""

    checkpoint: str = "latest"  # "latest", "best" (by train.select_metric), or the step of the last checkpoint
    average_last: int | None = None  # the mean of this many ending at `checkpoint`; None: config.eval.average_last
    average_steps: tuple[int, ...] | None = None  # the mean of exactly these steps
    average_best: int | None = None  # the mean of this many best by train.select_metric

    @property
    def by_score(self) -> bool:  # the checkpoints are the best by train.select_metric
        return self.checkpoint == "best" or self.average_best is not None


LATEST = CheckpointChoice()  # the last config.eval.average_last checkpoints


def check_choice(choice: CheckpointChoice) -> CheckpointChoice:
    """The choice with its checkpoint and average_steps as restore_model takes them (a str, ints), or EvalError
    naming the flag; before any file is read."""
    if choice.average_last is not None:
        try:
            schema.RULES["eval.average_last"].check("eval.average_last", choice.average_last, name="--average_last")
        except ConfigError as e:
            raise EvalError(str(e)) from e
    checkpoint = str(choice.checkpoint)
    if checkpoint not in ("latest", "best") and not _is_step(checkpoint):
        raise EvalError(f"--checkpoint must be 'latest', 'best' or a step number, got {choice.checkpoint!r}")
    if choice.average_best is not None:
        if choice.average_best < 1:
            raise EvalError(f"--average_best must be >= 1 (checkpoints averaged), got {choice.average_best}")
        if choice.average_last is not None or choice.average_steps is not None:
            raise EvalError("give one of --average_best, --average_last and --average_steps")
        if checkpoint not in ("latest", "best"):
            raise EvalError("--average_best takes the best checkpoints; --checkpoint STEP would be ignored: drop one")
    if checkpoint == "best" and choice.average_last is not None:
        raise EvalError("--checkpoint best with --average_last: average the best ones with --average_best instead")
    average_steps = None
    if choice.average_steps is not None:
        if choice.average_last is not None:
            raise EvalError("give --average_last or --average_steps, not both")
        if checkpoint != "latest":
            raise EvalError("--average_steps names its steps; --checkpoint would be ignored: drop one of them")
        if not choice.average_steps or not all(_is_step(s) for s in choice.average_steps):
            raise EvalError(
                f"--average_steps must be step numbers separated by commas, got {list(choice.average_steps)}"
            )
        average_steps = tuple(int(s) for s in choice.average_steps)
        duplicates = sorted({s for s in average_steps if average_steps.count(s) > 1})
        if duplicates:
            raise EvalError(f"--average_steps lists step(s) {duplicates} more than once")
    return dataclasses.replace(choice, checkpoint=checkpoint, average_steps=average_steps)


def _is_step(value: Any) -> bool:
    text = str(value).strip()
    return text.isascii() and text.isdigit()


def choose_steps(available: list[int], workdir: str, choice: CheckpointChoice, average_last: int) -> list[int]:
    """The checkpoint steps to average, ascending."""
    if choice.average_steps:
        missing = sorted(set(choice.average_steps) - set(available))
        if missing:
            raise EvalError(f"no checkpoint for step(s) {missing}; available steps: {available}")
        return sorted(choice.average_steps)
    last = available[-1] if choice.checkpoint == "latest" else int(choice.checkpoint)
    if last not in available:
        raise EvalError(f"no checkpoint for step {last} in {workdir}; available steps: {available}")
    candidates = [s for s in available if s <= last]
    if average_last > len(candidates):
        raise EvalError(
            f"asked to average the last {average_last} checkpoints up to step {last}, but only {len(candidates)} "
            f"exist: {candidates}; pass --average_last {len(candidates)} (or 1 for no averaging)"
        )
    return candidates[-average_last:]


def best_params(workdir: str, count: int, load: Callable[[int], dict], used: list[int]) -> Iterator[dict]:
    """The parameters of the `count` best checkpoints that can be read, best first, appending each step to `used`.
    A damaged best checkpoint is reported in one line and the next best takes its place (as a restart falls back
    from a damaged latest checkpoint). load(step): the parameters of a step (`params_loader`)."""
    ranked = checkpoints.best_steps(workdir)
    if not ranked:
        raise EvalError(
            f"--checkpoint best: no checkpoint in {Path(workdir) / 'checkpoints'} has a score of its select metric "
            "(train.select_metric, saved when ckpt.keep_best or train.early_stop_patience is set); train with "
            "ckpt.keep_best, or give --checkpoint latest or a step"
        )
    if count > len(ranked):
        raise EvalError(
            f"--average_best {count}: only {len(ranked)} scored checkpoint(s) in {workdir}: {ranked}; pass "
            f"--average_best {len(ranked)}"
        )
    damaged = []
    for step in ranked:
        if len(used) == count:
            return
        try:
            params = load(step)
        except CheckpointError as e:
            logging.warning("best checkpoint at step %d is damaged (%s); using the next best", step, e)
            damaged.append(step)
            continue
        used.append(step)
        yield params
    if len(used) < count:
        raise EvalError(
            f"--average_best {count}: only {len(used)} of the scored checkpoints in {workdir} can be read "
            f"(damaged: {damaged}); pass a smaller --average_best"
        )


def average_params(trees: Iterable[Any]) -> Any:
    """The element-wise mean of parameter pytrees of identical structure, shapes and dtypes. `trees` may be a
    generator: memory holds the float64 sum and one checkpoint. Non-floating leaves must be equal and are kept."""
    total, treedef, first, count = None, None, None, 0
    for tree in trees:
        leaves_with_path, this_def = jax.tree_util.tree_flatten_with_path(tree)
        leaves = [np.asarray(leaf) for _, leaf in leaves_with_path]
        if total is None:
            treedef, first = this_def, leaves
            names = [jax.tree_util.keystr(path) for path, _ in leaves_with_path]
            total = [leaf.astype(np.float64) if _is_float(leaf) else leaf for leaf in leaves]
        else:
            if this_def != treedef:
                raise AveragingError(f"tree {count} has a different structure from tree 0:\n{this_def}\nvs\n{treedef}")
            for i, (leaf, ref) in enumerate(zip(leaves, first, strict=True)):
                if leaf.shape != ref.shape or leaf.dtype != ref.dtype:
                    raise AveragingError(
                        f"{names[i]}: tree {count} has {leaf.dtype}{list(leaf.shape)}, "
                        f"tree 0 has {ref.dtype}{list(ref.shape)}"
                    )
                if _is_float(leaf):
                    total[i] += leaf
                elif not np.array_equal(leaf, ref):
                    raise AveragingError(f"{names[i]}: non-floating leaf differs between tree 0 and tree {count}")
        count += 1
    if total is None:
        raise AveragingError("nothing to average: no pytrees were given")
    mean = [(t / count).astype(ref.dtype) if _is_float(ref) else t for t, ref in zip(total, first, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, mean)


def _is_float(x: np.ndarray) -> bool:
    # bfloat16 (ml_dtypes) is not an np.floating subclass; its dtype kind is 'V', so test via jax's dtype helper.
    return bool(jax.numpy.issubdtype(x.dtype, jax.numpy.floating))


def abstract_model(config: Any) -> Any:
    """The config's model with abstract parameters (for the checkpoint's arrays to fill) and its other state (the
    dropout streams' keys and counts) concrete. Building it eagerly would compile each initialiser on its own; here
    the other state comes from one jitted program in which XLA prunes the unused initialisers."""

    model = nnx.eval_shape(lambda: build_model(config, rngs=model_rngs(0)))
    nnx.update(model, _other_state(spec=model.spec))
    return model


@functools.partial(jax.jit, static_argnames=("spec",))
def _other_state(*, spec: TransformerSpec) -> nnx.State:
    return nnx.state(Transformer(spec, rngs=model_rngs(0)), nnx.Not(nnx.Param))


def params_loader(workdir: str, config: Any, target: nnx.State) -> Callable[[int], dict]:
    """step -> the plain parameters (a pure dict shaped as `target`, the model's nnx.Param state) of a checkpoint of
    workdir; a LoRA run's adapters merged into their base, which is read once and checked against every record."""
    spec = LoRASpec.of(config)
    if spec is None:
        return lambda step: checkpoints.load_model_params(workdir, step, {"model": target})

    def build() -> Transformer:
        rngs = model_rngs(0)
        model = build_model(config, rngs=rngs)
        add_adapters(model, spec, rngs=rngs)
        return model

    adapters = nnx.state(nnx.eval_shape(build), nnx.LoRAParam)
    bases: dict[tuple, dict] = {}  # (workdir, step, checksum) -> base parameters: a run's checkpoints share one

    def load(step: int) -> dict:
        record = checkpoints.load_base_record(workdir, step)
        key = tuple(sorted(record.items())) if record else ()
        where = f"the checkpoint at step {step} in {checkpoints.checkpoint_dir(workdir)}"
        if key not in bases:
            bases[key] = add_languages.load_base(config, record, {"model": target}, where)
        trained = checkpoints.load_model_params(workdir, step, {"model": adapters}, wrt=nnx.LoRAParam)
        return merge(bases[key], trained, spec)

    return load


def saved_config(workdir: str, config: Any = None) -> Any:
    """The config saved with the checkpoints, or `config` when it agrees with that one on every key that shapes the
    model (those a restart must keep, but for EVALUATION_MAY_DIFFER); EvalError without checkpoints."""
    if not checkpoints.list_steps(workdir):
        raise EvalError(f"no checkpoint in {Path(workdir) / 'checkpoints'}; train first or fix --workdir")
    saved = checkpoints.load_config(workdir)
    if config is None:
        return saved
    keys = tuple(k for k in checkpoints.STRUCTURAL_KEYS if k not in EVALUATION_MAY_DIFFER)
    diff = checkpoints.config_differences(saved.to_dict(), config.to_dict(), keys)
    if diff:
        raise EvalError(
            "--config does not match the config saved with the checkpoints; differing keys (saved -> given): "
            + "; ".join(diff)
        )
    return config


def restore_model(workdir: str, choice: CheckpointChoice = LATEST, *, config: Any = None) -> tuple[Any, Any, list[int]]:
    """(config, model in eval mode with the averaged parameters, steps used, ascending) of the checkpoints `choice`
    names; `config` None: the one saved with them. A LoRA run's model has its adapters merged (`params_loader`)."""
    choice = check_choice(choice)
    config = saved_config(workdir, config)
    model = abstract_model(config)
    target = nnx.state(model, nnx.Param)
    load = params_loader(workdir, config, target)
    with warnings.catch_warnings():
        # Orbax warns that it reads the shardings from the checkpoint: expected, restoring on one device.
        warnings.filterwarnings("ignore", "Sharding info not provided", UserWarning)
        if choice.by_score:
            steps: list[int] = []
            params = average_params(best_params(workdir, choice.average_best or 1, load, steps))
            steps.sort()
        else:
            available = checkpoints.list_steps(workdir)
            # With ckpt.keep_best, checkpoints older than the last ckpt.keep are there for their scores alone: "the
            # last N" are the rotation's, never those (--average_best averages the best).
            if config.ckpt.keep_best and choice.checkpoint == "latest":
                available = available[-config.ckpt.keep :]
            average_last = config.eval.average_last if choice.average_last is None else choice.average_last
            steps = choose_steps(available, workdir, choice, average_last)
            params = average_params(load(s) for s in steps)
    nnx.replace_by_pure_dict(target, params)
    nnx.update(model, target)
    model.eval()
    return config, model, steps


def workdir_tokenizer(config: Any, workdir: str) -> Any:
    """The tokenizer the model of `workdir` was trained with (never trains one: EvalError when it is missing)."""
    if config.data.tokenizer == "spm" and not config.data.tokenizer_model:
        if not (Path(workdir) / tokenizer_lib.MODEL_FILENAME).exists():
            raise EvalError(
                f"no tokenizer in {workdir} ({tokenizer_lib.MODEL_FILENAME}) and config.data.tokenizer_model is "
                "empty; evaluate with the workdir the model was trained in"
            )
    return tokenizer_lib.model_tokenizer(config, workdir)


# -- ensembles ----------------------------------------------------------------------------------------------------


def tokenizer_fingerprint(config: Any, tokenizer: Any) -> tuple[str, str]:
    """What an ensemble's members must share, in words: the vocabulary size and the tokenizer's fingerprint."""
    fingerprint = getattr(tokenizer, "fingerprint", None)
    digest = fingerprint()[:16] if fingerprint else type(tokenizer).__name__
    return (f"vocabulary size {config.model.vocab_size}", f"tokenizer {digest}")


def restore_members(workdirs: Sequence[str], config: Any, tokenizer: Any) -> list[Any]:
    """The members' models (each its latest checkpoints, averaged as its own config says); every member's
    vocabulary and tokenizer are checked before any member's parameters are read."""
    expected = tokenizer_fingerprint(config, tokenizer)
    for workdir in workdirs:
        member_config = checkpoints.load_config(workdir).copy_and_resolve_references()
        with member_config.unlocked():
            member_config.data.target_lang = config.data.target_lang  # the members read the same sources
        got = tokenizer_fingerprint(member_config, workdir_tokenizer(member_config, workdir))
        for want, have in zip(expected, got, strict=True):
            if want != have:
                raise EvalError(
                    f"--ensemble_workdirs member {workdir} has {have}, --workdir has {want}: ensemble members must "
                    "share one tokenizer"
                )
    return [restore_model(workdir)[1] for workdir in workdirs]
