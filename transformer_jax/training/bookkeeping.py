"""The small JSON records a training run keeps beside the checkpoints' arrays: the lock (held by the training loop),
the selection record (kept by the loop, saved with each checkpoint), each checkpoint's checksums and digests, and
what configs saved by earlier versions need today (the last three read and written by training.checkpoints).

The lock, WORKDIR/train.lock: one training run per workdir (two would both write checkpoints and metrics, and one
would crash mid-save). Created atomically (O_EXCL), it holds its run's pid, host and start time and is removed when
the run ends. A lock whose process died (SIGKILL, a crash) on this host is taken over; one from another host cannot
be checked from here, so the message names its host and pid. The hosts of one run share the workdir: process 0 takes
the lock and one all-gather tells every process the outcome, so that all start or all stop with the same error.

The selection record (the best validation for train.select_metric, and whether to stop) travels in every
checkpoint's `data` item, so a restart continues the count of validations without improvement and a run that stopped
early knows it has stopped. Orbax ranks the checkpoints themselves (training.checkpoints).

Checksums, verified on restore: a flipped bit in a checkpoint's data files otherwise restores silently (Orbax checks
no content). An array's checksum is the sum over its elements of mix(bits(element) + mix(flat global index + 1))
modulo 2**64, mix being splitmix64's finaliser; a changed element changes its term to an unrelated 64-bit value, so
the sum misses it with probability 2**-64. A sum over elements does not depend on the sharding: each process hashes
the shards it holds with replica_id 0 (over all processes, exactly one copy of every element, whatever the mesh), one
all-gather adds the partial sums and process 0 writes them; a checkpoint saved with one layout (FSDP over 8 devices)
verifies after a restore onto another (one device). The host copies are hashed just before the (possibly
asynchronous) save starts, while the arrays are valid (the next train step donates them).

Digests: the SHA-256 of every file of a checkpoint's items (DIGESTS in its directory), written by process 0 once Orbax
has written the files and checked before Orbax opens the checkpoint. The checksums cannot refuse a damaged file that
early, and a restore Orbax abandons at a failed read leaves TensorStore's other reads in flight, reporting after the
error line (docs/reliability.md). A checkpoint written before digests existed restores without them.

Migrations: what checkpoints of earlier versions need to restore today, in one place (such checkpoints exist:
tests/test_state.py, tests/test_configs.py):

- State layout: before the TrainState fields had names, the `state` item stored them under the positions 0, 1, 2
  (the same order); `state_keys` maps each field to its saved key.
- Config (`upgrade_config`, applied by checkpoints.load_config): the reserved ids were fixed constants (pad 0, eos 1,
  bos 2, unk 3: model.layers.SpecialIds.DEFAULT) until the `model.pad_id/eos_id/bos_id/unk_id` keys came; a config
  saved in between has none of them, and one saved before that held `model.pad_id` alone (it could only be 0) and
  had no `model.fused_backward` (those versions ran the hand-written backward passes everywhere: 'on').
- Config: keys added later (`ADDED_KEYS`) get the value that does what the versions without them did.
- Config: the list-valued keys (data.corpora, opt.freeze, train.trackers, eval.extra_valid) were comma-joined strings
  until they became tuples; `upgrade_config` splits such a string by the key's rule (config/schema.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import pathlib
import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from flax.traverse_util import flatten_dict
from jax.experimental import multihost_utils

from transformer_jax import runtime
from transformer_jax.config import schema
from transformer_jax.errors import ConfigError, UserError
from transformer_jax.model.layers import SpecialIds

# The lock.

LOCK_NAME = "train.lock"


class WorkdirLocked(UserError, RuntimeError):
    """Another run holds the workdir's lock."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _holder(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def acquire(workdir: pathlib.Path, name: str = LOCK_NAME, owner: str = "training run") -> pathlib.Path:
    """Creates WORKDIR/<name> (train.lock) for this process, or raises WorkdirLocked naming the holder. `name` and
    `owner` ("training run") let another command own a directory the same way (a sweep's sweep.lock)."""
    path = workdir / name
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": started}
    for _ in range(3):  # a stale lock removed by us, or one that vanished meanwhile: try again
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if holder is None:  # being written by its holder, or garbage: do not guess
                time.sleep(0.2)
                holder = _holder(path)
            if holder and holder.get("host") == me["host"] and not _alive(int(holder.get("pid", -1))):
                logging.warning("removing the stale lock %s of process %s, which no longer runs", path, holder["pid"])
                path.unlink(missing_ok=True)
                continue
            who = "an unreadable lock"
            if holder:
                who = f"process {holder.get('pid')} on host {holder.get('host')} (started {holder.get('started')})"
            raise WorkdirLocked(
                f"{workdir} is in use by another {owner}: {path} is held by {who}. Wait for it to finish or "
                f"stop it; if that process is gone, delete {path}"
            ) from None
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(me) + "\n")
        return path
    raise WorkdirLocked(
        f"could not take the lock {path}: it keeps reappearing; another {owner} is starting in {workdir}"
    )


def release(path: pathlib.Path) -> None:
    """Removes the lock if it is still this process's."""
    holder = _holder(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def locked(workdir: pathlib.Path) -> Iterator[None]:
    """Holds the workdir's lock inside (process 0 takes it; every process raises the same error if it cannot)."""
    workdir.mkdir(parents=True, exist_ok=True)
    path, error = None, None
    try:
        if jax.process_index() == 0:
            try:
                path = acquire(workdir)
            except WorkdirLocked as e:
                error = e
        if jax.process_count() > 1:
            refused = np.asarray(multihost_utils.process_allgather(np.int32(error is not None)))
            if refused.any() and error is None:
                error = WorkdirLocked(f"{workdir} is in use by another training run (see process 0's message)")
        if error is not None:
            raise error
        yield
    finally:
        if path is not None:
            release(path)


# The selection record.

# The select metrics for which lower is better (a loss, an edit rate); every other one is a score.
LOWER_IS_BETTER = frozenset({"valid_loss", "valid_ter"})
# The select metrics that need the validation sentences decoded (the rest need only the loss).
DECODED = frozenset({"valid_bleu", "valid_chrf", "valid_chrfpp", "valid_ter"})


def is_tracked(config: ml_collections.ConfigDict) -> bool:
    """Whether the run ranks its validations: it keeps best checkpoints or stops early."""
    return bool(config.ckpt.keep_best or config.train.early_stop_patience)


def worst(metric: str) -> float:
    """The score below every real one, for a checkpoint saved without `metric`."""
    return math.inf if metric in LOWER_IS_BETTER else -math.inf


def rank(metrics: dict[str, Any], metric: str) -> float:
    """A saved checkpoint's score for ranking: `metric`'s value, or worst(metric) where it is missing or NaN (a NaN
    would make any sort of the scores arbitrary, and Orbax's BestN sorts them to choose what it deletes)."""
    score = float(metrics.get(metric, worst(metric)))
    return worst(metric) if math.isnan(score) else score


def better(metric: str, score: float, than: float | None) -> bool:
    """Whether `score` improves on `than` (None: nothing yet)."""
    if than is None:
        return not math.isnan(score)
    return score < than if metric in LOWER_IS_BETTER else score > than


@dataclasses.dataclass
class SelectionRecord:
    """The best validation so far and the validations since it; `stopped_at` once early stopping has fired, with
    the train.num_steps and patience it fired under (raising either lets a restart train on)."""

    metric: str
    best_step: int | None = None
    best_score: float | None = None
    since_best: int = 0
    stopped_at: int | None = None
    stopped_num_steps: int | None = None
    stopped_patience: int | None = None

    def update(self, step: int, score: float) -> bool:
        """Counts one validation; True if it improved the best."""
        if better(self.metric, score, self.best_score):
            self.best_step, self.best_score, self.since_best = step, score, 0
            return True
        self.since_best += 1
        return False

    def exhausted(self, patience: int) -> bool:
        return bool(patience) and self.since_best >= patience

    def stop(self, step: int, config: ml_collections.ConfigDict) -> None:
        self.stopped_at = step
        self.stopped_num_steps, self.stopped_patience = config.train.num_steps, config.train.early_stop_patience

    def still_stopped(self, config: ml_collections.ConfigDict) -> bool:
        """Whether a restart with `config` must not train: the run stopped early and neither train.num_steps nor
        the patience was raised since. Raising num_steps starts the patience afresh."""
        if self.stopped_at is None:
            return False
        if config.train.num_steps > self.stopped_num_steps:
            self.since_best, self.stopped_at = 0, None
            return False
        if config.train.early_stop_patience > self.stopped_patience or not config.train.early_stop_patience:
            self.stopped_at = None
            return False
        return True

    def describe(self) -> str:
        if self.best_step is None:
            return f"no validation scored {self.metric} yet"
        return f"the best step is {self.best_step} with {self.metric}={self.best_score:.4f}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, saved: dict[str, Any] | None, metric: str) -> SelectionRecord:
        """The saved record; a fresh one if there is none or it ranked another metric (its best means nothing here)."""
        if not saved or saved.get("metric") != metric:
            return cls(metric)
        return cls(**{f.name: saved.get(f.name, f.default) for f in dataclasses.fields(cls)})


# Checksums.

CHECKSUMS_VERSION = 1  # of the `checksums` item: {"version", "arrays": checksums(state)}
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_CHUNK = 1 << 20  # elements hashed at a time (bounds the uint64 temporaries to a few MiB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _shard_sum(values: np.ndarray, index: tuple[slice, ...], shape: tuple[int, ...]) -> int:
    """The sum of the terms of one shard (`index`: its slices of the global array of `shape`)."""
    values = np.ascontiguousarray(values)
    if values.size == 0:
        return 0
    if values.dtype.itemsize not in (1, 2, 4, 8):
        raise TypeError(f"cannot checksum dtype {values.dtype}")
    if values.ndim == 0:  # one element at flat index 0
        values, shape = values.reshape(1), (1,)
    bits = values.view(np.dtype(f"u{values.dtype.itemsize}"))
    strides = np.cumprod((1,) + shape[:0:-1])[::-1].astype(np.uint64)  # row-major element strides
    starts = [s.start or 0 for s in index] + [0] * (values.ndim - len(index))
    # An element's flat global index is the sum over the axes of (start + its position) * stride.
    axes = zip(values.shape, starts, strides, strict=True)
    offsets = [(np.arange(n, dtype=np.uint64) + np.uint64(start)) * stride for n, start, stride in axes]
    inner = np.asarray(sum(np.ix_(*offsets[1:]), np.uint64(0))).reshape(-1)  # those within a row
    per_chunk = max(1, _CHUNK // inner.size)
    bits = bits.reshape(len(offsets[0]), -1)
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for r0 in range(0, len(bits), per_chunk):
            flat = offsets[0][r0 : r0 + per_chunk, None] + inner[None, :]
            terms = _mix(bits[r0 : r0 + per_chunk].astype(np.uint64) + _mix(flat + np.uint64(1)))
            total = total + terms.sum(dtype=np.uint64)
    return int(total)


def _local_sum(x: Any) -> int:
    """This process's part of an array's checksum: its shards with replica_id 0."""
    if not isinstance(x, jax.Array):
        return _shard_sum(np.asarray(x), (), np.shape(x))
    total = 0
    for shard in x.addressable_shards:
        if shard.replica_id == 0:
            total += _shard_sum(np.asarray(shard.data), shard.index, x.shape)
    return total % (1 << 64)


def _key_data(x: Any) -> Any:
    """A PRNG key array's raw data (what is hashed and described for it); any other array as it is."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def checksums(tree: dict) -> dict[str, dict]:
    """{"a/b/c": {"shape", "dtype", "sum"}} for every array of a pure dict; with several processes every process
    must call it (one all-gather of the partial sums), and gets the same."""
    flat = {"/".join(str(k) for k in path): _key_data(x) for path, x in flatten_dict(tree).items()}
    names = sorted(flat)
    sums = [_local_sum(flat[name]) for name in names]
    if jax.process_count() > 1 and not all(getattr(x, "is_fully_addressable", True) for x in flat.values()):
        # uint32 halves: without jax_enable_x64 a uint64 would be truncated on the way.
        halves = np.array([[s >> 32, s & 0xFFFFFFFF] for s in sums], np.uint32).reshape(-1, 2)
        gathered = np.asarray(multihost_utils.process_allgather(halves))  # (processes, arrays, 2)
        sums = [sum((int(h) << 32) | int(lo) for h, lo in gathered[:, i]) % (1 << 64) for i in range(len(names))]
    return {
        name: {"shape": list(np.shape(flat[name])), "dtype": str(flat[name].dtype), "sum": f"{s:016x}"}
        for name, s in zip(names, sums, strict=True)
    }


def checksum_problem(directory: pathlib.Path, tree: dict) -> str | None:
    """What differs between the arrays of `tree` restored from the checkpoint in `directory` (evaluation restores the
    parameters alone) and their saved checksums, or None (also if it has none). Every process must call it."""
    path = directory / "checksums" / "metadata"
    if not path.exists():
        return None
    try:
        expected = dict(json.loads(path.read_text())["arrays"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its checksums ({path}) cannot be read: {type(e).__name__}: {e}"
    problems = []
    for name, record in checksums(tree).items():
        saved = expected.get(name)
        if saved is None:
            problems.append(f"{name}: no checksum saved for it")
        elif (saved["shape"], saved["dtype"]) != (record["shape"], record["dtype"]):
            problems.append(
                f"{name}: saved {saved['dtype']}{saved['shape']}, restored {record['dtype']}{record['shape']}"
            )
        elif saved["sum"] != record["sum"]:
            problems.append(f"{name}: checksum {record['sum']} != saved {saved['sum']}")
    if not problems:
        return None
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return f"its arrays differ from their saved checksums: {'; '.join(problems[:3])}{more}"


# Digests.

DIGESTS = "digests.json"  # {"version", "files": {path relative to the checkpoint's directory: SHA-256}}
DIGESTS_VERSION = 1


def _sha256(path: pathlib.Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_digests(directory: pathlib.Path, items: Sequence[str]) -> None:
    """Writes the digests of every file of `items` (subdirectories of a checkpoint's `directory`) into it."""
    files = {
        f.relative_to(directory).as_posix(): _sha256(f)
        for item in items
        for f in sorted((directory / item).rglob("*"))
        if f.is_file()
    }
    runtime.write_text_atomically(directory / DIGESTS, json.dumps({"version": DIGESTS_VERSION, "files": files}))


def digest_problem(directory: pathlib.Path, items: Sequence[str]) -> str | None:
    """The first file of `items` that is missing or differs from its saved digest, or None (also if it has none)."""
    path = directory / DIGESTS
    if not path.exists():
        return None
    try:
        files = dict(json.loads(path.read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its digests ({path}) cannot be read: {type(e).__name__}: {e}"
    for name, digest in sorted(files.items()):
        if pathlib.PurePosixPath(name).parts[0] not in items:
            continue
        if not (directory / name).is_file():
            return f"its file {name} is missing"
        if _sha256(directory / name) != digest:
            return f"its file {name} differs from the digest saved with it"
    return None


# Migrations.


def state_keys(saved_keys: Iterable[str], fields: Sequence[str]) -> dict[str, Any]:
    """TrainState field -> the top-level key of the saved `state` tree that holds it: the field's name, or its
    position in a checkpoint of the positional layout."""
    if set(saved_keys) == {str(i) for i in range(len(fields))}:
        return {name: i for i, name in enumerate(fields)}
    return {name: name for name in fields}


# Keys added after checkpoints were written, and the value that does what the versions without them did.
ADDED_KEYS: dict[str, Any] = {
    "model.final_logits_bias": False,  # no bias on the logits
    "model.sinusoid_layout": "interleaved",  # the paper's, the only layout there was
    "model.position_offset": 0,  # positions start at 0
    "eval.max_len": 0,  # no absolute cap on outputs, only eval.max_extra_len
    "model.source_vocab_size": 0,  # the source vocabulary is the target's
    "data.tokenizer": "spm",  # one joint SentencePiece model, the only tokenizer there was
    "model.lang_token": "none",  # bilingual: no language tokens
    "model.language_codes": (),  # language ids from data.directions
    "data.directions": (),  # the one pair data.src_lang-data.tgt_lang
    "data.temperature": 1.0,  # (no directions to draw)
    "data.direction_lines": (),  # every line
    "data.target_lang": "",  # no >>xx<< token before the source
    "data.corpora": (),  # one training corpus
    "train.trackers": ("tensorboard",),  # TensorBoard beside metrics.jsonl, as then
    "train.tracker_group": "",
    "opt.lora_rank": 0,  # no adapters: every parameter trained
    "opt.lora_alpha": 8.0,
    "opt.lora_targets": ("q", "v"),
    "data.add_languages": (),  # the source's languages only
    "train.new_language_init": "mean",
    "train.source_directions": (),  # a run saved before the key: only its own data.directions count as trained
}


def upgrade_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A config saved with a checkpoint, in today's keys and values (unchanged when it has them already)."""
    values = config.to_dict()
    for name, value in ADDED_KEYS.items():
        group, _, leaf = name.partition(".")
        if group in values:
            values[group].setdefault(leaf, value)
    # A list-valued key saved before it was a tuple holds its comma-joined string (data.corpora, opt.freeze,
    # train.trackers, eval.extra_valid), and any read back from JSON a list: the key's rule makes either the tuple.
    for name in schema.LISTS:
        group, _, leaf = name.partition(".")
        if leaf in values.get(group, {}):
            values[group][leaf] = schema.RULES[name].split(name, values[group][leaf])
    model = values.get("model")
    if model is not None:
        if "fused_backward" not in model:
            pad_id = model.get("pad_id", SpecialIds.DEFAULT.pad)
            if pad_id != SpecialIds.DEFAULT.pad:
                raise ConfigError(
                    f"invalid config key model.pad_id: a config saved without model.fused_backward had padding "
                    f"{SpecialIds.DEFAULT.pad} always, got {pad_id}; set it to {SpecialIds.DEFAULT.pad}"
                )
            model["fused_backward"] = "on"
        for field in schema.SPECIAL_IDS:  # the constants of the versions without the id keys
            model.setdefault(f"{field}_id", getattr(SpecialIds.DEFAULT, field))
    return config if values == config.to_dict() else ml_collections.ConfigDict(values)
