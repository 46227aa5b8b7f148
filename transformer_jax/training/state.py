"""The train state: model, optimizer and counters under their names, split once into a static graph and arrays.

`nnx.split(TrainState)` gives a pytree of arrays whose top-level keys are the field names (`state["model"]`,
`state["optimizer"]["step"]`, `state["counters"]`); the step functions merge it back and use the fields by name.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from transformer_jax.model import Transformer, build_model, model_rngs
from transformer_jax.training.optim import learning_rate_schedule, make_optimizer


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
    """Static halves of the TrainState: one with dropout on (train), one with it off (eval); and the learning rate
    of each step (0-based), as the optimizer applies it, which the metrics log."""

    train: nnx.GraphDef
    eval: nnx.GraphDef
    learning_rate: optax.Schedule


def create_model(config: ml_collections.ConfigDict, seed: int) -> Transformer:
    return build_model(config, rngs=model_rngs(seed))


def new_train_state(config: ml_collections.ConfigDict) -> TrainState:
    """Model + optimizer + counters built from the config (arrays allocated and initialised). The learning-rate
    schedule is built here, once: the optimizer applies it and the TrainState keeps it for the metrics."""
    model = create_model(config, config.train.seed)
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
    """The same as create_train_state with shapes only (no memory, no compute): for restoring and dry runs."""
    return split_train_state(nnx.eval_shape(lambda: new_train_state(config)))


def eval_model(graphs: Graphs, state: nnx.State) -> Transformer:
    """The model of a train state with dropout off (for validation and translation)."""
    return nnx.merge(graphs.eval, state).model


def model_params(state: nnx.State) -> nnx.State:
    """The model's parameters inside a train state."""
    return nnx.filter_state(state["model"], nnx.Param)
