"""Pure, module-level step functions over the split train state; `compile_steps` jits them once with shardings.

A batch is a dict of int32 arrays [B, ...]: the batch contract of transformer_jax/data/batching.py (`BATCH_KEYS`).
Segment id 0 marks padding.
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
from transformer_jax.training.losses import cross_entropy_sums
from transformer_jax.training.state import Graphs

Array = jax.Array


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
    of real target tokens, so k micro-batches give exactly the update of one batch k times larger. (optax.MultiSteps
    averages the k micro-batch gradients with equal weights, so a token of a short micro-batch would count more than
    one of a long micro-batch; and it spreads one update over k calls instead of one call per batch.)

    A non-finite loss or gradient skips the update (state unchanged but for the counters). This is hand-written
    rather than optax.apply_if_finite, which checks only the gradients, not the loss; applies the update anyway
    after max_consecutive_errors, where training stops with the last good state saved; leaves nnx.Optimizer's step
    counting skipped updates; and keeps its counters inside the optimizer state, a layout existing checkpoints lack.
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
