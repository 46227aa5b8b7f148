"""Faults around checkpoints and the workdir: damaged or corrupted checkpoints, unreadable parts, two runs in one
workdir, refused restarts, resumed metrics (issue #15). One tiny run (checkpoints at steps 3 and 6) is copied by
each test."""

import json
import logging
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.helpers import REPO
from tests.helpers.training import tiny_train_config, train_py_on_devices
from transformer_jax.errors import CheckpointError, DiskFullError, NonFiniteError
from transformer_jax.training import bookkeeping, checkpoints, loop
from transformer_jax.training.metrics import read_metrics
from transformer_jax.training.step import abstract_train_state


def _config(corpus: pathlib.Path, **train):
    return tiny_train_config(corpus, eval_every=0, **train)


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> pathlib.Path:
    workdir = tmp_path_factory.mktemp("trained") / "run"
    loop.train_and_evaluate(_config(corpus), workdir)
    assert checkpoints.list_steps(workdir) == [3, 6]
    return workdir


def _copy(trained: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def _data_files(workdir: pathlib.Path, step: int) -> list[pathlib.Path]:
    """The array data files of a checkpoint's state, largest first."""
    files = [
        f for f in (workdir / "checkpoints" / str(step) / "state").rglob("*") if f.is_file() and f.parent.name == "d"
    ]
    return sorted(files, key=lambda f: (-f.stat().st_size, f.name))


def _flip_a_bit(path: pathlib.Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _restore_latest(workdir: pathlib.Path, config):
    _, abstract = abstract_train_state(config)
    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract)
    return checkpoints.Checkpointer(workdir, config.ckpt).restore_latest(abstract, shardings, config)


def _snapshot(workdir: pathlib.Path) -> dict[str, bytes]:
    return {str(f.relative_to(workdir)): f.read_bytes() for f in sorted(workdir.rglob("*")) if f.is_file()}


class _Records(logging.Handler):
    """The messages logged inside `with _Records() as records`, at INFO and above: the root logger is at INFO for
    the while, whatever level an earlier test (another module in the same process) left it at."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        root = logging.getLogger()
        self.level = root.level
        root.setLevel(logging.INFO)
        root.addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger().removeHandler(self)
        logging.getLogger().setLevel(self.level)


@pytest.fixture(scope="module")
def resumed_after_damage(corpus, trained, tmp_path_factory) -> tuple[pathlib.Path, list[str]]:
    """A truncated data file in the latest checkpoint (6), then the same train command again."""
    workdir = _copy(trained, tmp_path_factory.mktemp("damaged"))
    _truncate(_data_files(workdir, 6)[0])
    with _Records() as records:
        loop.train_and_evaluate(_config(corpus), workdir)  # restores 3, trains 4..6 and saves 6 again
    return workdir, records.lines


# 1. A damaged latest checkpoint is moved aside and the run goes on past its step.


def test_a_damaged_latest_checkpoint_is_moved_aside_and_the_run_goes_on(resumed_after_damage, corpus):
    workdir, lines = resumed_after_damage
    assert checkpoints.list_steps(workdir) == [3, 6]  # 6 saved anew (Orbax ignores the moved directory)
    moved = [p for p in (workdir / "checkpoints").iterdir() if p.name.startswith("6.damaged-")]
    assert len(moved) == 1 and (moved[0] / "state" / "_METADATA").is_file()  # kept whole, not deleted
    assert any("moved the damaged checkpoint of step 6 aside" in line and moved[0].name in line for line in lines)
    step, _, _ = _restore_latest(workdir, _config(corpus))
    assert step == 6


# 2. Flipped bits are found by the checksums; a non-finite stop never replaces the last finite checkpoint.


def test_a_checksum_does_not_depend_on_the_shards_and_changes_with_any_bit():
    from transformer_jax.training.bookkeeping import _shard_sum

    array = np.random.default_rng(0).standard_normal((37, 5, 3)).astype(np.float32)
    whole = _shard_sum(array, (), array.shape)
    rows = _shard_sum(array[:10], (slice(0, 10),), array.shape) + _shard_sum(array[10:], (slice(10, 37),), array.shape)
    columns = sum(_shard_sum(array[:, i : i + 1], (slice(None), slice(i, i + 1)), array.shape) for i in range(5))
    assert whole == rows % 2**64 == columns % 2**64  # any layout of shards (FSDP, one device) gives the same sum
    for position in (0, 100, 554):
        for bit in (0, 22, 31):
            flipped = array.copy()
            flipped.reshape(-1).view(np.uint32)[position] ^= np.uint32(1 << bit)
            assert _shard_sum(flipped, (), array.shape) != whole
    swapped = array.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert _shard_sum(swapped, (), array.shape) != whole  # positions count, not only the multiset of values


def test_a_flipped_bit_in_the_latest_checkpoint_is_detected_and_the_previous_one_used(trained, corpus, tmp_path):
    workdir = _copy(trained, tmp_path)
    _flip_a_bit(_data_files(workdir, 6)[0])
    assert _restore_latest(workdir, _config(corpus))[0] == 3
    assert checkpoints.list_steps(workdir) == [3]


def test_a_damaged_file_is_refused_before_orbax_opens_the_checkpoint(trained, corpus, tmp_path, monkeypatch):
    """Every file of a checkpoint's items has its digest: a flipped bit anywhere is refused in one line naming the
    file, before any Orbax read starts (a restore Orbax abandons leaves TensorStore's reads in flight, which report
    after the error line)."""
    workdir = _copy(trained, tmp_path)
    _flip_a_bit(_data_files(workdir, 6)[-1])
    _flip_a_bit(workdir / "checkpoints" / "3" / "config" / "metadata", 0.1)
    _, abstract = abstract_train_state(_config(corpus))
    orbax_restores = []
    monkeypatch.setattr(checkpoints.ocp.CheckpointManager, "restore", lambda *args, **kwargs: orbax_restores.append(1))
    with pytest.raises(CheckpointError, match=r"step 6 .* is damaged: its file state/\S+ differs from the digest"):
        checkpoints.load_model_params(workdir, 6, abstract)
    with pytest.raises(CheckpointError, match=r"step 3 .* is damaged: its file config/metadata differs from the"):
        checkpoints.load_config(workdir, 3)
    with pytest.raises(CheckpointError, match=r"\(step 6: its file state/\S+ differs .*; step 3: its file config"):
        _restore_latest(workdir, _config(corpus))
    assert orbax_restores == []


def test_flipped_bits_never_load_silently_without_digests(trained, corpus, tmp_path):
    """A checkpoint written before digests existed (its checksums alone): a bit flipped in a data file gives the
    parameters unchanged (the file holds other arrays) or a CheckpointError naming the step (and, for a wrong
    value, the array); never different values silently. The data is zstd-compressed, so where a flip lands decides
    between an unreadable block and wrong values: flips are tried until one gives wrong values of a parameter."""
    _, abstract = abstract_train_state(_config(corpus))
    original = jax.tree.leaves(checkpoints.load_model_params(trained, 6, abstract))
    errors = []
    trials = [(f.relative_to(trained), frac) for f in _data_files(trained, 6) for frac in (0.5, 0.3, 0.7, 0.2, 0.8)]
    for i, (name, frac) in enumerate(trials):
        workdir = tmp_path / str(i)
        shutil.copytree(trained / "checkpoints" / "6", workdir / "checkpoints" / "6")
        (workdir / "checkpoints" / "6" / bookkeeping.DIGESTS).unlink()
        _flip_a_bit(workdir / name, frac)
        try:
            params = jax.tree.leaves(checkpoints.load_model_params(workdir, 6, abstract))
        except CheckpointError as e:
            assert "step 6" in str(e) and "\n" not in str(e)
            errors.append(str(e))
            if re.search(r"step 6 .* is corrupted: .*\bmodel/\S+: checksum [0-9a-f]+ != saved", str(e)):
                return
            continue
        for a, b in zip(params, original, strict=True):
            np.testing.assert_array_equal(a, b)
    raise AssertionError(f"no flipped bit was reported as a wrong parameter value: {errors}")


def test_a_checkpoint_without_checksums_still_loads(trained, corpus, tmp_path):
    workdir = _copy(trained, tmp_path)
    shutil.rmtree(workdir / "checkpoints" / "6" / "checksums")  # as written before checksums and digests existed
    (workdir / "checkpoints" / "6" / bookkeeping.DIGESTS).unlink()
    _, abstract = abstract_train_state(_config(corpus))
    assert checkpoints.load_model_params(workdir, 6, abstract)
    assert _restore_latest(workdir, _config(corpus))[0] == 6


def _poisoned_run(workdir: pathlib.Path, config, checkpointer):
    """The step loop's run, restored from `workdir`, with a step that leaves NaN parameters behind (as a flipped
    exponent bit does) and reports non-finite updates."""
    from types import SimpleNamespace

    from transformer_jax.model.layers import TransformerSpec
    from transformer_jax.runtime import Progress

    step, state, it_state = _restore_latest(workdir, config)

    def poisoned_step(state, batch):
        nan = lambda x: x * np.nan if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x
        poisoned_step.calls += 1
        metrics = {"loss_sum": np.nan, "nll_sum": np.nan, "correct": 0.0, "tokens": 1.0, "finite": 0.0}
        return jax.tree.map(nan, state), {**metrics, "grad_norm": np.nan, "nonfinite_in_a_row": poisoned_step.calls}

    poisoned_step.calls = 0
    writer = SimpleNamespace(write=lambda *a, **k: None)
    return SimpleNamespace(
        config=config,
        spec=TransformerSpec.from_config(config),
        state=state,
        step=step,
        train_step=poisoned_step,
        batches=_Batches(it_state),
        checkpointer=checkpointer,
        metric_log=loop.MetricLog(
            config,
            writer,
            Progress(20, "step", "steps", initial=step),
            1e11,
            abstract_train_state(config)[0].learning_rate,
        ),
        validation=SimpleNamespace(run_due=lambda *a: None),
    )


def test_a_non_finite_stop_neither_saves_nor_rotates_away_the_last_finite_checkpoint(trained, corpus, tmp_path):
    """Non-finite updates stop the run, and checkpoints 3 and 6 stay the only ones although ckpt.keep is 2."""
    from types import SimpleNamespace

    workdir = _copy(trained, tmp_path)
    config = _config(corpus, num_steps=20, max_nonfinite_steps=2)
    config.ckpt.keep, config.ckpt.every_steps = 2, 1
    checkpointer = checkpoints.Checkpointer(workdir, config.ckpt)
    try:
        with pytest.raises(NonFiniteError, match="2 non-finite updates in a row"):
            loop.run_steps(_poisoned_run(workdir, config, checkpointer), SimpleNamespace(due=lambda step: False))
    finally:
        checkpointer.close()
    assert checkpoints.list_steps(workdir) == [3, 6]


def test_a_stop_request_on_a_non_finite_state_says_it_did_not_save(trained, corpus, tmp_path):
    """SIGTERM's log line says "saved the checkpoint" only when save_if_finite saved one."""
    from types import SimpleNamespace

    workdir = _copy(trained, tmp_path)
    config = _config(corpus, num_steps=20, max_nonfinite_steps=50)
    config.ckpt.every_steps = 100
    checkpointer = checkpoints.Checkpointer(workdir, config.ckpt)
    try:
        with _Records() as records:
            loop.run_steps(_poisoned_run(workdir, config, checkpointer), SimpleNamespace(due=lambda step: step >= 8))
    finally:
        checkpointer.close()
    assert checkpoints.list_steps(workdir) == [3, 6]
    assert not any("saved the checkpoint" in line for line in records.lines), records.lines
    assert "SIGTERM: exiting at step 8 without saving it (see the error above)" in records.lines, records.lines


class _Batches:
    """Batches for the step loop: the step function above ignores them."""

    def __init__(self, it_state):
        self.it_state = it_state

    def __next__(self):
        return {}, (1, {}), (1, 1, 1)

    def get_state(self):
        return self.it_state


def test_a_save_without_rotation_keeps_every_older_checkpoint(trained, corpus, tmp_path):
    """The save of a non-finite stop (rotate=False) does not apply ckpt.keep; a periodic save still does."""
    workdir = _copy(trained, tmp_path)
    config = _config(corpus)
    config.ckpt.keep = 2
    _, state, it_state = _restore_latest(workdir, config)
    checkpointer = checkpoints.Checkpointer(workdir, config.ckpt)
    try:
        checkpointer.save(7, state, it_state, config, rotate=False)
        assert checkpoints.list_steps(workdir) == [3, 6, 7]
        checkpointer.save(8, state, it_state, config)
    finally:
        checkpointer.close()
    assert checkpoints.list_steps(workdir) == [7, 8]


# 3. Restore errors are one line naming the step and what is wrong.


@pytest.mark.parametrize(
    "damage,load,message",
    [
        ("truncate", "params", r"step 6 .* is damaged: its file state/\S+ differs from the digest saved with it"),
        ("truncate without digests", "params", r"step 6 .* cannot be read: \w+: "),
        ("_METADATA", "params", r"step 6 .* is damaged: its state metadata is missing .*_METADATA"),
        ("config", "config", r"step 6 .* is damaged: its item 'config' is missing"),
    ],
)
def test_restore_errors_are_one_line_naming_the_step(trained, corpus, tmp_path, damage, load, message):
    workdir = _copy(trained, tmp_path)
    if damage.startswith("truncate"):
        for f in _data_files(workdir, 6):
            _truncate(f)
        if damage == "truncate without digests":
            (workdir / "checkpoints" / "6" / bookkeeping.DIGESTS).unlink()
    elif damage == "_METADATA":
        (workdir / "checkpoints" / "6" / "state" / "_METADATA").unlink()
    else:
        shutil.rmtree(workdir / "checkpoints" / "6" / "config")
    _, abstract = abstract_train_state(_config(corpus))
    with pytest.raises(CheckpointError) as raised:
        checkpoints.load_model_params(workdir, 6, abstract) if load == "params" else checkpoints.load_config(workdir)
    assert re.search(message, str(raised.value)), raised.value
    assert "\n" not in str(raised.value) and len(str(raised.value)) < 600, raised.value


def test_no_readable_checkpoint_is_one_line_listing_each_step(trained, corpus, tmp_path):
    workdir = _copy(trained, tmp_path)
    for step in (3, 6):
        for f in _data_files(workdir, step):
            _truncate(f)
    with pytest.raises(CheckpointError, match=r"no checkpoint .* could be read \(step 6: .*; step 3: ") as raised:
        _restore_latest(workdir, _config(corpus))
    assert "\n" not in str(raised.value) and len(str(raised.value)) < 1500, raised.value
    assert checkpoints.list_steps(workdir) == [3, 6]  # nothing moved when nothing restores


# train.py's message is test_no_readable_checkpoint_is_one_line_listing_each_step's, in-process; evaluate.py's process
# is the fast check that the damaged files leave nothing from asyncio or TensorStore after the error line.
@pytest.mark.parametrize("program", [pytest.param("train.py", marks=pytest.mark.slow), "evaluate.py"])
def test_a_damaged_checkpoint_is_one_error_line_in_a_fresh_process(trained, corpus, tmp_path, program):
    """train.py with no readable checkpoint, evaluate.py with a damaged latest one: stderr holds log lines and one
    error line, last; no traceback and nothing from asyncio or TensorStore (the damaged files are refused before
    Orbax starts reading, so no read is left in flight to report later)."""
    workdir = _copy(trained, tmp_path)
    for step in (3, 6) if program == "train.py" else (6,):
        for f in _data_files(workdir, step):
            _truncate(f)
    if program == "train.py":
        args = ["--config", str(REPO / "tests" / "tiny_train_config.py"), f"--config.data.text_dir={corpus}"]
        expected = r"train.py: error: no checkpoint .* could be read \(step 6: .*; step 3: "
    else:
        source = corpus / "test.en"
        args = ["--average_last", "1", "--source_file", str(source), "--output_file", str(tmp_path / "out.de")]
        expected = r"evaluate.py: error: the checkpoint at step 6 .* is damaged: its file state/"
    result = subprocess.run(
        [sys.executable, str(REPO / program), "--workdir", str(workdir), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"},
        timeout=120,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    not_logged = [line for line in result.stderr.splitlines() if not re.match(r"[IWE]\d{4} ", line)]
    assert len(not_logged) == 1 and re.match(expected, not_logged[0]), result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == not_logged[0]
    assert not re.search(r"Traceback|Exception ignored|Event loop|never retrieved|zarr|OCDBT", result.stderr)


def test_orbax_logs_of_a_failed_restore_are_dropped_only_during_the_call(caplog):
    """After a restore fails, asyncio logs the TensorStore reads nobody awaits any more as "Future exception was
    never retrieved"; during the Orbax call those records are dropped (the caller reports the failure once), other
    errors still are logged, and after the call the loggers are as before."""
    leftover = ValueError(
        'OUT_OF_RANGE: Error opening "zarr" driver: Error reading "model.x/.zarray" in OCDBT database at local file '
        "\"/run/checkpoints/3/state/\": Requested byte range [0, 12303) is not valid [tensorstore_spec='{}']"
    )
    log = logging.getLogger("asyncio")

    def logged(exc: BaseException) -> bool:
        caplog.clear()
        log.error("Future exception was never retrieved", exc_info=(type(exc), exc, None))
        return [r.exc_info[1] for r in caplog.records] == [exc]

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with checkpoints._OrbaxLogFilter(checkpoints._is_restore_noise):
            assert not logged(leftover) and logged(ValueError("an unrelated error"))
        assert logged(leftover) and not logging.getLogger("asyncio").filters and not logging.getLogger("absl").filters


def test_a_second_run_in_the_same_workdir_is_refused_at_once(trained, corpus, tmp_path):
    workdir = _copy(trained, tmp_path)
    assert not (trained / bookkeeping.LOCK_NAME).exists()  # the first run released its lock
    # A live process of this host: it waits for its stdin to close, which the test does when it is done.
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        lock = workdir / bookkeeping.LOCK_NAME
        lock.write_text(json.dumps({"pid": other.pid, "host": socket.gethostname(), "started": "earlier"}))
        before = _snapshot(workdir)
        with pytest.raises(bookkeeping.WorkdirLocked, match=rf"in use by another training run: .* process {other.pid}"):
            loop.train_and_evaluate(_config(corpus), workdir)
        assert _snapshot(workdir) == before  # the lock stays and nothing else is touched
    finally:
        other.stdin.close()
        other.wait(timeout=60)


def test_a_lock_of_a_dead_process_is_taken_over_and_one_of_another_host_is_not(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / bookkeeping.LOCK_NAME
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "earlier"}))
    path = bookkeeping.acquire(tmp_path)
    assert json.loads(path.read_text())["pid"] == os.getpid()
    bookkeeping.release(path)
    assert not lock.exists()
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "earlier"}))
    with pytest.raises(bookkeeping.WorkdirLocked, match="process 1 on host elsewhere"):
        bookkeeping.acquire(tmp_path)


# 5. Restarts: a refused one leaves the workdir as it was; one on another device count or mesh continues exactly.


def test_a_refused_restart_leaves_the_workdir_exactly_as_it_was(trained, corpus, tmp_path):
    workdir = _copy(trained, tmp_path)
    before = _snapshot(workdir)
    config = _config(corpus)
    config.model.d_ff = 128
    with pytest.raises(CheckpointError, match="model.d_ff: 64 -> 128"):
        loop.train_and_evaluate(config, workdir)
    assert _snapshot(workdir) == before


def test_resuming_with_another_global_batch_or_row_length_is_refused_naming_the_keys(trained, corpus, tmp_path):
    """The data iterator's position means other batches under another data.batch_size or data.max_len."""
    workdir = _copy(trained, tmp_path)
    config = _config(corpus)
    config.data.batch_size, config.data.max_len = 16, 24
    with pytest.raises(CheckpointError, match=r"differing keys .*data.batch_size: 8 -> 16; data.max_len: 32 -> 24"):
        _restore_latest(workdir, config)


def test_a_one_device_run_resumes_on_four_devices_with_fsdp_and_the_same_losses(trained, corpus, tmp_path):
    """Another device count and another mesh mode at once (the fast representative of tests/test_resume_devices.py):
    checkpoint 3 of the 1-device run continues on 4 CPU devices with FSDP and logs the losses of steps 4..6 the
    1-device run logged, to float32 rounding (rtol 1e-5; 4 devices sum the gradients in another order)."""
    workdir = _copy(trained, tmp_path)
    shutil.rmtree(workdir / "checkpoints" / "6")
    output = train_py_on_devices(4, workdir, corpus, **{"train.eval_every": 0, "train.mesh": "fsdp"})
    assert "resumed from the checkpoint at step 3" in output and "mesh {'data': 4}, train.mesh=fsdp" in output
    # The line benchmarks/fresh_process.py times restarts to.
    assert "step 4 is this process's first" in output
    one = {r["step"]: r["loss"] for r in read_metrics(trained / "metrics.jsonl") if "loss" in r}
    four = {r["step"]: r["loss"] for r in read_metrics(workdir / "metrics.jsonl") if "loss" in r}
    assert sorted(four) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([four[s] for s in (4, 5, 6)], [one[s] for s in (4, 5, 6)], rtol=1e-5)
    assert checkpoints.list_steps(workdir) == [3, 6]


# 6. After a resume each step is logged once.


def test_after_a_resume_metrics_hold_each_step_once(resumed_after_damage):
    workdir, _ = resumed_after_damage
    train = [r["step"] for r in read_metrics(workdir / "metrics.jsonl") if "loss" in r]
    assert train == [1, 2, 3, 4, 5, 6]
    superseded = [r["step"] for r in read_metrics(workdir / "metrics.superseded.jsonl") if "loss" in r]
    assert superseded == [4, 5, 6]  # the interrupted run's rows after the restored step, kept aside


# 7. A full disk while a checkpoint is written: one line, the finished ones kept, the unfinished one removed.

NO_SPACE = (
    'RESOURCE_EXHAUSTED: Error writing "model.x/0" in OCDBT database at local file "{dir}": Failed writing: '
    "\"{dir}d/0ceaf2\": Failed to write 12947 bytes to file 13: No space left on device [os_error_code='28']"
)


def _disk_full_at_the_array_writes(monkeypatch) -> None:
    """Every array write of a save fails as TensorStore reports a full disk (the error a full tmpfs gave, wrapped
    in Orbax's threads and coroutines alike); the JSON items are still written, so the save is half done."""
    from orbax.checkpoint._src.serialization import serialization

    async def full(*args, **kwargs):
        raise ValueError(NO_SPACE.format(dir="/run/checkpoints/9.orbax-checkpoint-tmp/state/"))

    monkeypatch.setattr(serialization, "async_serialize_from_host", full)


def _assert_disk_full_line(message: str, workdir: pathlib.Path) -> None:
    assert re.match(
        rf"disk full while saving the checkpoint of step 9 in {re.escape(str(workdir / 'checkpoints'))} "
        r"\(needs about [\d.]+ KiB, [\d.]+ \w+ free\); .* last finished checkpoint is step 6, kept\. .* resumes "
        "from step 6$",
        message,
    ), message


def _finished_checkpoints(workdir: pathlib.Path) -> dict[str, bytes]:
    return {k: v for k, v in _snapshot(workdir).items() if k.startswith("checkpoints/")}


# The asynchronous save (the default) stays in the default run: the same error line and cleanup as a synchronous
# one, reached later, when the save is awaited. The synchronous case runs with -m slow.
@pytest.mark.parametrize("async_save", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["async", "sync"])
def test_a_full_disk_during_a_save_keeps_the_finished_checkpoints_and_a_restart_resumes(
    trained, corpus, tmp_path, monkeypatch, async_save
):
    """Checkpoints 3 and 6 with ckpt.keep=2, and the save of step 9 fills the disk: one CheckpointError line (for
    an asynchronous save, when it is awaited), no Orbax tracebacks logged, 3 and 6 kept byte for byte (keep rotated
    nothing away), no 9.orbax-checkpoint-tmp left; once space is free, a restart restores 6 and saves 9."""
    workdir = _copy(trained, tmp_path)
    config = _config(corpus)
    config.ckpt.keep, config.ckpt.async_save = 2, async_save
    before = _finished_checkpoints(workdir)
    step, state, it_state = _restore_latest(workdir, config)
    _disk_full_at_the_array_writes(monkeypatch)
    checkpointer = checkpoints.Checkpointer(workdir, config.ckpt)
    try:
        with _Records() as records, pytest.raises(DiskFullError) as raised:
            checkpointer.save(9, state, it_state, config)
            checkpointer.close()  # an asynchronous save fails here, when it is awaited
    finally:
        monkeypatch.undo()
    _assert_disk_full_line(str(raised.value), workdir)
    assert not any("No space left" in line or "RESOURCE_EXHAUSTED" in line for line in records.lines), records.lines
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["3", "6"]
    assert _finished_checkpoints(workdir) == before
    checkpointer = checkpoints.Checkpointer(workdir, config.ckpt)
    try:
        assert checkpointer.restore_latest(*_abstract_and_shardings(config), config)[0] == step == 6
        checkpointer.save(9, state, it_state, config)
    finally:
        checkpointer.close()
    assert checkpoints.list_steps(workdir) == [6, 9]
    # The asynchronous save wrote the digests of every item into the checkpoint, and they hold.
    digests = json.loads((workdir / "checkpoints" / "9" / bookkeeping.DIGESTS).read_text())["files"]
    assert {name.split("/")[0] for name in digests} == set(checkpoints.ITEMS)
    assert bookkeeping.digest_problem(workdir / "checkpoints" / "9", checkpoints.ITEMS) is None


def test_a_disk_without_room_for_the_checkpoint_is_refused_before_orbax_starts(trained, corpus, tmp_path, monkeypatch):
    """Less free space than the last checkpoint took: the same one line, and nothing written or rotated away."""
    workdir = _copy(trained, tmp_path)
    config = _config(corpus)
    config.ckpt.keep = 2
    before = _finished_checkpoints(workdir)
    _, state, it_state = _restore_latest(workdir, config)
    checkpointer = checkpoints.Checkpointer(workdir, config.ckpt)
    monkeypatch.setattr(checkpoints.runtime, "free_bytes", lambda path: 1000)
    try:
        with pytest.raises(DiskFullError) as raised:
            checkpointer.save(9, state, it_state, config)
    finally:
        checkpointer.close()
    _assert_disk_full_line(str(raised.value), workdir)
    assert _finished_checkpoints(workdir) == before and sorted(os.listdir(workdir / "checkpoints")) == ["3", "6"]


def _abstract_and_shardings(config):
    _, abstract = abstract_train_state(config)
    return abstract, jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract)


@pytest.mark.slow
def test_a_full_disk_in_the_training_loop_is_one_line_and_the_same_command_resumes(
    trained, corpus, tmp_path, monkeypatch
):
    """The loop end to end (asynchronous saves, the default): training goes on while step 9 is written, the
    failure surfaces when the save is awaited, and the same command resumes from 6 and logs 7..9 once."""
    workdir = _copy(trained, tmp_path)
    config = _config(corpus, num_steps=9)
    config.ckpt.keep, config.ckpt.async_save = 2, True
    before = _finished_checkpoints(workdir)
    _disk_full_at_the_array_writes(monkeypatch)
    try:
        with pytest.raises(DiskFullError) as raised:
            loop.train_and_evaluate(config, workdir)
    finally:
        monkeypatch.undo()
    _assert_disk_full_line(str(raised.value), workdir)
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["3", "6"]
    assert _finished_checkpoints(workdir) == before
    loop.train_and_evaluate(config, workdir)
    assert checkpoints.list_steps(workdir) == [6, 9]
    train = [r["step"] for r in read_metrics(workdir / "metrics.jsonl") if "loss" in r]
    assert train == list(range(1, 10))
