"""The train state and the pure step functions over it.

The train state: model, optimizer (optax, with its learning-rate schedule, from the `opt` group) and counters,
split once into static graphs and a pytree of arrays keyed by field name (`state["model"]`, `state["counters"]`).
The loss is label-smoothed cross-entropy (paper 5.4, as token sums); `compile_steps` jits the steps once with
shardings. A batch is data/batching.py's dict of int32 arrays (`BATCH_KEYS`); segment id 0 marks padding. Axis
letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import Mesh

from transformer_jax.errors import ConfigError
from transformer_jax.model import Transformer, build_model, model_rngs
from transformer_jax.model.lora import LoRASpec, add_adapters
from transformer_jax.sharding import batch_sharding, state_shardings

Array = jax.Array


TRAIN, FROZEN = "train", "frozen"  # the labels of optax.multi_transform


class Counters(nnx.Module):
    """Non-finite updates skipped: in a row (reset by a good step) and in total."""

    def __init__(self):
        self.nonfinite_in_a_row = nnx.Variable(jnp.zeros((), jnp.int32))
        self.nonfinite_total = nnx.Variable(jnp.zeros((), jnp.int32))


class TrainState(nnx.Module):
    """Everything a train step updates: the model (parameters and dropout RNG), its optimizer (step count and
    moments) and the non-finite counters; and, static, the learning rate the optimizer applies at each step."""

    # Field order: checkpoints written before the fields had names stored them under these positions.
    FIELDS = ("model", "optimizer", "counters")

    def __init__(self, model: Transformer, optimizer: nnx.Optimizer, counters: Counters, learning_rate: optax.Schedule):
        self.model = model
        self.optimizer = optimizer
        self.counters = counters
        self.learning_rate = learning_rate  # a function, so static: in the graph, not in the state's arrays


@dataclasses.dataclass(frozen=True)
class Graphs:
    """Static halves of the TrainState, dropout on (train) and off (eval); and the learning rate of each 0-based
    step, as the optimizer applies it, which the metrics log."""

    train: nnx.GraphDef
    eval: nnx.GraphDef
    learning_rate: optax.Schedule


def learning_rate_schedule(opt: ml_collections.ConfigDict, num_steps: int) -> optax.Schedule:
    """The learning rate at each optimizer step (0-based; the paper's step_num is step + 1).

    paper:    lrate = learning_rate * min(step_num^-0.5, step_num * warmup^-1.5), learning_rate = d_model^-0.5 (5.3)
    rsqrt:    linear warmup to learning_rate, then learning_rate * sqrt(warmup / step_num)
    cosine:   linear warmup to learning_rate, then cosine decay to 0 at num_steps
    constant: linear warmup to learning_rate, then constant
    """
    peak, warmup = float(opt.learning_rate), max(int(opt.warmup_steps), 1)
    if opt.schedule == "paper":
        return lambda step: peak * jnp.minimum((step + 1.0) ** -0.5, (step + 1.0) * warmup**-1.5)
    # Linear warmup: peak * step_num / warmup, reaching peak at step warmup - 1; the decay starts from there.
    ramp = optax.linear_schedule(peak / warmup, peak, transition_steps=warmup - 1)
    after = {
        "rsqrt": lambda count: peak * jnp.sqrt(warmup / (count + warmup)),  # count = step_num - warmup
        "cosine": optax.cosine_decay_schedule(peak, decay_steps=max(num_steps - warmup, 1)),
        "constant": optax.constant_schedule(peak),
    }[opt.schedule]
    return optax.join_schedules([ramp, after], boundaries=[warmup - 1])


def make_optimizer(opt: ml_collections.ConfigDict, schedule: optax.Schedule) -> optax.GradientTransformation:
    """Adam (paper: b1 0.9, b2 0.98, eps 1e-9) or AdamW at the rates of `schedule`, with optional global-norm
    clipping. Parameters an opt.freeze pattern matches get zero updates and no moments, and clipping sees only the
    trained ones (optax.multi_transform); a pattern that matches none is a ConfigError at initialisation."""
    if opt.optimizer == "adam":
        tx = optax.adam(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps)
    else:
        tx = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay)
    if opt.clip_grad_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(opt.clip_grad_norm), tx)
    patterns = list(opt.freeze)
    if not patterns:
        return tx
    return optax.multi_transform(
        {TRAIN: tx, FROZEN: optax.set_to_zero()}, lambda params: freeze_labels(params, patterns)
    )


def param_path(path: tuple) -> str:
    """'encoder_layers/0/ffn/w1/kernel': a parameter's path in the model, as opt.freeze patterns match it."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def freeze_labels(params: Any, patterns: list[str]) -> Any:
    """FROZEN for every parameter whose path one of `patterns` matches (re.search), TRAIN for the others, in the
    tree of `params` (an nnx.State of Variables or of arrays); ConfigError naming a pattern that matches none."""
    compiled = [re.compile(pattern) for pattern in patterns]
    matched: set[str] = set()

    def label(path: tuple, _) -> str:
        name = param_path(path)
        hits = {p.pattern for p in compiled if p.search(name)}
        matched.update(hits)
        return FROZEN if hits else TRAIN

    is_leaf = lambda x: isinstance(x, nnx.Variable)
    labels = jax.tree_util.tree_map_with_path(label, params, is_leaf=is_leaf)
    unmatched = [pattern for pattern in patterns if pattern not in matched]
    if unmatched:
        paths = [param_path(path) for path, _ in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_leaf)]
        raise ConfigError(
            f"config key opt.freeze: {unmatched[0]!r} matches no parameter path (of {len(paths)}: {paths[0]}, ..., "
            f"{paths[-1]}); fix or remove the pattern"
        )
    return labels


def trainable(model: Transformer) -> type[nnx.Param]:
    """The variables a train step differentiates and the optimizer updates: the adapters alone where the model has
    any (opt.lora_rank > 0; its base stays frozen and gets no gradient), else every parameter."""
    has_adapters = any(isinstance(v, nnx.LoRAParam) for _, v in nnx.iter_graph(model))
    return nnx.LoRAParam if has_adapters else nnx.Param


def new_train_state(config: ml_collections.ConfigDict) -> TrainState:
    """Model (with the adapters of opt.lora_*) + optimizer + counters built from the config; the one schedule goes to
    the optimizer and the state."""
    rngs = model_rngs(config.train.seed)
    model = build_model(config, rngs=rngs)
    if lora := LoRASpec.of(config):
        add_adapters(model, lora, rngs=rngs)
    schedule = learning_rate_schedule(config.opt, config.train.num_steps)
    optimizer = nnx.Optimizer(model, make_optimizer(config.opt, schedule), wrt=trainable(model))
    return TrainState(model, optimizer, Counters(), schedule)


def split_train_state(train_state: TrainState) -> tuple[Graphs, nnx.State]:
    """The train and eval graphs and the state (a pytree of arrays) of a TrainState; leaves it in train mode."""
    train_state.model.eval()
    eval_graph, _ = nnx.split(train_state)
    train_state.model.train()
    train_graph, state = nnx.split(train_state)
    return Graphs(train=train_graph, eval=eval_graph, learning_rate=train_state.learning_rate), state


def create_train_state(config: ml_collections.ConfigDict) -> tuple[Graphs, nnx.State]:
    """Builds model + optimizer + counters from the config and splits them."""
    return split_train_state(new_train_state(config))


def abstract_train_state(config: ml_collections.ConfigDict) -> tuple[Graphs, nnx.State]:
    """create_train_state with shapes only (no memory, no compute)."""
    return split_train_state(nnx.eval_shape(lambda: new_train_state(config)))


def eval_model(graphs: Graphs, state: nnx.State) -> Transformer:
    """The model of a train state with dropout off (for validation and translation)."""
    return nnx.merge(graphs.eval, state).model


def model_params(state: nnx.State) -> nnx.State:
    """The model's parameters inside a train state."""
    return nnx.filter_state(state["model"], nnx.Param)


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
    wrt = trainable(model)
    model_graph, params, rest = nnx.split(model, wrt, ...)
    micro = jax.tree.map(lambda x: x.reshape(accum_steps, x.shape[0] // accum_steps, *x.shape[1:]), batch)

    def micro_step(carry, micro_batch):
        params, rest, grads_acc, sums_acc = carry
        # Parameters ride in the carry (unchanged) and the module is merged inside the body, so that NNX sees
        # every variable, dropout RNG counters included, at this trace level.
        m = nnx.merge(model_graph, params, rest)
        loss_fn = lambda m: (lambda s: (s["loss_sum"], s))(_batch_sums(m, micro_batch, label_smoothing))
        (_, sums), grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt), has_aux=True)(m)
        _, _, rest = nnx.split(m, wrt, ...)
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
