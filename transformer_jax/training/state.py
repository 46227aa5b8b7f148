"""The train state: model, optimizer and counters, split once into a static graph and a pytree of arrays."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from transformer_jax.model import Transformer, build_model
from transformer_jax.training.optim import make_optimizer


class Counters(nnx.Module):
    """Non-finite updates skipped: in a row (reset by a good step) and in total."""

    def __init__(self):
        self.nonfinite_in_a_row = nnx.Variable(jnp.zeros((), jnp.int32))
        self.nonfinite_total = nnx.Variable(jnp.zeros((), jnp.int32))


@dataclasses.dataclass(frozen=True)
class Graphs:
    """Static halves of (model, optimizer, counters): one with dropout on (train), one with it off (eval)."""

    train: nnx.GraphDef
    eval: nnx.GraphDef


def create_model(config: ml_collections.ConfigDict, seed: int) -> Transformer:
    # Separate streams: parameter init and dropout draw from different keys of the same seed. Dropout keys use
    # XLA's RngBitGenerator ("rbg"): on CPU, threefry bits for every activation cost ~20% of a train step, rbg ~10%.
    return build_model(config, rngs=nnx.Rngs(params=seed, dropout=jax.random.key(seed + 1, impl="rbg")))


def create_train_state(config: ml_collections.ConfigDict) -> tuple[Graphs, nnx.State]:
    """Builds model + optimizer + counters from the config and splits them (state: a pytree of arrays)."""
    model = create_model(config, config.train.seed)
    optimizer = nnx.Optimizer(model, make_optimizer(config.opt, config.train.num_steps), wrt=nnx.Param)
    counters = Counters()
    model.eval()
    eval_graph, _ = nnx.split((model, optimizer, counters))
    model.train()
    train_graph, state = nnx.split((model, optimizer, counters))
    return Graphs(train=train_graph, eval=eval_graph), state


def abstract_train_state(config: ml_collections.ConfigDict) -> tuple[Graphs, nnx.State]:
    """The same as create_train_state with shapes only (no memory, no compute): for restoring and dry runs."""
    out = {}

    def build():
        graphs, state = create_train_state(config)
        out["graphs"] = graphs
        return state

    state = jax.eval_shape(build)
    return out["graphs"], state


def model_params(state: nnx.State) -> nnx.State:
    """The model's parameters inside a train state."""
    return nnx.filter_state(state[0], nnx.Param)


def step_of(state: nnx.State):
    """The optimizer step counter (an array)."""
    return state[1]["step"].get_value()
