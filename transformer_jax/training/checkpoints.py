"""Orbax checkpoints in WORKDIR/checkpoints: the train state, the data iterator position and the config.

Each checkpoint holds everything needed to continue exactly: model parameters, optimizer state, dropout RNG state,
step and non-finite counters (item `state`, keyed by the TrainState fields "model", "optimizer", "counters"), the
data iterator state (item `data`) and the config (item `config`). Checkpoints written before the fields had names
keep them under 0, 1, 2 (the same order); they restore for training and for evaluation alike.
With several processes each writes its shards of `state`; the JSON items are written by process 0 alone, which is
right because every host's iterator state is the same (hosts plan the same global batches; see data.pipeline).
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from flax import nnx
from flax.traverse_util import flatten_dict

from transformer_jax.errors import CheckpointError
from transformer_jax.training.state import TrainState

ITEMS = ("state", "data", "config")
# Keys whose change makes a checkpoint unusable (the parameter or optimizer structure, or what the tokens mean).
# Others (dtype, attention kernel, dropout, schedule, steps, logging) may change on resume.
STRUCTURAL_KEYS = (
    "model.vocab_size",
    "model.d_model",
    "model.num_heads",
    "model.num_kv_heads",
    "model.qk_head_dim",
    "model.v_head_dim",
    "model.d_ff",
    "model.num_encoder_layers",
    "model.num_decoder_layers",
    "model.activation",
    "model.norm",
    "model.norm_position",
    "model.positional",
    "model.max_len",
    "model.share_embeddings",
    "model.tie_output",
    "opt.optimizer",
    "data.src_lang",
    "data.tgt_lang",
    "data.tokenizer_type",
)


def checkpoint_dir(workdir: str | pathlib.Path) -> pathlib.Path:
    return pathlib.Path(workdir).resolve() / "checkpoints"


def config_differences(saved: dict, current: dict, keys: tuple[str, ...] = STRUCTURAL_KEYS) -> list[str]:
    """'key: saved -> current' for every structural key that differs."""
    a, b = flatten_dict(saved, sep="."), flatten_dict(current, sep=".")
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def _manager(workdir, *, keep: int | None = None, async_save: bool = False, read_only: bool = False):
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=async_save, create=not read_only
    )
    return ocp.CheckpointManager(checkpoint_dir(workdir), options=options, item_names=ITEMS)


def list_steps(workdir: str | pathlib.Path) -> list[int]:
    """Steps with a finished checkpoint, ascending."""
    if not checkpoint_dir(workdir).is_dir():
        return []
    return sorted(_manager(workdir, read_only=True).all_steps())


def _abstract(tree, shardings=None):
    """ShapeDtypeStructs (with shardings) to restore into, from a pure dict of arrays or ShapeDtypeStructs."""
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _saved_keys(workdir: str | pathlib.Path, step: int) -> dict[str, Any]:
    """TrainState field -> the top-level key the checkpoint of `step` stores it under: the field's name, or its
    position 0, 1, 2 in a checkpoint written before the fields had names."""
    # The saved tree's metadata, read by a bare handler: a manager knows it only after a save in this process, and
    # a checkpointer would synchronise the hosts.
    handler = ocp.PyTreeCheckpointHandler()
    try:
        saved = set(handler.metadata(checkpoint_dir(workdir) / str(step) / "state").tree.keys())
    finally:
        handler.close()
    if saved == {str(i) for i in range(len(TrainState.FIELDS))}:
        return {name: i for i, name in enumerate(TrainState.FIELDS)}
    return {name: name for name in TrainState.FIELDS}


class Checkpointer:
    """Saves every `ckpt.every_steps` (asynchronously), keeps the last `ckpt.keep`, restores the latest good one."""

    def __init__(self, workdir: str | pathlib.Path, ckpt: ml_collections.ConfigDict):
        self.workdir = pathlib.Path(workdir)
        self.manager = _manager(workdir, keep=ckpt.keep, async_save=ckpt.async_save)

    def save(self, step: int, state: nnx.State, data_state: Any, config: ml_collections.ConfigDict) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(nnx.to_pure_dict(state)),
                data=ocp.args.JsonSave({"iterator": data_state}),
                config=ocp.args.JsonSave(json.loads(config.to_json())),
            ),
            force=True,
        )

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def restore_latest(
        self, abstract_state: nnx.State, shardings, config: ml_collections.ConfigDict
    ) -> tuple[int, nnx.State, Any] | None:
        """(step, state, data iterator state) of the newest checkpoint that restores, or None if there is none.

        A damaged newest checkpoint is reported and the one before it is tried. A checkpoint written by an
        incompatible config is an error that lists the differing keys.
        """
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            return None
        current = json.loads(config.to_json())
        target = _abstract(nnx.to_pure_dict(abstract_state), nnx.to_pure_dict(shardings))
        errors = []
        for step in steps:
            try:
                saved_config = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
            except Exception as e:  # noqa: BLE001 - any failure to read means this checkpoint is damaged
                errors.append(f"step {step}: {type(e).__name__}: {e}")
                logging.error("checkpoint %d in %s is damaged (%s); trying the previous one", step, self.workdir, e)
                continue
            diff = config_differences(saved_config.config, current)
            if diff:
                raise CheckpointError(
                    f"the checkpoint at step {step} in {checkpoint_dir(self.workdir)} was written with a different "
                    f"config; differing keys (saved -> current): {'; '.join(diff)}. Use a new --workdir or the "
                    "saved config (config item of the checkpoint)."
                )
            try:
                keys = _saved_keys(self.workdir, step)
                on_disk = {keys[name]: target[name] for name in TrainState.FIELDS}
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(state=ocp.args.StandardRestore(on_disk), data=ocp.args.JsonRestore()),
                )
            except Exception as e:  # noqa: BLE001
                errors.append(f"step {step}: {type(e).__name__}: {e}")
                logging.error("checkpoint %d in %s is damaged (%s); trying the previous one", step, self.workdir, e)
                continue
            state = jax.tree.map(lambda x: x, abstract_state)  # a copy to fill
            nnx.replace_by_pure_dict(state, {name: restored.state[keys[name]] for name in TrainState.FIELDS})
            return step, state, restored.data["iterator"]
        raise CheckpointError(f"no checkpoint in {checkpoint_dir(self.workdir)} could be read: {errors}")


def load_config(workdir: str | pathlib.Path, step: int | None = None) -> ml_collections.ConfigDict:
    """The config saved with a checkpoint (the latest by default)."""
    steps = list_steps(workdir)
    if not steps:
        raise CheckpointError(f"no checkpoint in {checkpoint_dir(workdir)}; train first or pass the right --workdir")
    step = steps[-1] if step is None else step
    restored = _manager(workdir, read_only=True).restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    return ml_collections.ConfigDict(restored.config)


def load_model_params(workdir: str | pathlib.Path, step: int, abstract_state: nnx.State) -> dict:
    """The model parameters of one checkpoint as a pure dict (nnx.to_pure_dict of nnx.state(model, nnx.Param)).

    abstract_state is the abstract train state of the config (training.state.abstract_train_state); only the model
    parameters are read from disk.
    """
    steps = list_steps(workdir)
    if step not in steps:
        raise CheckpointError(f"no checkpoint for step {step} in {checkpoint_dir(workdir)}; available steps: {steps}")
    key = _saved_keys(workdir, step)["model"]
    target = {key: _abstract(nnx.to_pure_dict(nnx.filter_state(abstract_state["model"], nnx.Param)))}
    # Read only the model's parameters: the optimizer state and counters are left out of the restore target. The
    # restore arguments carry this process's device for every array: without them Orbax reuses the saved shardings,
    # which fails for a checkpoint written by other devices (another host, FSDP over 8 GPUs).
    restore = ocp.args.PyTreeRestore(
        target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
    )
    restored = _manager(workdir, read_only=True).restore(step, args=ocp.args.Composite(state=restore))
    return restored.state[key]
