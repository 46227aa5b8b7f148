"""The process's plumbing, below everything else, in four parts.

**The platform a program is built for**: the running backend, or the one an ahead-of-time compile targets. Every
choice that depends on the accelerator (which attention kernel `auto` runs, how Pallas lowers, whether the CPU-only
fused backward passes are used) asks `target_backend()`, never `jax.default_backend()` directly: a CPU host that
compiles for a TPU or GPU topology (train.py --plan) runs inside `compiling_for("tpu")`, so those choices follow the
target rather than the host.

Which backend jax runs on is jax's choice (its plugins, $JAX_PLATFORMS). The one exception is made by the command
lines, never by importing the package: `use_cpu_without_accelerators()` before the first backend use. With the
ahead-of-time compilers installed (requirements-aot.txt, for `train.py --plan`), jax would otherwise try the CUDA
plugin and libtpu on a host that has neither chip, and each prints its failure (a `cuInit` traceback, libtpu's
`TPU_ACCELERATOR_TYPE` and `TPU_WORKER_HOSTNAMES` warnings) before jax falls back to the CPU.

**JAX's persistent compilation cache**, turned on by every command line through jax's public settings: a restarted,
resumed or repeated run loads its compiled programs from disk instead of compiling them again. Where:
`--compilation_cache DIR` (every command line), else $TRANSFORMER_JAX_COMPILATION_CACHE, else
`~/.cache/transformer_jax/xla`; `off` disables it. Entries go in a subdirectory per host CPU type (XLA:CPU code is
compiled for the host's instruction set, and a home directory may be shared by machines of several kinds). Nothing
is evicted: `rm -r` the directory to clear it.

jax keys an entry by a hash of the lowered program (every shape, dtype, sharding and static setting that reaches
it), the jaxlib version, the backend and its platform version, XLA_FLAGS and the compile options; a process still
traces and lowers each program to find its entry. Entries are zlib streams, whose checksum makes a truncated or
damaged entry fail to load: jax then warns ("Error reading persistent compilation cache entry"), compiles, and the
result is right. jax never replaces such an entry; delete it or the directory (docs/compilation.md).

jax's size limit (`jax_compilation_cache_max_size`) is left unset: with it, jax locks the directory around each read
and write, but an entry whose writer was killed (or hit a full disk) before jax wrote its access-time file makes
every later write to that directory fail (docs/compilation.md).

**Writing files safely**: one writability probe, whole-or-nothing writes, and a full disk told in one line. Every
command checks its output locations with `probe_writable` before any work, and writes its outputs with
`write_text_atomically` (a temporary file beside the target, renamed into place when complete), so that a failure
half way (a full disk) leaves the previous file or none, never a partial one that looks complete. `is_disk_full`
recognises a full disk however it arrives: an OSError from Python, or TensorStore's RESOURCE_EXHAUSTED wrapped in
Orbax's and asyncio's exceptions. `space_report` says how much was needed and how much is free, for the line.
`check_writable`, `check_folder_writable` and `refuse_overwriting_inputs` are the commands' one-line refusals
(EvalError) of an output that cannot be written or that is an input, or another output, under any spelling or link.

**The one progress display** of the package: a tqdm bar on a terminal, plain log lines otherwise (a log file). Used
for training steps (training.metrics), tokenizing a split (data.store) and translating (evaluation.translate). Log
lines come every tenth of the way, and at every update that carries values to show (training logs its loss each
train.log_every steps), with the elapsed time and an estimate of the time left. (clu's metric writers and periodic
actions are not used: clu's last release is from 2024, and this is all the package needs of them.)
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import tqdm
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from transformer_jax.errors import DiskFullError, EvalError

log = logging.getLogger(__name__)  # the standard logger, which train.py shows at INFO (it quiets absl's)


BACKENDS = ("cpu", "gpu", "tpu")
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}  # device platforms as jax names them -> backend names
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("transformer_jax_target_backend", default=None)


def backend_of(platform: str) -> str:
    """'cpu', 'gpu' or 'tpu' for a device platform name ('cuda' and 'rocm' are 'gpu')."""
    name = _ALIASES.get(platform, platform)
    if name not in BACKENDS:
        raise ValueError(f"unknown platform {platform!r}; expected one of {BACKENDS} (or 'cuda', 'rocm')")
    return name


def target_backend() -> str:
    """The backend programs are being built for: the innermost compiling_for(...), else jax.default_backend()."""
    target = _TARGET.get()
    return jax.default_backend() if target is None else target


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[str]:
    """Within this block, target_backend() is `platform`'s backend (tracing happens here; run nothing)."""
    token = _TARGET.set(backend_of(platform))
    try:
        yield _TARGET.get()
    finally:
        _TARGET.reset(token)


# The device files through which a Linux host exposes an accelerator to a process: NVIDIA's driver (also inside a
# container given GPUs), AMD's ROCm driver, and the TPU's (/dev/accel* on TPU v2-v4 hosts, numbered VFIO groups on
# v5e, v5p and v6e hosts). A host with none of them cannot run a jax accelerator backend, whatever is installed.
ACCELERATOR_DEVICE_FILES = ("nvidiactl", "nvidia[0-9]*", "kfd", "accel[0-9]*", "vfio/[0-9]*")


def accelerator_device_files(dev: Path = Path("/dev")) -> list[str]:
    """The accelerator device files present under `dev` (ACCELERATOR_DEVICE_FILES), sorted."""
    return sorted(str(path.relative_to(dev)) for pattern in ACCELERATOR_DEVICE_FILES for path in dev.glob(pattern))


def use_cpu_without_accelerators(dev: Path = Path("/dev")) -> bool:
    """Runs jax on the CPU (jax_platforms = "cpu") on a Linux host without accelerator device files, unless the
    user chose ($JAX_PLATFORMS, or jax_platforms set already); returns whether it did. Call before the first use of
    a backend. A heuristic: a chip that a driver exposes under another name is missed, and then jax tries every
    installed plugin as it would without this; `JAX_PLATFORMS=cuda` (or tpu) overrides it either way."""
    if jax.config.jax_platforms or not sys.platform.startswith("linux"):  # $JAX_PLATFORMS is read into it
        return False
    if accelerator_device_files(dev):
        return False
    jax.config.update("jax_platforms", "cpu")
    return True


COMPILE_CACHE_ENV = "TRANSFORMER_JAX_COMPILATION_CACHE"
_CACHE_OFF = ("off", "none", "false", "0")
# Every program is written, however fast it compiles: on XLA:CPU, loading an entry costs less than compiling even a
# one-operation program (docs/compilation.md), and eager operations are most of a process's programs.
MIN_COMPILE_SECONDS = 0.0


def user_cache_root() -> Path:
    """~/.cache/transformer_jax: downloads (data.cache_dir's default) and compiled programs live under it."""
    return Path.home() / ".cache" / "transformer_jax"


def host_kind() -> str:
    """A short name for this host's CPU type: its architecture and a hash of the instruction-set flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    digest = hashlib.sha256(" ".join(sorted(flags.split(":")[-1].split())).encode()).hexdigest()[:12]
    return f"{platform.machine() or 'unknown'}-{digest}"


def resolve_compile_cache(setting: str | None) -> Path | None:
    """The cache directory a setting names: a path, 'off' (None), or unset (the environment, else the default)."""
    if setting is None:
        setting = os.environ.get(COMPILE_CACHE_ENV)
    if setting is None or setting == "":
        return user_cache_root() / "xla"
    if setting.lower() in _CACHE_OFF:
        return None
    return Path(setting).expanduser()


def enable_compile_cache(setting: str | None = None, min_compile_seconds: float = MIN_COMPILE_SECONDS) -> Path | None:
    """Turns jax's persistent cache on at `resolve_compile_cache(setting)`'s per-host subdirectory (or off);
    returns that directory, or None when off. Called by entry points before their first compile; calling it again
    switches.

    Programs that compile in less than min_compile_seconds are compiled every time, never written. A directory
    that cannot be created or written is one warning line on stderr, and the run compiles without the cache.
    """
    directory = resolve_compile_cache(setting)
    disable_compile_cache()
    if directory is None:
        return None
    path = directory / host_kind()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as error:
        print(
            f"warning: compilation cache {directory} cannot be used ({error.strerror or error}); "
            "compiling without the cache",
            file=sys.stderr,
            flush=True,
        )
        return None
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size threshold
    jax_cache.set_cache_dir(str(path))
    jax_cache.reset_cache()  # jax opens its cache once per process; the next compile opens this directory
    return path


def disable_compile_cache() -> None:
    """Turns the persistent cache off (programs already loaded stay in memory)."""
    jax.config.update("jax_compilation_cache_dir", None)
    jax_cache.reset_cache()


def compile_cache_directory() -> Path | None:
    """The directory jax's persistent cache uses now, or None when it is off."""
    path = jax.config.jax_compilation_cache_dir
    return Path(path) if path else None


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How TensorStore (C++) reports ENOSPC; it reaches Python as a ValueError carrying this text.
_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "os_error_code='28'")
_UMASK = os.umask(0o022)  # read once at import (os.umask can only be read by setting it); restored at once
os.umask(_UMASK)


def is_disk_full(error: BaseException | None) -> bool:
    """Whether `error`, or any exception in its chain (cause, context, an exception group's members), is a full
    disk or an exceeded quota."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return True
        if any(text in str(e) for text in _DISK_FULL_TEXT):
            return True
        pending += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return False


def _existing(path: str | os.PathLike) -> Path:
    """`path`, or its nearest existing ancestor (the folder a missing path would be made in)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes free for this user on the filesystem that holds (or would hold) `path`."""
    return shutil.disk_usage(_existing(path)).free


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def space_report(path: str | os.PathLike, needed: int | None = None) -> str:
    """'needs about X, Y free' (or 'Y free' when the need is unknown) for the filesystem of `path`."""
    free = human_bytes(free_bytes(path))
    return f"needs about {human_bytes(needed)}, {free} free" if needed else f"{free} free"


def probe_writable(folder: str | os.PathLike, create: bool = True) -> Path:
    """Checks that files can be written in `folder` by creating and removing one there; OSError if not.

    create=True makes `folder` (and its parents) first, if missing. create=False leaves nothing behind: the file is
    made in the nearest existing ancestor, where the missing folders would be made. The callers turn the OSError
    into their one-line error naming the flag or key that chose the folder.
    """
    folder = Path(folder)
    if create:
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(folder))
        folder.mkdir(parents=True, exist_ok=True)
        where = folder
    else:
        where = _existing(folder)
        if not where.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{where} is not a directory", str(where))
    with tempfile.TemporaryFile(dir=where):
        pass
    return folder


def same_file(a: str, b: str) -> bool:
    """Whether a and b name one file: any spelling, symbolic or hard links (paths that do not exist: spelling)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def refuse_overwriting_inputs(outputs: dict[str, str | None], inputs: dict[str, str | None]) -> None:
    """EvalError (one line, naming both flags) where an output is an input, or two outputs are one file; None
    values are ignored. Every command checks its outputs so before it reads anything."""
    outputs = {k: v for k, v in outputs.items() if v}
    inputs = {k: v for k, v in inputs.items() if v}
    for out_flag, out in outputs.items():
        for in_flag, path in inputs.items():
            if same_file(out, path):
                raise EvalError(
                    f"{out_flag} {out} is the input {in_flag} {path}: writing it would destroy the input; "
                    "choose another output file"
                )
    names = list(outputs.items())
    for i, (flag_a, a) in enumerate(names):
        for flag_b, b in names[i + 1 :]:
            if same_file(a, b):
                raise EvalError(f"{flag_a} and {flag_b} are the same file {a}; choose two different files")


def check_writable(path: str | os.PathLike, flag: str) -> None:
    """EvalError unless file `path` can be written, its folder created: tested without leaving anything behind."""
    path = Path(path)
    if path.is_dir():
        raise EvalError(f"{flag} {path} is a directory; give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise EvalError(f"{flag} {path}: permission denied; choose another output file")
    check_folder_writable(path.parent, flag)


def check_folder_writable(folder: str | os.PathLike, flag: str) -> None:
    """EvalError unless files can be written in `folder`, which may not exist yet (then: can it be created)."""
    try:
        probe_writable(folder, create=False)
    except NotADirectoryError as e:
        raise EvalError(f"{flag}: {e.strerror}, so {folder} cannot be created; choose another location") from e
    except OSError as e:
        raise EvalError(f"{flag}: cannot write in {folder} ({e.strerror or e}); choose another location") from e


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Writes `text` (UTF-8, LF) to `path` whole or not at all: into a temporary file beside it, renamed onto it
    when complete. On any failure the temporary file is removed and the error (OSError) raised; the file at
    `path`, if there was one, is unchanged."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp's 0o600 would differ from a file opened for writing
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# The outputs of the command lines (evaluate.py, translate_corpus, the sweep), written whole or not at all: a full disk
# is one line and leaves any earlier file of that name unchanged.


def write_lines(path: str | os.PathLike, lines: list[str]) -> None:
    _write_whole(str(path), "".join(line + "\n" for line in lines))


def write_json(path: str | os.PathLike, obj: Any) -> None:
    _write_whole(str(path), to_json(obj) + "\n")


def to_json(obj: Any) -> str:
    """Indented; values JSON cannot hold, as their str."""
    return json.dumps(obj, indent=1, default=str)


def _write_whole(path: str, text: str) -> None:
    try:
        write_text_atomically(path, text)
    except OSError as e:
        if not is_disk_full(e):
            raise
        raise DiskFullError(
            f"disk full while writing {path} ({space_report(path, len(text.encode()))}); nothing was written "
            "there (an earlier file of that name is unchanged): free space or choose another location"
        ) from None


class Progress:
    """Progress over `total` units (`unit`: steps, lines, sentences) starting at `initial`.

    `update(n, **shown)` advances by n; `set(done, **shown)` moves to an absolute position; `shown` values (loss,
    learning rate, ...) go into the bar's postfix or the log line. `enabled=False` (a host other than process 0)
    shows nothing.
    """

    def __init__(self, total: int, desc: str, unit: str, initial: int = 0, enabled: bool = True):
        self.total, self.desc, self.unit = total, desc, unit
        self.first = self.done = initial
        self.start = time.perf_counter()
        self.enabled = enabled
        self.next_tenth = self._tenths() + 1
        self.bar = None
        if enabled and sys.stderr.isatty():
            self.bar = tqdm.tqdm(
                total=total, initial=initial, desc=desc, unit=f" {unit}", dynamic_ncols=True, mininterval=1.0
            )

    def _tenths(self) -> int:
        return 10 * self.done // self.total if self.total else 0

    def update(self, n: int = 1, **shown: float) -> None:
        self.set(self.done + n, **shown)

    def set(self, done: int, **shown: float) -> None:
        self.done = done
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = done
            if shown:
                self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
            self.bar.refresh()
            return
        tenths = self._tenths()
        if shown or tenths >= self.next_tenth:
            self.next_tenth = tenths + 1
            log.info("%s", self.line(shown))

    def line(self, shown: dict[str, float] | None = None) -> str:
        """'desc: done/total unit (p%)  key value ...  elapsed s, eta HH:MM:SS'."""
        elapsed = time.perf_counter() - self.start
        rate = (self.done - self.first) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        percent = f" ({100 * self.done // self.total}%)" if self.total else ""
        values = "".join(f"  {k} {v:.4g}" for k, v in (shown or {}).items())
        return (
            f"{self.desc}: {self.done}/{self.total} {self.unit}{percent}{values}  {elapsed:.0f} s, "
            f"eta {time.strftime('%H:%M:%S', time.gmtime(eta))}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
