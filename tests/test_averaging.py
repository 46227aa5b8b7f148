"""Checkpoint averaging (evaluation.restore): the mean against hand-computed values, accuracy, the step choice."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.errors import AveragingError, EvalError
from transformer_jax.evaluation.restore import CheckpointChoice, average_params, choose_steps


def test_average_matches_hand_computed_mean():
    trees = [
        {"layer": {"w": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), "b": np.array([1.0], np.float32)}, "n": 7},
        {"layer": {"w": np.array([[3.0, 2.0], [1.0, 0.0]], np.float32), "b": np.array([2.0], np.float32)}, "n": 7},
        {"layer": {"w": np.array([[2.0, 5.0], [2.0, 5.0]], np.float32), "b": np.array([4.0], np.float32)}, "n": 7},
    ]
    mean = average_params(iter(trees))  # a generator: checkpoints are loaded one at a time
    np.testing.assert_array_equal(mean["layer"]["w"], [[2.0, 3.0], [2.0, 3.0]])
    np.testing.assert_allclose(mean["layer"]["b"], [7.0 / 3.0], rtol=1e-7)
    assert mean["layer"]["w"].dtype == np.float32
    assert mean["n"] == 7  # non-floating leaves are kept when equal


def test_average_is_the_correctly_rounded_mean_and_keeps_dtypes():
    rng = np.random.default_rng(0)
    # Values near 1e4 with small differences: a float32 running sum loses their low bits.
    trees = [{"w": (1e4 + rng.normal(size=(64,))).astype(np.float32)} for _ in range(20)]
    exact = np.mean(np.stack([t["w"].astype(np.float64) for t in trees]), 0).astype(np.float32)
    np.testing.assert_array_equal(average_params(trees)["w"], exact)
    bf16 = [{"w": jnp.full((3,), v, jnp.bfloat16)} for v in (1.0, 2.0, 4.0)]
    out = average_params(bf16)["w"]
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), 7.0 / 3.0, rtol=1e-2)


def test_average_rejects_mismatched_trees():
    with pytest.raises(AveragingError, match=r"\['w'\].*float32\[3\].*float32\[2\]"):
        average_params([{"w": np.zeros(2, np.float32)}, {"w": np.zeros(3, np.float32)}])
    with pytest.raises(AveragingError, match="different structure"):
        average_params([{"w": np.zeros(2, np.float32)}, {"v": np.zeros(2, np.float32)}])
    with pytest.raises(AveragingError, match="non-floating leaf differs"):
        average_params([{"n": np.int32(1)}, {"n": np.int32(2)}])
    with pytest.raises(AveragingError, match="no pytrees"):
        average_params([])


def test_choose_steps():
    available = [1000, 2000, 3000, 4000, 5000]

    def choose(last: int = 1, checkpoint: str = "latest", steps=None) -> list[int]:
        return choose_steps(available, "w", CheckpointChoice(checkpoint, average_steps=steps), last)

    assert choose(2) == [4000, 5000]
    assert choose(5) == available
    assert choose(2, "3000") == [2000, 3000]
    assert choose(steps=(5000, 1000)) == [1000, 5000]
    assert choose() == [5000]  # latest only
    with pytest.raises(EvalError, match=r"last 6 checkpoints up to step 5000, but only 5 exist: \[1000, 2000"):
        choose(6)
    with pytest.raises(EvalError, match=r"step\(s\) \[2500\]; available steps: \[1000, 2000, 3000, 4000, 5000\]"):
        choose(steps=(2000, 2500))
    with pytest.raises(EvalError, match=r"no checkpoint for step 2500 in w; available steps: \[1000, 2000"):
        choose(1, "2500")
