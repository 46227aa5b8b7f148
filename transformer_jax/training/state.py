"""The train state: model, optimizer (optax, with its learning-rate schedule, from the `opt` group) and counters,
split once into static graphs and a pytree of arrays keyed by field name (`state["model"]`, `state["counters"]`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from transformer_jax.errors import ConfigError
from transformer_jax.model import Transformer, build_model, model_rngs

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


def new_train_state(config: ml_collections.ConfigDict) -> TrainState:
    """Model + optimizer + counters built from the config; the one schedule goes to the optimizer and the state."""
    model = build_model(config, rngs=model_rngs(config.train.seed))
    schedule = learning_rate_schedule(config.opt, config.train.num_steps)
    optimizer = nnx.Optimizer(model, make_optimizer(config.opt, schedule), wrt=nnx.Param)
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
