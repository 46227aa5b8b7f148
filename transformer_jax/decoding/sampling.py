"""Sampling instead of search: each step draws the next token from the model's distribution, reshaped by a
temperature, a top-k cut and a nucleus (top-p) cut (Holtzman et al., 2020). Sampled back-translation beats beam
back-translation (Edunov et al., 2018).

Axis letters: see transformer_jax/__init__.py (B rows, V vocabulary).

Reproducibility: every (sentence, sample) has its own key (`sample_keys`: the seed folded with the sentence's input
line and the sample's number), and step t draws with that key folded with t: one uniform number per row and step,
turned into a token by inverting the distribution's CDF (`inverse_cdf`; jax.random.categorical would draw V Gumbel
numbers per row and step, most of a sampling step's cost on CPU at V = 8000: docs/decoding.md). So a sample depends
on its seed, its line and its number only, not on the batch it ran in, the rows beside it, or when the scheduler let
it join.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.decoding.state import NEG_INF, top_k

Array = jax.Array
Choose = Callable[[Array, Array], Array]  # (logits_BV, step_B) -> token_B


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are drawn (hashable: a static argument of the jitted search, one compilation per setting)."""

    temperature: float  # > 0: logits are divided by it (1: the model's distribution)
    top_k: int  # >= 0: keep the k most probable tokens (0: all)
    top_p: float  # in (0, 1]: keep the smallest set of most probable tokens whose probability reaches p (1: all)

    def check(self) -> None:
        """ValueError naming the setting that cannot work (evaluate.py's flags carry the same names)."""
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top_k must be >= 0 (0: no cut), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top_p must be in (0, 1] (1: no cut), got {self.top_p}")

    def log_probs(self, logits_BV: Array) -> Array:
        """[B, V] log-probabilities of the reshaped distribution the tokens are drawn from (-inf: cut)."""
        logits_BV = logits_BV.astype(jnp.float32) / self.temperature
        if self.top_k:
            kth_B1 = top_k(logits_BV, min(self.top_k, logits_BV.shape[-1]))[0][:, -1:]
            logits_BV = jnp.where(logits_BV < kth_B1, NEG_INF, logits_BV)
        log_probs_BV = jax.nn.log_softmax(logits_BV, axis=-1)
        if self.top_p < 1:
            probs_BV = jnp.exp(log_probs_BV)
            kept_BV = probs_BV >= nucleus_threshold(probs_BV, self.top_p)[:, None]
            log_probs_BV = jax.nn.log_softmax(jnp.where(kept_BV, log_probs_BV, NEG_INF), axis=-1)
        return log_probs_BV

    def weights(self, logits_BV: Array) -> Array:
        """[B, V] the reshaped distribution's probabilities up to a factor per row (0: cut): without a cut,
        exp((x - max x) / temperature), which spares log_probs' normalisation."""
        if self.top_k or self.top_p < 1:
            return jnp.exp(self.log_probs(logits_BV))
        logits_BV = logits_BV.astype(jnp.float32)
        return jnp.exp((logits_BV - jnp.max(logits_BV, axis=-1, keepdims=True)) / self.temperature)

    def chooser(self, keys_B2: Array) -> Choose:
        """The token choice of the search (state.GreedyState.advance's `choose`): row b draws one uniform number
        with its key keys_B2[b] folded with its step, and inverts the CDF of its reshaped distribution there."""

        def choose(logits_BV: Array, step_B: Array) -> Array:
            step_keys = jax.vmap(jax.random.fold_in)(keys_B2, step_B)
            u_B = jax.vmap(lambda key: jax.random.uniform(key, ()))(step_keys)
            return inverse_cdf(self.weights(logits_BV), u_B)

        return choose


FLOAT32_ONE_BITS = 0x3F800000  # 1.0's bits: non-negative float32 values order as their bits do, as int32


def nucleus_threshold(probs_BV: Array, top_p: float) -> Array:
    """[B] the least probability the nucleus keeps: with probabilities s_1 >= s_2 >= ..., s_K for the last K whose
    more probable tokens hold less than top_p (so tokens with probability >= s_K are kept, ties included).

    s_K is the least v with M(v) = sum of the probabilities above v < top_p (M steps down at each s_k), found by
    bisection over float32 bit patterns in [0, 1]: 30 masked sums over [B, V] instead of a sort of every row, which
    was most of a top-p step's cost on CPU (docs/decoding.md).
    """

    def mass_above_below_p(bits_B: Array) -> Array:
        v_B1 = jax.lax.bitcast_convert_type(bits_B, jnp.float32)[:, None]
        return jnp.sum(jnp.where(probs_BV > v_B1, probs_BV, 0.0), axis=-1) < top_p

    def halve(_, lo_hi: tuple[Array, Array]) -> tuple[Array, Array]:
        lo_B, hi_B = lo_hi  # M(lo) >= top_p > M(hi)
        mid_B = lo_B + (hi_B - lo_B) // 2
        below_B = mass_above_below_p(mid_B)
        return jnp.where(below_B, lo_B, mid_B), jnp.where(below_B, mid_B, hi_B)

    batch = probs_BV.shape[0]
    start = (jnp.zeros((batch,), jnp.int32), jnp.full((batch,), FLOAT32_ONE_BITS, jnp.int32))
    _, hi_B = jax.lax.fori_loop(0, FLOAT32_ONE_BITS.bit_length(), halve, start)
    return jax.lax.bitcast_convert_type(hi_B, jnp.float32)


CDF_BLOCK = 128  # tokens per block of inverse_cdf's two-level search


def inverse_cdf(weights_BV: Array, u_B: Array) -> Array:
    """[B] int32: for u uniform in [0, 1), the first index whose cumulative weight exceeds u times the row's total,
    which is a draw from the categorical distribution of probabilities weights / total (weights >= 0, total > 0).

    In two levels, the same rule: the vocabulary in blocks of CDF_BLOCK tokens (the last padded with zero weight),
    first the block where the cumulative block mass exceeds u * total, then the token inside it where the rest of
    that mass is exceeded. A cumulative sum over V in one go costs several times the argmax of greedy search on CPU
    (docs/decoding.md); two short ones cost about as much.
    """
    batch, vocab = weights_BV.shape
    blocks = -(-vocab // CDF_BLOCK)
    weights_BV = jnp.pad(weights_BV, [(0, 0), (0, blocks * CDF_BLOCK - vocab)])
    weights_BKC = weights_BV.reshape(batch, blocks, CDF_BLOCK)
    mass_BK = jnp.sum(weights_BKC, axis=-1)
    cumulative_BK = jnp.cumsum(mass_BK, axis=-1)
    target_B = u_B * cumulative_BK[:, -1]
    block_B = _first_above(cumulative_BK, target_B)
    before_B = jnp.take_along_axis(cumulative_BK - mass_BK, block_B[:, None], axis=1)[:, 0]
    inside_BC = jnp.take_along_axis(weights_BKC, block_B[:, None, None], axis=1)[:, 0]
    # Rounding can put the rest just outside the block's mass; clamped, it still lands on a positive weight.
    rest_B = jnp.maximum(target_B - before_B, 0.0)
    return block_B * CDF_BLOCK + _first_above(jnp.cumsum(inside_BC, axis=-1), rest_B)


def _first_above(cumulative_BN: Array, target_B: Array) -> Array:
    """[B] the first index whose cumulative weight exceeds target (non-decreasing rows of weights >= 0).

    A zero-weight index never qualifies (its cumulative weight equals its predecessor's); nor, should the target
    reach the row's total, does any index past the last positive weight, whose cumulative weight is the total.
    """
    total_B1 = cumulative_BN[:, -1:]
    below_BN = (cumulative_BN <= target_B[:, None]) & (cumulative_BN < total_B1)
    return jnp.sum(below_BN, axis=-1, dtype=jnp.int32)


PLAIN = Sampling(temperature=1.0, top_k=0, top_p=1.0)  # the model's own distribution: what unset flags mean


def sample_keys(seed: int, lines: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """[N, 2] uint32: the key of sample samples[n] of input line lines[n] (raw keys, as jax.random.PRNGKey's)."""
    base = jax.random.PRNGKey(seed)
    keys = jax.vmap(lambda line, sample: jax.random.fold_in(jax.random.fold_in(base, line), sample))(
        jnp.asarray(lines, jnp.uint32), jnp.asarray(samples, jnp.uint32)
    )
    return np.asarray(keys, np.uint32)
