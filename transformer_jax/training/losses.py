"""Label-smoothed cross-entropy (paper 5.4) as token sums, so that any batching normalises exactly.

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array


def cross_entropy_sums(
    logits_BTV: Array, targets_BT: Array, weights_BT: Array, label_smoothing: float, *, fused_backward: bool
) -> dict:
    """Sums over real target tokens (weights 1) of the smoothed loss, the true NLL and correct predictions.

    The smoothed target puts 1 - eps on the reference token and eps / V on every token (as optax.smooth_labels).
    Dividing each sum by `tokens` gives per-token means; summing before dividing makes gradient accumulation over
    micro-batches of different sizes exact (token-weighted). fused_backward: differentiate with the hand-written
    backward below instead of autodiff (the model's resolved model.fused_backward, spec.fused_backward_on).
    """
    weights_BT = weights_BT.astype(jnp.float32)
    sums = _fused_smoothed_nll_sums if fused_backward else smoothed_nll_sums
    loss_sum, nll_sum = sums(logits_BTV.astype(jnp.float32), targets_BT, weights_BT, label_smoothing)
    correct_BT = (jnp.argmax(logits_BTV, axis=-1) == targets_BT).astype(jnp.float32)
    return {
        "loss_sum": loss_sum,
        "nll_sum": nll_sum,
        "correct": jnp.sum(correct_BT * weights_BT),
        "tokens": jnp.sum(weights_BT),
    }


def smoothed_nll_sums(logits_BTV: Array, targets_BT: Array, weights_BT: Array, eps: float) -> tuple[Array, Array]:
    """(sum of w * smoothed loss, sum of w * NLL) over target positions, differentiated by autodiff."""
    return _smoothed_nll_fwd(logits_BTV, targets_BT, weights_BT, eps)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused_smoothed_nll_sums(
    logits_BTV: Array, targets_BT: Array, weights_BT: Array, eps: float
) -> tuple[Array, Array]:
    """smoothed_nll_sums with the hand-written backward below."""
    return _smoothed_nll_fwd(logits_BTV, targets_BT, weights_BT, eps)[0]


def _smoothed_nll_fwd(logits_BTV, targets_BT, weights_BT, eps):
    # log p_v = logits_v - lse. -sum_v q_v log p_v with q = (1 - eps) one_hot + eps / V, without materialising q.
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    nll_BT = lse_BT - jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    loss_BT = (1.0 - eps) * nll_BT + eps * (lse_BT - jnp.mean(logits_BTV, axis=-1))
    sums = (jnp.sum(loss_BT * weights_BT), jnp.sum(nll_BT * weights_BT))
    return sums, (logits_BTV, lse_BT, targets_BT, weights_BT)


def _smoothed_nll_bwd(eps, residuals, cotangents):
    """d loss_sum/d logits_v = w (p_v - (1 - eps) [v = y] - eps / V), d nll_sum/d logits_v = w (p_v - [v = y]).

    Written by hand so that XLA computes the [B, T, V] gradient in one elementwise pass (autodiff of
    log_softmax + take_along_axis gave a scatter and two differently laid-out copies of it; docs/benchmarks.md).
    """
    logits_BTV, lse_BT, targets_BT, weights_BT = residuals
    g_loss, g_nll = cotangents
    vocab = logits_BTV.shape[-1]
    probs_BTV = jnp.exp(logits_BTV - lse_BT[..., None])
    is_target_BTV = jax.lax.broadcasted_iota(jnp.int32, logits_BTV.shape, 2) == targets_BT[..., None]
    w_BT1 = weights_BT[..., None]
    d_logits_BTV = w_BT1 * (
        (g_loss + g_nll) * probs_BTV
        - jnp.where(is_target_BTV, g_loss * (1.0 - eps) + g_nll, 0.0)
        - g_loss * eps / vocab
    )
    return d_logits_BTV, None, None


_fused_smoothed_nll_sums.defvjp(_smoothed_nll_fwd, _smoothed_nll_bwd)


def summarize(sums: dict) -> dict[str, float]:
    """Per-token means from (host) sums: loss (smoothed), nll, perplexity = exp(nll), accuracy."""
    tokens = max(float(sums["tokens"]), 1.0)
    nll = float(sums["nll_sum"]) / tokens
    return {
        "loss": float(sums["loss_sum"]) / tokens,
        "nll": nll,
        "perplexity": float(jnp.exp(min(nll, 50.0))),
        "accuracy": float(sums["correct"]) / tokens,
    }
