"""The named train state and its checkpoints: fields by name, and checkpoints of the older positional layout and
of the configs before list-valued keys were tuples."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from configs import common
from transformer_jax.errors import CheckpointError
from transformer_jax.model import Transformer
from transformer_jax.training import checkpoints
from transformer_jax.training.step import (
    Counters,
    TrainState,
    abstract_train_state,
    create_train_state,
    model_params,
)


def _config():
    config = common.base_config("tiny")
    config.model.vocab_size = 40
    return config


def _distinct(state: nnx.State) -> nnx.State:
    """The state with every float array changed, so a restore that silently returns fresh values would show."""
    return jax.tree.map(lambda x: x * 1.5 + 0.25 if jnp.issubdtype(x.dtype, jnp.floating) else x, state)


def _raw(x: jax.Array) -> jax.Array:
    """The bits of a PRNG key (the dropout stream), or the array itself."""
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def test_fields_are_addressed_by_name():
    graphs, state = create_train_state(_config())
    assert set(state.keys()) == set(TrainState.FIELDS)
    assert int(state["optimizer"]["step"].get_value()) == 0
    assert int(state["counters"]["nonfinite_total"].get_value()) == 0
    merged = nnx.merge(graphs.train, state)
    assert isinstance(merged.model, Transformer) and isinstance(merged.optimizer, nnx.Optimizer)
    assert isinstance(merged.counters, Counters)


def _save_positional(workdir, step, state, config) -> None:
    """A checkpoint as written before the fields had names: the state under the top-level keys 0, 1, 2."""
    pure = nnx.to_pure_dict(state)
    positional = {i: pure[name] for i, name in enumerate(TrainState.FIELDS)}
    manager = checkpoints._manager(workdir)
    manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(positional),
            data=ocp.args.JsonSave({"iterator": {"window": 7}}),
            config=ocp.args.JsonSave(config.to_dict()),
        ),
        force=True,
    )
    manager.wait_until_finished()
    manager.close()


def test_checkpoints_with_positional_keys_restore_for_training_and_evaluation(tmp_path):
    config = _config()
    _, state = create_train_state(config)
    state = _distinct(state)
    _save_positional(tmp_path, 5, state, config)

    _, abstract = abstract_train_state(config)
    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract)
    step, restored, data_state = checkpoints.Checkpointer(tmp_path, config.ckpt).restore_latest(
        abstract, shardings, config
    )
    assert step == 5 and data_state == {"window": 7}
    expected, got = nnx.to_pure_dict(state), nnx.to_pure_dict(restored)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(_raw(a), _raw(b))

    params = checkpoints.load_model_params(tmp_path, 5, abstract)
    for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(model_params(state))), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_named_checkpoints_round_trip(tmp_path):
    config = _config()
    _, state = create_train_state(config)
    state = _distinct(state)
    saver = checkpoints.Checkpointer(tmp_path, config.ckpt)
    saver.save(2, state, {"window": 1}, config)
    saver.close()
    assert set(checkpoints._saved_tree(tmp_path, 2)) == set(TrainState.FIELDS)
    _, abstract = abstract_train_state(config)
    params = checkpoints.load_model_params(tmp_path, 2, abstract)
    for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(model_params(state))), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_saved_with_comma_joined_lists_resumes_with_the_same_values_as_tuples(tmp_path):
    """Its config (written before the list-valued keys were tuples) holds data.corpora and opt.freeze, which a
    restart must keep, as strings: the restore compares them in today's form (bookkeeping.upgrade_config)."""
    config = _config()
    config.data.corpora, config.opt.freeze = (("a", "text", "/d", 1.0, ""),), ("encoder_layers",)
    old = config.to_dict()
    old["data"]["corpora"], old["opt"]["freeze"] = "a=text:/d:1", "encoder_layers"
    _, state = create_train_state(config)
    saver = checkpoints.Checkpointer(tmp_path, config.ckpt)
    saver.save(4, state, {"window": 1}, ml_collections.ConfigDict(old))
    saver.close()
    _, abstract = abstract_train_state(config)
    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract)
    assert checkpoints.Checkpointer(tmp_path, config.ckpt).restore_latest(abstract, shardings, config)[0] == 4
    config.data.corpora = (("a", "text", "/d", 2.0, ""),)
    with pytest.raises(CheckpointError, match=r"differing keys \(saved -> current\): data.corpora: "):
        checkpoints.Checkpointer(tmp_path, config.ckpt).restore_latest(abstract, shardings, config)
