"""Orbax checkpoints in WORKDIR/checkpoints: the train state, the data iterator position and the config.

Each checkpoint holds everything needed to continue exactly: model parameters, optimizer state, dropout RNG state,
step and non-finite counters (item `state`, keyed by the TrainState fields "model", "optimizer", "counters"), the
data iterator state (item `data`), the config (item `config`) and a checksum of every array of `state` (item
`checksums`), verified on every restore, and the SHA-256 of every file of these items (`digests.json`), checked
before Orbax opens the checkpoint (both in training.bookkeeping). Checkpoints of earlier layouts restore through the
migrations of training.bookkeeping; checkpoints written before digests or checksums existed restore without them.
With several processes each writes its shards of `state`; the JSON items are written by process 0 alone, which is
right because every host's iterator state is the same (hosts plan the same global batches; see data.pipeline).

A checkpoint that cannot be read or verified is reported in one line naming its step and what is wrong; training
then falls back to the one before it and moves the damaged one aside (`<step>.damaged-<time>`, never deleted).

Best checkpoints (ckpt.keep_best, ranked by train.select_metric): a checkpoint saved at a validation carries that
validation's scores in Orbax's `metrics` item. Orbax's preservation policies decide what a save removes: LatestN
keeps the last ckpt.keep, BestN the ckpt.keep_best best scored ones, and a checkpoint either keeps is kept
(AnyPreservationPolicy), so the best are never rotated away. `best_steps` ranks a workdir's scored checkpoints by
the select metric of its latest config.
"""

from __future__ import annotations

import contextlib
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
from transformer_jax.training import bookkeeping
from transformer_jax.training.step import TrainState

ITEMS = ("state", "data", "config", "checksums")
# Keys whose change makes a checkpoint unusable (the parameter or optimizer structure, what the tokens mean, which
# batches the saved iterator position stands for): those marked MATCH in schema.KEYS. Others may change.
STRUCTURAL_KEYS = schema.MUST_MATCH


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


def _manager(
    workdir,
    *,
    keep: int | None = None,
    async_save: bool = False,
    read_only: bool = False,
    cleanup_tmp: bool = False,
    select_metric: str | None = None,
    keep_best: int = 0,
    on_saved: Callable[[], None] | None = None,
):
    """Orbax's manager of WORKDIR/checkpoints. With `select_metric`, saves write their scores (`metrics`) and a save
    removes only what neither the last `keep` nor the `keep_best` best scored checkpoints hold. `on_saved`: called by
    an asynchronous save on process 0 once its files are written, before the checkpoint is renamed into place."""
    policy = {"max_to_keep": keep}
    if select_metric is not None:
        policy = {
            "best_fn": lambda metrics: bookkeeping.rank(metrics, select_metric),  # writes the metrics item
            "best_mode": "min" if select_metric in bookkeeping.LOWER_IS_BETTER else "max",
            "preservation_policy": ocp.checkpoint_managers.AnyPreservationPolicy(
                [
                    ocp.checkpoint_managers.LatestN(n=keep),
                    ocp.checkpoint_managers.BestN(
                        get_metric_fn=lambda metrics: bookkeeping.rank(metrics, select_metric),
                        reverse=select_metric in bookkeeping.LOWER_IS_BETTER,  # sorted worst first, the last n kept
                        n=keep_best,
                        keep_checkpoints_without_metrics=False,
                    ),
                ]
            ),
        }
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=async_save,
        create=not read_only,
        cleanup_tmp_directories=cleanup_tmp,
        # A reader lists the steps without reading every checkpoint's scores: one damaged score file would make
        # Orbax's constructor raise (best_scores reads them one by one and reports a damaged one).
        lightweight_initialize=read_only,
        async_options=ocp.AsyncOptions(post_finalization_callback=on_saved) if async_save and on_saved else None,
        **policy,
    )
    return ocp.CheckpointManager(checkpoint_dir(workdir), options=options, item_names=ITEMS)


def list_steps(workdir: str | pathlib.Path) -> list[int]:
    """Steps with a finished checkpoint, ascending."""
    if not checkpoint_dir(workdir).is_dir():
        return []
    return sorted(_manager(workdir, read_only=True).all_steps())


def damaged_scores(workdir: str | pathlib.Path) -> dict[int, str]:
    """step -> what is wrong, for every checkpoint whose saved scores (Orbax's `metrics` item) cannot be read: Orbax
    reads them all when a manager that ranks checkpoints starts, and one damaged file would stop it."""
    damaged = {}
    directory = checkpoint_dir(workdir)
    for path in directory.glob("*/metrics/metrics") if directory.is_dir() else ():
        step = path.parent.parent.name
        if not step.isdigit():
            continue
        try:
            json.loads(path.read_text())
        except (OSError, ValueError) as e:
            damaged[int(step)] = f"its scores ({path}) cannot be read: {describe_error(e)}"
    return damaged


def best_scores(workdir: str | pathlib.Path) -> list[tuple[int, float]]:
    """(step, score) of every checkpoint saved with a score of train.select_metric (as the latest checkpoint's
    config names it), best first; ties go to the earlier step. Empty when no checkpoint carries one."""
    steps = list_steps(workdir)
    if not steps:
        return []
    metric = None
    for step in reversed(steps):  # the newest config that can be read (a damaged one is skipped, as on restore)
        try:
            metric = load_config(workdir, step).train.get("select_metric", None)
            break
        except CheckpointError:
            continue
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
    """TensorStore completing a read or write for an Orbax call that has already failed and closed its event loop
    (printed through sys.excepthook from TensorStore's threads, after the call has returned)."""
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


def _is_restore_noise(exc: BaseException | None) -> bool:
    """An exception that Orbax's asynchronous restore leaves behind after the one it raises: reads of other arrays
    failing in coroutines nobody awaits any more (Orbax's wrapper, or TensorStore's own ValueError, which asyncio
    logs as "Future exception was never retrieved" once the restore has returned), and TensorStore callbacks
    reaching the closed event loop."""
    return (
        _is_loop_closed(exc)
        or (type(exc) is Exception and str(exc).startswith("Encountered error while reading array index"))
        or (isinstance(exc, ValueError) and "tensorstore_spec=" in str(exc))
    )


def _is_save_noise(exc: BaseException | None) -> bool:
    """What a save that filled the disk leaves behind: each thread's and coroutine's report of the failed writes,
    and the writes TensorStore completes after the save has failed."""
    return runtime.is_disk_full(exc) or _is_loop_closed(exc)


class _OrbaxLogFilter(logging.Filter):
    """Drops the records of Orbax's loggers ("absl": its threads, "asyncio": its coroutines whose exception nobody
    retrieved) whose exception `drop` selects: Orbax reports one failure from every thread and coroutine it ran,
    and the caller reports it once, in one line. Attached only for the duration of an Orbax call (`during`, or
    attach/detach around an asynchronous save until it is awaited); everything else is logged as before. A damaged
    file is refused before a restore starts (its digest), so what a failed restore leaves in flight (reports after
    the call, which no filter here can hold back) comes only from a checkpoint written before digests existed."""

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

    @contextlib.contextmanager
    def during(self) -> Iterator[None]:
        self.attach()
        try:
            yield
        finally:
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
    """Renames the checkpoint of `step` to `<step>.damaged-<UTC time>` (kept for inspection, never deleted).

    Orbax lists only directories named by a bare step number, so the renamed one is no longer a checkpoint.
    """
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
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _saved_keys(workdir: str | pathlib.Path, step: int) -> dict[str, Any]:
    """TrainState field -> the top-level key the checkpoint of `step` stores it under (bookkeeping.state_keys)."""
    # The saved tree's metadata, read by a bare handler: a manager knows it only after a save in this process, and
    # a checkpointer would synchronise the hosts.
    handler = ocp.PyTreeCheckpointHandler()
    try:
        saved = handler.metadata(checkpoint_dir(workdir) / str(step) / "state").tree.keys()
    finally:
        handler.close()
    return bookkeeping.state_keys(saved, TrainState.FIELDS)


class Checkpointer:
    """Saves every `ckpt.every_steps` (asynchronously), keeps the last `ckpt.keep`, restores the latest good one."""

    def __init__(self, workdir: str | pathlib.Path, ckpt: ml_collections.ConfigDict, select_metric: str | None = None):
        """`select_metric`: the validation score that ranks checkpoints (train.select_metric) when the run keeps
        best checkpoints or stops early; saves then carry their scores."""
        self.workdir = pathlib.Path(workdir)
        self._move_aside_damaged_scores()
        # cleanup_tmp_directories: a save that a crash or a full disk left unfinished (`<step>.orbax-checkpoint-tmp`)
        # is removed when the next run starts; Orbax never lists it as a checkpoint.
        self.manager = _manager(
            workdir,
            keep=ckpt.keep,
            async_save=ckpt.async_save,
            cleanup_tmp=True,
            select_metric=select_metric,
            keep_best=ckpt.get("keep_best", 0),
            on_saved=self._write_digests,
        )
        self.selection: dict | None = None  # the selection record of the checkpoint restore_latest restored
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
        """Saves the checkpoint of `step`; rotate=False keeps every older checkpoint (ckpt.keep is not applied),
        for a state that may be worse than the ones before it (a stop after non-finite updates). `metrics`: the
        validation scores of this step, that rank it among the best; `selection_record`: training.bookkeeping's
        SelectionRecord, saved beside the iterator position.

        A full disk, now or when an asynchronous save of an earlier step completes, is a DiskFullError naming the
        step, the directory and the space needed and free (`_disk_full`); ckpt.keep then has removed nothing. A
        disk with less free space than the checkpoint needs (`_space_needed`) is that error before Orbax starts.
        """
        self.wait()  # the previous save's failure is reported for its own step, before this one starts
        pure = nnx.to_pure_dict(state)
        # Hashed before the save starts: the arrays are valid until the next train step donates them.
        sums = {"version": bookkeeping.CHECKSUMS_VERSION, "arrays": bookkeeping.checksums(pure)}
        manager = self.manager if rotate else _manager(self.workdir, keep=None)
        needed = self._space_needed(step, sum(x.nbytes for x in jax.tree.leaves(pure)))
        if runtime.free_bytes(checkpoint_dir(self.workdir)) < needed:  # Orbax's threads would fail one by one
            raise self._disk_full(step, needed)
        self._in_flight = (step, needed)
        self._log_filter.attach()  # detached once the save is awaited (wait) or has failed (_failed_save)
        try:
            manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(pure),
                    data=ocp.args.JsonSave({"iterator": data_state, "selection": selection_record}),
                    config=ocp.args.JsonSave(json.loads(config.to_json())),
                    checksums=ocp.args.JsonSave(sums),
                ),
                metrics=metrics,
                force=True,
            )
            if not rotate:
                manager.close()  # waits for the save
            if not (rotate and self._async):  # finished; an asynchronous save calls _write_digests itself
                self._write_digests()
        except Exception as e:
            self._failed_save(e)
            raise
        if not rotate:
            self._in_flight = None
            self._log_filter.detach()
            self.manager.reload()
        elif not self._async:
            self.wait()

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
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            self._failed_save(e)
            raise
        self._in_flight = None
        self._log_filter.detach()

    def _failed_save(self, error: Exception) -> None:
        """After a save failed: its unfinished directory removed, a full disk re-raised as one DiskFullError line
        (any other failure is a bug and keeps its traceback)."""
        step, needed = self._in_flight
        self._in_flight, self._failed = None, True
        self._log_filter.detach()
        if jax.process_index() == 0:
            for tmp in checkpoint_dir(self.workdir).glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(tmp, ignore_errors=True)
        if runtime.is_disk_full(error):
            raise self._disk_full(step, needed) from None

    def _space_needed(self, step: int, array_bytes: int) -> int:
        """Bytes a checkpoint of `step` takes: what the last finished one took on disk (metadata included), a closer
        estimate than its arrays' bytes, or those bytes when there is none. Orbax writes a new checkpoint before
        ckpt.keep removes an old one, so the whole of it must fit."""
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
        """(step, state, data iterator state) of the newest checkpoint that restores, or None if there is none.

        A damaged newest checkpoint (unreadable, incomplete, or with an array whose checksum differs) is reported
        and the one before it is tried; once one restores, the damaged newer ones are moved aside to
        `<step>.damaged-<time>` so that this run can save at their steps again. A checkpoint written by an
        incompatible config is an error that lists the differing keys (and nothing is moved).
        """
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            return None
        current = json.loads(config.to_json())
        target = _abstract(nnx.to_pure_dict(abstract_state), nnx.to_pure_dict(shardings))
        errors, damaged = [], []
        for step in steps:
            try:
                with _OrbaxLogFilter(_is_restore_noise).during():
                    restored, keys = self._restore(step, target, current)
            except _Damaged as e:
                errors.append(f"step {step}: {e}")
                damaged.append(step)
                logging.error("checkpoint %d in %s is damaged (%s); trying the previous one", step, self.workdir, e)
                continue
            self._move_aside(damaged)
            state = jax.tree.map(lambda x: x, abstract_state)  # a copy to fill
            nnx.replace_by_pure_dict(state, {name: restored.state[keys[name]] for name in TrainState.FIELDS})
            self.selection = restored.data.get("selection")
            return step, state, restored.data["iterator"]
        raise CheckpointError(
            f"no checkpoint in {checkpoint_dir(self.workdir)} could be read ({'; '.join(errors)}); move the damaged "
            "step directories aside to start again, or use a new --workdir"
        )

    def _restore(self, step: int, target: dict, current: dict):
        """(restored Composite, TrainState field -> saved key) of one checkpoint; _Damaged if it cannot be used."""
        problem = _damage(self.workdir, step, ("config", "state", "data"))
        if problem:
            raise _Damaged(problem)
        try:
            saved_config = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        except Exception as e:  # any failure to read means this checkpoint is damaged
            raise _Damaged(f"its config cannot be read: {describe_error(e)}") from None
        # In today's keys and values, as load_config reads it: a config saved before a key was added, or before a
        # list-valued key held a tuple (its comma-joined string), is the same run's.
        saved = json.loads(bookkeeping.upgrade_config(ml_collections.ConfigDict(saved_config.config)).to_json())
        diff = config_differences(saved, current)
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
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(on_disk), data=ocp.args.JsonRestore())
            )
        except Exception as e:
            raise _Damaged(f"its state cannot be read: {describe_error(e)}") from None
        problem = bookkeeping.checksum_problem(checkpoint_dir(self.workdir) / str(step), restored.state)
        if problem:
            raise _Damaged(problem)
        return restored, keys

    def _move_aside_damaged_scores(self) -> None:
        """Moves aside (process 0; every process waits) each checkpoint whose scores cannot be read, before Orbax
        reads them; the restore then falls back past it like past any damaged checkpoint."""
        damaged = damaged_scores(self.workdir) if jax.process_index() == 0 else {}
        for step, problem in sorted(damaged.items()):
            moved = move_aside(self.workdir, step)
            logging.error(
                "checkpoint %d in %s is damaged (%s); moved aside to %s (kept)", step, self.workdir, problem, moved
            )
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("transformer_jax: checkpoints with damaged scores moved aside")

    def _move_aside(self, steps: list[int]) -> None:
        """Moves damaged checkpoints aside (process 0; every process waits for it) and re-lists the steps."""
        if not steps:
            return
        if jax.process_index() == 0:
            for step in steps:
                moved = move_aside(self.workdir, step)
                logging.warning("moved the damaged checkpoint of step %d aside to %s (kept, not deleted)", step, moved)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("transformer_jax: damaged checkpoints moved aside")
        self.manager.reload()


class _Damaged(Exception):
    """A checkpoint that cannot be read or verified (the message says what is wrong); the previous one is tried."""


def load_config(workdir: str | pathlib.Path, step: int | None = None) -> ml_collections.ConfigDict:
    """The config saved with a checkpoint (the latest by default)."""
    steps = list_steps(workdir)
    if not steps:
        raise CheckpointError(f"no checkpoint in {checkpoint_dir(workdir)}; train first or pass the right --workdir")
    step = steps[-1] if step is None else step
    problem = _damage(workdir, step, ("config",))
    if problem:
        raise CheckpointError(f"the checkpoint at step {step} in {checkpoint_dir(workdir)} is damaged: {problem}")
    try:
        restored = _manager(workdir, read_only=True).restore(
            step, args=ocp.args.Composite(config=ocp.args.JsonRestore())
        )
    except Exception as e:  # any failure to read is a damaged checkpoint
        raise CheckpointError(
            f"the config of the checkpoint at step {step} in {checkpoint_dir(workdir)} cannot be read: "
            f"{describe_error(e)}"
        ) from None
    return bookkeeping.upgrade_config(ml_collections.ConfigDict(restored.config))


def load_model_params(workdir: str | pathlib.Path, step: int, abstract_state: nnx.State) -> dict:
    """The model parameters of one checkpoint as a pure dict (nnx.to_pure_dict of nnx.state(model, nnx.Param)).

    abstract_state is the abstract train state of the config (training.step.abstract_train_state); only the model
    parameters are read from disk: their files checked against the checkpoint's digests first, and the arrays
    against its checksums after, where it has them.
    """
    steps = list_steps(workdir)
    if step not in steps:
        raise CheckpointError(f"no checkpoint for step {step} in {checkpoint_dir(workdir)}; available steps: {steps}")
    where = f"the checkpoint at step {step} in {checkpoint_dir(workdir)}"
    problem = _damage(workdir, step, ("state",))
    if problem:
        raise CheckpointError(f"{where} is damaged: {problem}")
    try:
        with _OrbaxLogFilter(_is_restore_noise).during():
            restored, key = _restore_model_params(workdir, step, abstract_state)
    except Exception as e:  # any failure to read is a damaged checkpoint
        raise CheckpointError(f"{where} cannot be read: {describe_error(e)}") from None
    problem = bookkeeping.checksum_problem(checkpoint_dir(workdir) / str(step), restored.state)
    if problem:
        raise CheckpointError(f"{where} is corrupted: {problem}")
    return restored.state[key]


def _restore_model_params(workdir: str | pathlib.Path, step: int, abstract_state: nnx.State):
    """(restored Composite holding the model's parameters, the key they are saved under) of one checkpoint."""
    key = _saved_keys(workdir, step)["model"]
    target = {key: _abstract(nnx.to_pure_dict(nnx.filter_state(abstract_state["model"], nnx.Param)))}
    # Read only the model's parameters: the optimizer state and counters are left out of the restore target.
    # The restore arguments carry this process's device for every array: without them Orbax reuses the saved
    # shardings, which fails for a checkpoint written by other devices (another host, FSDP over 8 GPUs).
    restore = ocp.args.PyTreeRestore(
        target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
    )
    return _manager(workdir, read_only=True).restore(step, args=ocp.args.Composite(state=restore)), key
