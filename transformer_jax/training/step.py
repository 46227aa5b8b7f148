"""The loss (label-smoothed cross-entropy, paper 5.4, as token sums) and the pure step functions over the split
train state; `compile_steps` jits them once with shardings. A batch is data/batching.py's dict of int32 arrays
(`BATCH_KEYS`); segment id 0 marks padding. Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from transformer_jax.sharding import batch_sharding, state_shardings
from transformer_jax.training.state import Graphs

Array = jax.Array


def cross_entropy_sums(
    logits_BTV: Array, targets_BT: Array, weights_BT: Array, label_smoothing: float, *, fused_backward: bool
) -> dict:
    """Sums over real target tokens (weights 1) of the smoothed loss, the true NLL and correct predictions.

    The smoothed target puts 1 - eps on the reference token and eps / V on every token (as optax.smooth_labels).
    Sums, divided by `tokens` only at the end, make accumulation over micro-batches of different sizes exact.
    fused_backward: the hand-written backward below instead of autodiff (spec.fused_backward_on).
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


# smoothed_nll_sums with the hand-written backward below.
_fused_smoothed_nll_sums = jax.custom_vjp(smoothed_nll_sums, nondiff_argnums=(3,))


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


def batch_logits(model, batch: dict[str, Array]) -> Array:
    """The teacher-forced logits [B, T, V] of a batch (data/batching.py's keys): training's and scoring's forward."""
    return model(
        batch["src_tokens"],
        batch["tgt_in"],
        src_segment_ids=batch["src_segment_ids"],
        tgt_segment_ids=batch["tgt_segment_ids"],
        src_positions=batch["src_positions"],
        tgt_positions=batch["tgt_positions"],
    )


def _batch_sums(model, batch: dict[str, Array], label_smoothing: float) -> dict[str, Array]:
    logits_BTV = batch_logits(model, batch)
    weights_BT = batch["tgt_segment_ids"] > 0
    return cross_entropy_sums(
        logits_BTV, batch["tgt_out"], weights_BT, label_smoothing, fused_backward=model.spec.fused_backward_on
    )


def train_step(
    graph: nnx.GraphDef, state: nnx.State, batch: dict[str, Array], *, label_smoothing: float, accum_steps: int
) -> tuple[nnx.State, dict[str, Array]]:
    """One optimizer step: gradients of the summed loss over `accum_steps` micro-batches, divided by the number
    of real target tokens, so k micro-batches give exactly the update of one batch k times larger (optax.MultiSteps
    would weight micro-batches equally, not tokens, and spread one update over k calls).

    A non-finite loss or gradient skips the update (only the counters change). Not optax.apply_if_finite: it checks
    only the gradients, applies the update anyway after max_consecutive_errors, counts skipped updates in
    nnx.Optimizer's step, and keeps its counters in the optimizer state, a layout existing checkpoints lack.
    """
    train_state = nnx.merge(graph, state)
    model, optimizer, counters = train_state.model, train_state.optimizer, train_state.counters
    model_graph, params, rest = nnx.split(model, nnx.Param, ...)
    micro = jax.tree.map(lambda x: x.reshape(accum_steps, x.shape[0] // accum_steps, *x.shape[1:]), batch)

    def micro_step(carry, micro_batch):
        params, rest, grads_acc, sums_acc = carry
        # Parameters ride in the carry (unchanged) and the module is merged inside the body, so that NNX sees
        # every variable, dropout RNG counters included, at this trace level.
        m = nnx.merge(model_graph, params, rest)
        loss_fn = lambda m: (lambda s: (s["loss_sum"], s))(_batch_sums(m, micro_batch, label_smoothing))
        (_, sums), grads = nnx.value_and_grad(loss_fn, has_aux=True)(m)
        _, _, rest = nnx.split(m, nnx.Param, ...)
        add = lambda a, b: jax.tree.map(jnp.add, a, b)
        return (params, rest, add(grads_acc, grads), add(sums_acc, sums)), None

    zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    zero_sums = {k: jnp.zeros((), jnp.float32) for k in ("loss_sum", "nll_sum", "correct", "tokens")}
    (_, rest, grads, sums), _ = jax.lax.scan(micro_step, (params, rest, zero_grads, zero_sums), micro)
    nnx.update(model, rest)
    grads = jax.tree.map(lambda g: g / jnp.maximum(sums["tokens"], 1.0), grads)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(sums["loss_sum"]) & jnp.isfinite(grad_norm)

    # nnx.state holds the live variables; tree.map snapshots their current arrays before the update mutates them.
    before = jax.tree.map(lambda x: x, nnx.state((model, optimizer)))
    optimizer.update(model, grads)
    after = nnx.state((model, optimizer))
    nnx.update((model, optimizer), jax.tree.map(lambda new, old: jnp.where(finite, new, old), after, before))
    counters.nonfinite_in_a_row[...] = jnp.where(finite, 0, counters.nonfinite_in_a_row[...] + 1)
    counters.nonfinite_total[...] = counters.nonfinite_total[...] + jnp.where(finite, 0, 1)
    metrics = {
        **sums,
        "grad_norm": grad_norm,
        "finite": finite.astype(jnp.float32),
        "nonfinite_in_a_row": counters.nonfinite_in_a_row[...],
    }
    return nnx.state(train_state), metrics


def eval_step(graph: nnx.GraphDef, state: nnx.State, batch: dict[str, Array], *, label_smoothing: float) -> dict:
    """Loss sums on a batch with dropout off (graph is the eval graph)."""
    return _batch_sums(nnx.merge(graph, state).model, batch, label_smoothing)


def compile_steps(
    graphs: Graphs, state: nnx.State, mesh: Mesh, mesh_mode: str, *, label_smoothing: float, accum_steps: int
) -> tuple[Callable, Callable, object]:
    """jit once with shardings (state donated). Returns (train_step, eval_step, state shardings)."""
    shardings = state_shardings(state, mesh, mesh_mode)
    data = batch_sharding(mesh)
    train = jax.jit(
        functools.partial(train_step, graphs.train, label_smoothing=label_smoothing, accum_steps=accum_steps),
        in_shardings=(shardings, data),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
    evaluate = jax.jit(
        functools.partial(eval_step, graphs.eval, label_smoothing=label_smoothing),
        in_shardings=(shardings, data),
    )
    return train, evaluate, shardings
