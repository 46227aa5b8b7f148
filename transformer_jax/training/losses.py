"""Label-smoothed cross-entropy (paper 5.4) as token sums, so that any batching normalises exactly.

Axis legend: B batch, T target length, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def cross_entropy_sums(logits_BTV: Array, targets_BT: Array, weights_BT: Array, label_smoothing: float) -> dict:
    """Sums over real target tokens (weights 1) of the smoothed loss, the true NLL and correct predictions.

    The smoothed target puts 1 - eps on the reference token and eps / V on every token (as optax.smooth_labels).
    Dividing each sum by `tokens` gives per-token means; summing before dividing makes gradient accumulation over
    micro-batches of different sizes exact (token-weighted).
    """
    logits_BTV = logits_BTV.astype(jnp.float32)
    log_probs_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    nll_BT = -jnp.take_along_axis(log_probs_BTV, targets_BT[..., None], axis=-1)[..., 0]
    # -sum_v q_v log p_v with q = (1 - eps) one_hot + eps / V, without materialising q: one [B, T, V] pass less.
    loss_BT = (1.0 - label_smoothing) * nll_BT - label_smoothing * jnp.mean(log_probs_BTV, axis=-1)
    weights_BT = weights_BT.astype(jnp.float32)
    correct_BT = (jnp.argmax(logits_BTV, axis=-1) == targets_BT).astype(jnp.float32)
    return {
        "loss_sum": jnp.sum(loss_BT * weights_BT),
        "nll_sum": jnp.sum(nll_BT * weights_BT),
        "correct": jnp.sum(correct_BT * weights_BT),
        "tokens": jnp.sum(weights_BT),
    }


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
