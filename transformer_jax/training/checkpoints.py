"""Orbax checkpoints in WORKDIR/checkpoints: everything needed to continue exactly.

Items: `state` (the TrainState fields "model", "optimizer", "counters": parameters, optimizer state, dropout RNG,
step and non-finite counters), `data` (the iterator position and the selection record), `config`, and `checksums`
of `state`'s arrays; beside them `digests.json` (training.bookkeeping holds both checks and the migrations of earlier
layouts). With several processes each writes its shards of `state` and process 0 alone the JSON items: every host's
iterator state is the same (hosts plan the same global batches; see data.pipeline).

A LoRA run's checkpoint (opt.lora_rank > 0) holds everything but the frozen base's parameters, and names its base in
the `data` item: {"workdir", "step", "checksum"} (`base_record`); restoring it reads the base again and refuses one
whose parameters changed or cannot be read (`load_base`).

A checkpoint that cannot be read or verified is reported in one line naming its step and what is wrong; training
then falls back to the one before it and moves the damaged one aside (`<step>.damaged-<time>`, never deleted).

Best checkpoints (ckpt.keep_best, ranked by train.select_metric): a save at a validation carries its scores in
Orbax's `metrics` item, and a save removes only what neither LatestN (ckpt.keep) nor BestN (ckpt.keep_best) keeps
(AnyPreservationPolicy), so the best are never rotated away.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import pathlib
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from flax import nnx
from flax.traverse_util import flatten_dict
from jax.experimental import multihost_utils

from transformer_jax import runtime
from transformer_jax.config import schema
from transformer_jax.errors import CheckpointError, DiskFullError
from transformer_jax.model.lora import BASE, LoRASpec
from transformer_jax.training import bookkeeping
from transformer_jax.training.step import TrainState

ITEMS = ("state", "data", "config", "checksums")
STRUCTURAL_KEYS = schema.MUST_MATCH  # keys whose change makes a checkpoint unusable (marked MATCH in schema.KEYS)


def checkpoint_dir(workdir: str | pathlib.Path) -> pathlib.Path:
    return pathlib.Path(workdir).resolve() / "checkpoints"


def config_differences(saved: dict, current: dict, keys: tuple[str, ...] = STRUCTURAL_KEYS) -> list[str]:
    """'key: saved -> current' for every structural key that differs. A key the saved config lacks was added
    after it was written: that run had the key's default (when it does not depend on the model size)."""
    a, b = flatten_dict(saved, sep="."), flatten_dict(current, sep=".")
    for k in keys:
        default = schema.BY_NAME[k].default if k in schema.BY_NAME else None
        a.setdefault(k, None if callable(default) else default)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def _manager(workdir, *, read_only: bool = False, async_save: bool = False, **options) -> ocp.CheckpointManager:
    """Orbax's manager of WORKDIR/checkpoints (`options`: more CheckpointManagerOptions). A reader does not read every
    checkpoint's scores: one damaged file would make the constructor raise (best_scores reports it and goes on)."""
    options = ocp.CheckpointManagerOptions(
        create=not read_only, lightweight_initialize=read_only, enable_async_checkpointing=async_save, **options
    )
    return ocp.CheckpointManager(checkpoint_dir(workdir), options=options, item_names=ITEMS)


def _rotation(keep: int, select_metric: str | None, keep_best: int) -> dict[str, Any]:
    """The options that choose what a save removes: all but the last `keep`, and with `select_metric` (saves then
    write their scores, Orbax's `metrics` item) only what neither those nor the `keep_best` best scored ones hold."""
    if select_metric is None:
        return {"max_to_keep": keep}
    lower = select_metric in bookkeeping.LOWER_IS_BETTER
    return {
        "best_fn": lambda metrics: bookkeeping.rank(metrics, select_metric),  # writes the metrics item
        "best_mode": "min" if lower else "max",
        "preservation_policy": ocp.checkpoint_managers.AnyPreservationPolicy(
            [
                ocp.checkpoint_managers.LatestN(n=keep),
                ocp.checkpoint_managers.BestN(
                    get_metric_fn=lambda metrics: bookkeeping.rank(metrics, select_metric),
                    reverse=lower,  # sorted worst first, the last n kept
                    n=keep_best,
                    keep_checkpoints_without_metrics=False,
                ),
            ]
        ),
    }


def list_steps(workdir: str | pathlib.Path) -> list[int]:
    """Steps with a finished checkpoint, ascending."""
    if not checkpoint_dir(workdir).is_dir():
        return []
    return sorted(_manager(workdir, read_only=True).all_steps())


def _damaged_scores(workdir: str | pathlib.Path) -> dict[int, str]:
    """step -> what is wrong, for every checkpoint whose saved scores (Orbax's `metrics` item) cannot be read."""
    damaged = {}
    for path in checkpoint_dir(workdir).glob("*/metrics/metrics"):
        step = path.parent.parent.name
        if not step.isdigit():  # a checkpoint moved aside, or an unfinished save
            continue
        try:
            json.loads(path.read_text())
        except (OSError, ValueError) as e:
            damaged[int(step)] = f"its scores ({path}) cannot be read: {describe_error(e)}"
    return damaged


def best_scores(workdir: str | pathlib.Path) -> list[tuple[int, float]]:
    """(step, score) of every checkpoint saved with a score of train.select_metric (as the latest checkpoint's
    config names it), best first; ties go to the earlier step. Empty when no checkpoint carries one."""
    steps, metric = list_steps(workdir), None
    for step in reversed(steps):  # the newest config that can be read (a damaged one is skipped, as on restore)
        with contextlib.suppress(CheckpointError):
            metric = load_config(workdir, step).train.get("select_metric", None)
            break
    if metric is None:
        return []
    manager = _manager(workdir, read_only=True)
    scored = []
    for step in steps:
        try:
            metrics = manager.metrics(step)
        except Exception as e:  # a damaged score file: that checkpoint is not ranked
            logging.warning("the scores of the checkpoint at step %d cannot be read (%s)", step, describe_error(e))
            continue
        if metrics is not None and metric in metrics and not math.isnan(float(metrics[metric])):
            scored.append((step, float(metrics[metric])))
    sign = 1.0 if metric in bookkeeping.LOWER_IS_BETTER else -1.0
    return sorted(scored, key=lambda item: (sign * item[1], item[0]))


def best_steps(workdir: str | pathlib.Path) -> list[int]:
    """The steps of the checkpoints with a score of train.select_metric, best first (`best_scores`)."""
    return [step for step, _ in best_scores(workdir)]


def describe_error(e: BaseException, limit: int = 300) -> str:
    """One line for a failure to read a checkpoint: the innermost cause's type and the first line of its message
    (Orbax's errors arrive wrapped in asyncio and TensorStore layers hundreds of lines long)."""
    seen = set()
    while id(e) not in seen and (e.__cause__ or e.__context__) is not None:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_loop_closed(exc: BaseException | None) -> bool:
    """TensorStore completing a read or write after the Orbax call failed and closed its event loop."""
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


def _is_restore_noise(exc: BaseException | None) -> bool:
    """What a failed asynchronous restore leaves behind: reads of other arrays failing in coroutines nobody awaits
    any more (Orbax's wrapper, or TensorStore's ValueError), and callbacks reaching the closed event loop."""
    return (
        _is_loop_closed(exc)
        or (type(exc) is Exception and str(exc).startswith("Encountered error while reading array index"))
        or (isinstance(exc, ValueError) and "tensorstore_spec=" in str(exc))
    )


def _is_save_noise(exc: BaseException | None) -> bool:
    """What a save that filled the disk leaves behind: every thread's report of it, and writes completed late."""
    return runtime.is_disk_full(exc) or _is_loop_closed(exc)


class _OrbaxLogFilter(logging.Filter):
    """Drops the records of Orbax's loggers ("absl": its threads, "asyncio": coroutines whose exception nobody
    retrieved) whose exception `drop` selects, while attached (a `with` block, or around an asynchronous save until
    it is awaited): Orbax reports one failure from every thread and coroutine, and the caller reports it once."""

    LOGGERS = ("absl", "asyncio")

    def __init__(self, drop: Callable[[BaseException | None], bool]):
        super().__init__()
        self.drop = drop

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and self.drop(record.exc_info[1]))

    def attach(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)  # adding one already attached does nothing

    def detach(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)

    __enter__ = attach

    def __exit__(self, *exc_info) -> None:
        self.detach()


def _damage(workdir: str | pathlib.Path, step: int, items: tuple[str, ...]) -> str | None:
    """What is missing from the checkpoint directory of `step` (an item, or the state's _METADATA) or differs from
    its digests (those of `items` and of the checksums read with them), or None. Called before Orbax opens it."""
    path = checkpoint_dir(workdir) / str(step)
    for item in items:
        if not (path / item).is_dir():
            return f"its item {item!r} is missing ({path / item})"
    if "state" in items and not (path / "state" / "_METADATA").is_file():
        return f"its state metadata is missing ({path / 'state' / '_METADATA'})"
    return bookkeeping.digest_problem(path, (*items, "checksums"))


def move_aside(workdir: str | pathlib.Path, step: int) -> pathlib.Path:
    """Renames the checkpoint of `step` to `<step>.damaged-<UTC time>`, which Orbax does not list (never deleted)."""
    source = checkpoint_dir(workdir) / str(step)
    target = source.with_name(f"{step}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    name, n = target.name, 1
    while target.exists():
        target, n = target.with_name(f"{name}-{n}"), n + 1
    source.rename(target)
    return target


def _abstract(tree, shardings=None):
    """ShapeDtypeStructs (with shardings) to restore into, from a pure dict of arrays or ShapeDtypeStructs."""
    if shardings is None:
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def saved_part(state: nnx.State, config: ml_collections.ConfigDict) -> nnx.State:
    """What a checkpoint holds of a train state (or of its shardings): all of it, or under LoRA all but the base's
    parameters, which stay where train.init_from has them."""
    return nnx.filter_state(state, nnx.Not(BASE)) if LoRASpec.of(config) else state


def base_checksum(params: dict) -> str:
    """One sha256 of the per-array checksums of a pure dict of parameters (bookkeeping.checksums)."""
    return hashlib.sha256(json.dumps(bookkeeping.checksums(params), sort_keys=True).encode()).hexdigest()[:32]


def base_record(workdir: str | pathlib.Path, step: int, params: dict) -> dict:
    """What a LoRA run's checkpoints say of their base: its workdir, its step and the checksum of its parameters."""
    return {"workdir": str(workdir), "step": int(step), "checksum": base_checksum(params)}


def load_base(record: dict | None, abstract_state: nnx.State, where: str) -> dict:
    """The base parameters (a pure dict) that the adapters of `where` (a checkpoint, in words) were trained on, read
    from the workdir and step of their record; CheckpointError naming the base when it is missing, unreadable or
    changed since. abstract_state: the run's abstract train state (training.step.abstract_train_state)."""
    if not record:
        raise CheckpointError(
            f"{where} holds LoRA adapters (its config has opt.lora_rank > 0) but no record of their base; it was not "
            "written by a LoRA run: evaluate it with the config it was trained with"
        )
    base = f"base {record['workdir']} (step {record['step']})"
    try:
        params = load_model_params(record["workdir"], record["step"], abstract_state)
    except CheckpointError as e:
        raise CheckpointError(
            f"the adapters of {where} need their {base}, which cannot be read ({e}); restore that workdir"
        ) from None
    if (checksum := base_checksum(params)) != record["checksum"]:
        raise CheckpointError(
            f"the adapters of {where} were trained on the {base} with parameter checksum {record['checksum']}, but it "
            f"now holds {checksum}: the base changed; restore it, or train new adapters on the new one"
        )
    return params


def load_base_record(workdir: str | pathlib.Path, step: int) -> dict | None:
    """The base record a LoRA run's checkpoint of `step` keeps in its `data` item, or None."""
    where = f"the checkpoint at step {step} in {checkpoint_dir(workdir)}"
    if problem := _damage(workdir, step, ("data",)):
        raise CheckpointError(f"{where} is damaged: {problem}")
    try:
        restored = _manager(workdir, read_only=True).restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))
    except Exception as e:  # any failure to read is a damaged checkpoint
        raise CheckpointError(f"the data item of {where} cannot be read: {describe_error(e)}") from None
    return restored.data.get("base")


def _saved_tree(workdir: str | pathlib.Path, step: int) -> dict[str, Any]:
    """The metadata tree (Orbax's ArrayMetadata leaves: shape, dtype) of the state the checkpoint of `step` holds."""
    # A bare handler: a manager knows the metadata only after a save in this process; a checkpointer syncs the hosts.
    handler = ocp.PyTreeCheckpointHandler()
    try:
        return handler.metadata(checkpoint_dir(workdir) / str(step) / "state").tree
    finally:
        handler.close()


def _misfit(saved: dict, target: dict) -> str | None:
    """The first array of `target` whose shape differs from the one the metadata tree `saved` records, in words, or
    None. Checked before Orbax reads: a read that fails leaves the other arrays' reads pending, and at exit Python
    reports each of them as an ignored exception hundreds of lines long."""
    shapes = {"/".join(map(str, path)): getattr(leaf, "shape", None) for path, leaf in flatten_dict(saved).items()}
    for path, leaf in flatten_dict(target).items():
        name = "/".join(map(str, path))
        stored = shapes.get(name)
        if stored is not None and tuple(stored) != tuple(leaf.shape):
            return f"its array {name} has shape {tuple(stored)}, but the config builds {tuple(leaf.shape)}"
    return None


class Checkpointer:
    """Saves every `ckpt.every_steps` (asynchronously), keeps the last `ckpt.keep`, restores the latest good one."""

    def __init__(self, workdir: str | pathlib.Path, ckpt: ml_collections.ConfigDict, select_metric: str | None = None):
        """`select_metric`: train.select_metric if the run ranks its validations; saves then carry their scores."""
        self.workdir = pathlib.Path(workdir)
        # A manager that ranks checkpoints reads every checkpoint's scores when it starts, and one damaged score file
        # would stop it: such a checkpoint is moved aside first, and the restore falls back past it.
        self._move_aside(_damaged_scores(workdir) if jax.process_index() == 0 else {})
        self.manager = _manager(
            workdir,
            async_save=ckpt.async_save,
            # A save that a crash or a full disk left unfinished (`<step>.orbax-checkpoint-tmp`) is removed when the
            # next run starts; Orbax never lists it as a checkpoint.
            cleanup_tmp_directories=True,
            # Called by an asynchronous save on process 0 once its files are written, before it is renamed into place.
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_digests) if ckpt.async_save else None,
            **_rotation(ckpt.keep, select_metric, ckpt.get("keep_best", 0)),
        )
        self.selection: dict | None = None  # the selection record of the checkpoint restore_latest restored
        self.base: dict | None = None  # a LoRA run's base record (base_record): restored, and written with every save
        self._async = ckpt.async_save
        self._in_flight: tuple[int, int] | None = None  # (step, bytes) of a save not yet awaited
        self._log_filter = _OrbaxLogFilter(_is_save_noise)
        self._failed = False

    def save(
        self,
        step: int,
        state: nnx.State,
        data_state: Any,
        config: ml_collections.ConfigDict,
        rotate: bool = True,
        metrics: dict[str, float] | None = None,
        selection_record: dict | None = None,
    ) -> None:
        """Saves the checkpoint of `step`; rotate=False keeps every older one, for a state that may be worse (a stop
        after non-finite updates). `metrics`: this step's validation scores; `selection_record`: a SelectionRecord's.
        Under LoRA the base's parameters are left out (`saved_part`) and `self.base` names them.
        A full disk (now, at an earlier asynchronous save, or too little free space for the checkpoint) is a
        DiskFullError (`_disk_full`); ckpt.keep then has removed nothing."""
        self.wait()  # the previous save's failure is reported for its own step, before this one starts
        pure = nnx.to_pure_dict(saved_part(state, config))
        # Hashed before the save starts: the arrays are valid until the next train step donates them.
        sums = {"version": bookkeeping.CHECKSUMS_VERSION, "arrays": bookkeeping.checksums(pure)}
        manager = self.manager if rotate else _manager(self.workdir)
        needed = self._space_needed(step, sum(x.nbytes for x in jax.tree.leaves(pure)))
        if runtime.free_bytes(checkpoint_dir(self.workdir)) < needed:  # Orbax's threads would fail one by one
            raise self._disk_full(step, needed)
        synchronous = not (rotate and self._async)  # else Orbax's thread writes the digests (on_saved)
        self._in_flight = (step, needed)
        self._log_filter.attach()  # detached once the save is awaited (wait) or has failed (_saving)
        with self._saving():
            manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(pure),
                    data=ocp.args.JsonSave(
                        {"iterator": data_state, "selection": selection_record}
                        | ({"base": self.base} if self.base is not None else {})
                    ),
                    config=ocp.args.JsonSave(json.loads(config.to_json())),
                    checksums=ocp.args.JsonSave(sums),
                ),
                metrics=metrics,
                force=True,
            )
            if not rotate:
                manager.close()  # waits for the save
            if synchronous:
                self._write_digests()
        if synchronous:
            self.wait()
        if not rotate:
            self.manager.reload()  # it lists the step another manager saved

    def _write_digests(self) -> None:
        """Writes the digests of the checkpoint being saved (process 0): from Orbax's thread for an asynchronous save,
        into the unfinished directory, so that a listed checkpoint has them; after a synchronous one, into its own."""
        if jax.process_index() != 0:
            return
        step, directory = self._in_flight[0], checkpoint_dir(self.workdir)
        unfinished = sorted(directory.glob(f"{step}.orbax-checkpoint-tmp*"))
        bookkeeping.write_digests(unfinished[-1] if unfinished else directory / str(step), ITEMS)

    def wait(self) -> None:
        """Waits for an asynchronous save; DiskFullError (`_disk_full`) if the disk filled up during it."""
        if self._in_flight is None:
            return
        with self._saving():
            self.manager.wait_until_finished()
        self._in_flight = None
        self._log_filter.detach()

    @contextlib.contextmanager
    def _saving(self) -> Iterator[None]:
        """Around the save in flight: if it fails, its unfinished directory is removed and a full disk re-raised as one
        DiskFullError line (any other failure is a bug and keeps its traceback)."""
        try:
            yield
        except Exception as e:
            step, needed = self._in_flight
            self._in_flight, self._failed = None, True
            self._log_filter.detach()
            if jax.process_index() == 0:
                for tmp in checkpoint_dir(self.workdir).glob(f"{step}.orbax-checkpoint-tmp*"):
                    shutil.rmtree(tmp, ignore_errors=True)
            if runtime.is_disk_full(e):
                raise self._disk_full(step, needed) from None
            raise

    def _space_needed(self, step: int, array_bytes: int) -> int:
        """Bytes a checkpoint of `step` takes: what the last finished one took on disk (metadata included), else its
        arrays' bytes. Orbax writes a new checkpoint before ckpt.keep removes an old one, so the whole must fit."""
        directory = checkpoint_dir(self.workdir)
        finished = sorted(s for s in self.manager.all_steps() if s != step and (directory / str(s)).is_dir())
        if not finished:
            return array_bytes
        return max(array_bytes, sum(f.stat().st_size for f in (directory / str(finished[-1])).rglob("*")))

    def _disk_full(self, step: int, needed: int) -> DiskFullError:
        directory = checkpoint_dir(self.workdir)
        finished = [s for s in list_steps(self.workdir) if s != step]
        last = f"step {finished[-1]}, kept" if finished else "none"
        again = f"resumes from step {finished[-1]}" if finished else "starts again"
        return DiskFullError(
            f"disk full while saving the checkpoint of step {step} in {directory} "
            f"({runtime.space_report(directory, needed)}); the unfinished save was removed and the last finished "
            f"checkpoint is {last}. Free space there and run the same command again: it {again}"
        )

    def close(self) -> None:
        """Waits for a save in flight and closes; after a failed save, closes without waiting again."""
        try:
            self.wait()
        finally:
            if not self._failed:
                self.manager.close()

    def restore_latest(
        self, abstract_state: nnx.State, shardings, config: ml_collections.ConfigDict
    ) -> tuple[int, nnx.State, Any] | None:
        """(step, state, data iterator state) of the newest checkpoint that restores, or None if there is none. A
        damaged one is reported and the one before it tried; once one restores, the damaged newer ones are moved aside
        so that this run can save at their steps again. An incompatible config's is an error naming the keys. Under
        LoRA the base's parameters stay abstract: the caller reads them (`load_base` of `self.base`)."""
        current = json.loads(config.to_json())
        target = _abstract(
            nnx.to_pure_dict(saved_part(abstract_state, config)), nnx.to_pure_dict(saved_part(shardings, config))
        )
        damaged: dict[int, str] = {}
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                with _OrbaxLogFilter(_is_restore_noise):
                    restored, keys = self._restore(step, target, current)
            except _Damaged as e:
                damaged[step] = str(e)
                logging.error("checkpoint %d in %s is damaged (%s); trying the previous one", step, self.workdir, e)
                continue
            if damaged:
                self._move_aside(damaged)
                self.manager.reload()
            state = jax.tree.map(lambda x: x, abstract_state)  # a copy to fill
            nnx.replace_by_pure_dict(state, {name: restored.state[keys[name]] for name in TrainState.FIELDS})
            self.selection = restored.data.get("selection")
            self.base = restored.data.get("base")
            return step, state, restored.data["iterator"]
        if not damaged:
            return None
        errors = "; ".join(f"step {step}: {problem}" for step, problem in damaged.items())
        raise CheckpointError(
            f"no checkpoint in {checkpoint_dir(self.workdir)} could be read ({errors}); move the damaged "
            "step directories aside to start again, or use a new --workdir"
        )

    def _restore(self, step: int, target: dict, current: dict):
        """(restored Composite, TrainState field -> saved key) of one checkpoint; _Damaged if it cannot be used."""
        if problem := _damage(self.workdir, step, ("config", "state", "data")):
            raise _Damaged(problem)
        try:
            saved_config = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        except Exception as e:  # any failure to read means this checkpoint is damaged
            raise _Damaged(f"its config cannot be read: {describe_error(e)}") from None
        # In today's keys and values, as load_config reads it: a config saved before a key was added, or before a
        # list-valued key held a tuple (its comma-joined string), is the same run's.
        saved = json.loads(bookkeeping.upgrade_config(ml_collections.ConfigDict(saved_config.config)).to_json())
        if diff := config_differences(saved, current):
            raise CheckpointError(
                f"the checkpoint at step {step} in {checkpoint_dir(self.workdir)} was written with a different "
                f"config; differing keys (saved -> current): {'; '.join(diff)}. Use a new --workdir or the "
                "saved config (config item of the checkpoint)."
            )
        try:
            keys = bookkeeping.state_keys(_saved_tree(self.workdir, step).keys(), TrainState.FIELDS)
            on_disk = {keys[name]: target[name] for name in TrainState.FIELDS}
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(on_disk), data=ocp.args.JsonRestore())
            )
        except Exception as e:
            raise _Damaged(f"its state cannot be read: {describe_error(e)}") from None
        if problem := bookkeeping.checksum_problem(checkpoint_dir(self.workdir) / str(step), restored.state):
            raise _Damaged(problem)
        return restored, keys

    def _move_aside(self, damaged: dict[int, str]) -> None:
        """Moves damaged checkpoints aside (process 0; every process waits for it)."""
        for step, problem in sorted(damaged.items()) if jax.process_index() == 0 else ():
            moved = move_aside(self.workdir, step)
            logging.warning(
                "moved the damaged checkpoint of step %d aside to %s (kept, not deleted): %s", step, moved, problem
            )
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("transformer_jax: damaged checkpoints moved aside")


class _Damaged(Exception):
    """A checkpoint that cannot be read or verified (the message says what is wrong); the previous one is tried."""


def load_config(workdir: str | pathlib.Path, step: int | None = None) -> ml_collections.ConfigDict:
    """The config saved with a checkpoint (the latest by default)."""
    steps = list_steps(workdir)
    if not steps:
        raise CheckpointError(f"no checkpoint in {checkpoint_dir(workdir)}; train first or pass the right --workdir")
    step = steps[-1] if step is None else step
    where = f"the checkpoint at step {step} in {checkpoint_dir(workdir)}"
    if problem := _damage(workdir, step, ("config",)):
        raise CheckpointError(f"{where} is damaged: {problem}")
    try:
        restored = _manager(workdir, read_only=True).restore(
            step, args=ocp.args.Composite(config=ocp.args.JsonRestore())
        )
    except Exception as e:  # any failure to read is a damaged checkpoint
        raise CheckpointError(f"the config of {where} cannot be read: {describe_error(e)}") from None
    return bookkeeping.upgrade_config(ml_collections.ConfigDict(restored.config))


def load_model_params(workdir: str | pathlib.Path, step: int, abstract_state: nnx.State, wrt: Any = BASE) -> dict:
    """The model parameters of one checkpoint that the filter `wrt` selects (default: all but LoRA adapters) as a pure
    dict (nnx.to_pure_dict of nnx.state(model, wrt)), alone read from disk. abstract_state: the config's abstract
    train state (training.step.abstract_train_state)."""
    steps = list_steps(workdir)
    if step not in steps:
        raise CheckpointError(f"no checkpoint for step {step} in {checkpoint_dir(workdir)}; available steps: {steps}")
    where = f"the checkpoint at step {step} in {checkpoint_dir(workdir)}"
    if problem := _damage(workdir, step, ("state",)):
        raise CheckpointError(f"{where} is damaged: {problem}")
    try:
        with _OrbaxLogFilter(_is_restore_noise):
            saved_tree = _saved_tree(workdir, step)
    except Exception as e:  # any failure to read is a damaged checkpoint
        raise CheckpointError(f"{where} cannot be read: {describe_error(e)}") from None
    key = bookkeeping.state_keys(saved_tree.keys(), TrainState.FIELDS)["model"]
    target = {key: _abstract(nnx.to_pure_dict(nnx.filter_state(abstract_state["model"], wrt)))}
    if problem := _misfit(saved_tree, target):
        raise CheckpointError(f"{where} does not fit the config: {problem}; use the config it was trained with")
    try:
        with _OrbaxLogFilter(_is_restore_noise):
            # The restore arguments carry this process's device for every array: without them Orbax reuses the saved
            # shardings, which fails for a checkpoint written by other devices (another host, FSDP over 8 GPUs).
            restore = ocp.args.PyTreeRestore(
                target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
            )
            restored = _manager(workdir, read_only=True).restore(step, args=ocp.args.Composite(state=restore))
    except Exception as e:  # any failure to read is a damaged checkpoint
        raise CheckpointError(f"{where} cannot be read: {describe_error(e)}") from None
    if problem := bookkeeping.checksum_problem(checkpoint_dir(workdir) / str(step), restored.state):
        raise CheckpointError(f"{where} is corrupted: {problem}")
    return restored.state[key]
