"""Checkpoint averaging (paper 6.1: the last 5 checkpoints for base models, the last 20 for big ones).

`select_steps` picks which saved steps to average; `average_params` takes the element-wise mean of their parameter
pytrees. The mean is accumulated in float64 on the host, one checkpoint at a time, and cast back to each leaf's
dtype once at the end, so the result is the correctly rounded mean whatever the number of checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from transformer_jax.errors import AveragingError

PyTree = Any


def select_steps(available: Sequence[int], last_n: int | None, steps: Sequence[int] | None) -> list[int]:
    """The checkpoint steps to average, ascending: the last `last_n` of `available`, or exactly `steps`.

    With neither, the latest step alone. Asking for more checkpoints than exist, for a step that does not exist,
    or for both at once fails with the available steps listed.
    """
    available = sorted(set(int(s) for s in available))
    if not available:
        raise AveragingError("no checkpoints to choose from")
    if last_n is not None and steps is not None:
        raise AveragingError("give either the number of last checkpoints or a list of steps, not both")
    if steps is not None:
        steps = [int(s) for s in steps]
        if not steps:
            raise AveragingError(f"the list of steps is empty; available steps: {available}")
        duplicates = sorted({s for s in steps if steps.count(s) > 1})
        if duplicates:
            raise AveragingError(f"steps listed more than once: {duplicates}")
        missing = sorted(set(steps) - set(available))
        if missing:
            raise AveragingError(f"no checkpoint for step(s) {missing}; available steps: {available}")
        return sorted(steps)
    if last_n is None:
        return available[-1:]
    if last_n < 1:
        raise AveragingError(f"the number of checkpoints to average must be >= 1, got {last_n}")
    if last_n > len(available):
        raise AveragingError(
            f"asked to average the last {last_n} checkpoints but only {len(available)} exist: {available}"
        )
    return available[-last_n:]


def average_params(trees: Iterable[PyTree]) -> PyTree:
    """The element-wise mean of parameter pytrees of identical structure, shapes and dtypes.

    `trees` may be a generator, so checkpoints can be loaded one at a time: memory holds the float64 sum and one
    checkpoint. Floating leaves are averaged; non-floating leaves (e.g. integer counters) must be equal in all
    trees and are kept.
    """
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
