"""A model from a workdir's checkpoints: choose the steps, average their parameters, check they fit the config.

evaluate.py and the attention pictures (transformer_jax.visualize) restore through `restore_model`. The
checkpoint reading itself sits behind `Restorer`, the seam tests replace with a fake that serves known parameters.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from flax.traverse_util import flatten_dict

from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.errors import CheckpointError, EvalError
from transformer_jax.evaluation.averaging import average_params, select_steps
from transformer_jax.model import Transformer, TransformerSpec, build_model, model_rngs
from transformer_jax.training import checkpoints

# Keys a restart must keep that say only how the training began (the source a fine-tuned run started from, as its
# saved config resolved it, and what it froze): a --config given to evaluate or export need not repeat them.
EVALUATION_MAY_DIFFER = frozenset({"train.init_from", "train.init_step", "opt.freeze"})


class Restorer:
    """Reads checkpoints and the tokenizer of a workdir; tests substitute a fake with the same methods."""

    def __init__(self):
        self._ckpt = checkpoints

    def list_steps(self, workdir: str) -> list[int]:
        return self._ckpt.list_steps(workdir)

    def load_config(self, workdir: str):
        return self._ckpt.load_config(workdir)

    def best_steps(self, workdir: str) -> list[int]:
        """The steps of the checkpoints scored by train.select_metric, best first."""
        return self._ckpt.best_steps(workdir)

    def config_differences(self, saved, current) -> list[str]:
        """The keys a given config must share with the saved one to restore its model: those a restart must keep,
        but for how the training began (EVALUATION_MAY_DIFFER)."""
        keys = tuple(k for k in self._ckpt.STRUCTURAL_KEYS if k not in EVALUATION_MAY_DIFFER)
        return self._ckpt.config_differences(saved.to_dict(), current.to_dict(), keys)

    def load_params(self, workdir: str, steps: list[int], abstract_params: nnx.State) -> Iterator[dict]:
        """The parameter pure dicts of `steps`, read one at a time into the tree of `abstract_params` (the model's
        nnx.Param state, abstract: the optimizer's state is not read, so its abstract tree is not built)."""
        return (self._ckpt.load_model_params(workdir, step, {"model": abstract_params}) for step in steps)

    def tokenizer(self, config, workdir: str):
        if config.data.tokenizer == "spm" and not config.data.tokenizer_model:
            if not (Path(workdir) / tokenizer_lib.MODEL_FILENAME).exists():
                raise EvalError(
                    f"no tokenizer in {workdir} ({tokenizer_lib.MODEL_FILENAME}) and config.data.tokenizer_model is "
                    "empty; evaluate with the workdir the model was trained in"
                )
        return tokenizer_lib.model_tokenizer(config, workdir)


def choose_steps(
    available: list[int],
    workdir: str,
    *,
    checkpoint: str = "latest",
    average_last: int | None,
    average_steps: Sequence[int] | None = None,
) -> list[int]:
    """The checkpoint steps to average: exactly `average_steps`, or the last `average_last` up to `checkpoint`."""
    if not available:
        raise EvalError(f"no checkpoint in {Path(workdir) / 'checkpoints'}; train first or fix --workdir")
    if average_steps:
        return select_steps(available, None, average_steps)
    if checkpoint == "latest":
        last = available[-1]
    else:
        try:
            last = int(checkpoint)
        except ValueError as e:
            raise EvalError(f"--checkpoint must be 'latest' or a step number, got {checkpoint!r}") from e
        if last not in available:
            raise EvalError(f"no checkpoint for step {last} in {workdir}; available steps: {available}")
    candidates = [s for s in available if s <= last]
    if average_last > len(candidates):
        raise EvalError(
            f"asked to average the last {average_last} checkpoints up to step {last}, but only {len(candidates)} "
            f"exist: {candidates}; pass --average_last {len(candidates)} (or 1 for no averaging)"
        )
    return select_steps(candidates, average_last, None)


def best_params(restorer: Restorer, workdir: str, count: int, target: nnx.State, used: list[int]) -> Iterator[dict]:
    """The parameters of the `count` best checkpoints that can be read, best first, appending each step to `used`.

    A damaged best checkpoint is reported in one line and the next best takes its place (as a restart falls back
    from a damaged latest checkpoint); EvalError when there is no scored checkpoint or too few readable ones.
    """
    ranked = restorer.best_steps(workdir)
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
            params = next(iter(restorer.load_params(workdir, [step], target)))
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


def abstract_model(config: Any) -> Any:
    """The config's model with abstract parameters (shapes and dtypes, for the checkpoint's arrays to fill) and its
    other state (the dropout streams' keys and counts) concrete. Building it eagerly would run every initialiser as
    a program of its own (a compilation for each of the model's initialisers, before any decoding); here the other
    state comes from one jitted program in which XLA prunes the unused initialisers."""

    model = nnx.eval_shape(lambda: build_model(config, rngs=model_rngs(0)))
    nnx.update(model, _other_state(spec=model.spec))
    return model


@functools.partial(jax.jit, static_argnames=("spec",))
def _other_state(*, spec: TransformerSpec) -> nnx.State:
    """The state of build_model's model other than its parameters (the dropout streams' keys and counts, seed 0)."""
    return nnx.state(Transformer(spec, rngs=model_rngs(0)), nnx.Not(nnx.Param))


def restore_model(
    restorer: Restorer,
    workdir: str,
    *,
    config: Any = None,
    checkpoint: str = "latest",
    average_last: int | None = None,
    average_steps: Sequence[int] | None = None,
    average_best: int | None = None,
) -> tuple[Any, Any, list[int]]:
    """(config, model in eval mode with the averaged parameters, steps used).

    `config` None means the one saved with the checkpoints; a given one must agree with it on every key that
    shapes the model. `average_last` None means config.eval.average_last. checkpoint="best" or `average_best`
    (K): the best (the mean of the K best) checkpoints by train.select_metric, best first in the steps used.
    """
    available = restorer.list_steps(workdir)
    if not available:
        raise EvalError(f"no checkpoint in {Path(workdir) / 'checkpoints'}; train first or fix --workdir")
    saved = restorer.load_config(workdir)
    if config is None:
        config = saved
    else:
        diff = restorer.config_differences(saved, config)
        if diff:
            raise EvalError(
                "--config does not match the config saved with the checkpoints; differing keys (saved -> given): "
                + "; ".join(diff)
            )
    model = abstract_model(config)
    target = nnx.state(model, nnx.Param)
    if checkpoint == "best" or average_best:
        steps: list[int] = []
        params = average_params(best_params(restorer, workdir, average_best or 1, target, steps))
        steps.sort()  # ascending, as every other selection lists them
    else:
        if average_last is None:
            average_last = config.eval.average_last
        # With ckpt.keep_best, checkpoints older than the last ckpt.keep are there for their scores alone: "the last
        # N" are the rotation's, never those (--average_best averages the best).
        latest = available[-config.ckpt.keep :] if config.ckpt.keep_best and checkpoint == "latest" else available
        steps = choose_steps(
            latest, workdir, checkpoint=checkpoint, average_last=average_last, average_steps=average_steps
        )
        params = average_params(restorer.load_params(workdir, steps, target))

    def shapes(tree: dict) -> dict[str, tuple[int, ...]]:
        # Layer lists have integer keys, hence the str() before joining.
        return {".".join(map(str, path)): value.shape for path, value in flatten_dict(tree).items()}

    expected, got = shapes(nnx.to_pure_dict(target)), shapes(params)
    if expected != got:
        keys = sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))
        details = "; ".join(f"{k}: checkpoint {got.get(k)} vs config {expected.get(k)}" for k in keys[:20])
        raise EvalError(f"the checkpoint's parameters do not fit the config's model: {details}")
    nnx.replace_by_pure_dict(target, params)
    nnx.update(model, target)
    model.eval()
    return config, model, steps
