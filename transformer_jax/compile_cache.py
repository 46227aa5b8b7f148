"""JAX's persistent compilation cache, on for every command line: a restarted, resumed or repeated run loads its
compiled programs from disk instead of compiling them again.

Where: `--compilation_cache DIR` (every command line), else $TRANSFORMER_JAX_COMPILATION_CACHE, else
`~/.cache/transformer_jax/xla`; `off` disables it. Entries go in a subdirectory per host CPU type (XLA:CPU code is
compiled for the host's instruction set, and a home directory may be shared by machines of several kinds). Nothing
is ever evicted: `rm -r` the directory to clear it.

What keys an entry is jax's own cache key (jax._src.cache_key.get): a hash of the lowered program itself (its
StableHLO: every shape, dtype, sharding, constant and static setting that reaches the program, so configs that
build different programs never share an entry), the jaxlib version, the backend and its platform version (a TPU or
GPU compile never meets a CPU one), XLA_FLAGS and LIBTPU_INIT_ARGS, the compile options (donation, device
assignment, ...) and the devices. Settings that leave the program unchanged (paths, the data) share its entries.

Why a store of our own under jax's cache: jax 0.10.2's file cache writes an entry in place, so a concurrent reader
(two test workers, parallel sweep runs) or a killed writer can meet a truncated entry, which jax reports and then
never replaces; and every failed write warns again. This store writes a temporary file and renames it, treats an
entry whose checksum fails as a miss and replaces it, and reports an unwritable or full directory once, as one
warning line, after which the run compiles without writing. A damaged entry therefore costs a compile, never a
failed run or a wrong program.

jax's key needs the program traced and lowered first; the package's own jitted functions skip that on a hit through
saved_programs.py, whose entries live in the same directory.

Ahead-of-time compiles for devices this host does not have (transformer_jax/accelerators.py: a TPU or GPU topology
compiled on a CPU host) run on a compile-only client, which cannot load an executable back: they never use the
cache (jax would write their entries and then warn on every read).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import logging
import os
import platform
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import jax
from jax._src import compilation_cache as jax_cache
from jax._src import dispatch as jax_dispatch
from jax._src.compilation_cache_interface import CacheInterface

ENV = "TRANSFORMER_JAX_COMPILATION_CACHE"
OFF = ("off", "none", "false", "0")
# Every program is written, however fast it compiles: XLA:CPU takes ~20 ms for even one elementwise op (its
# fixed cost: LLVM code generation), and loading the entry ~1.5 ms (docs/compilation.md). Eager ops and small
# initialisers are most of a process's programs.
MIN_COMPILE_SECONDS = 0.0
_DIGEST = hashlib.sha256().digest_size
_SUFFIX = "-xla"
_COMPILE_ONLY = "compile_only_runtime"  # the runtime_type of the clients of jax.experimental.topologies devices


class _QuietCompileOnly(logging.Filter):
    """Drops jax's warning that a compile-only client has no cache: that is the intended outcome here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.getMessage().startswith("_get_cache: Unsupported runtime") and _COMPILE_ONLY in str(record.args)
        )


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


def warn(message: str) -> None:
    print(f"warning: compilation cache {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Stats:
    hits: int = 0
    misses: int = 0
    writes: int = 0
    damaged: int = 0


class CheckedFileCache(CacheInterface):
    """One file per entry: the value and its SHA-256, written through a temporary file and a rename."""

    def __init__(self, path: Path):
        self.path = path
        self.stats = Stats()
        self.writable = True
        self._local = threading.local()

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """jax's lookups and writes in this thread miss and write nothing (saved_programs.py: an executable jax
        loaded from this cache does not serialize again, so the programs it stores are compiled afresh)."""
        self._local.bypass = True
        try:
            yield
        finally:
            self._local.bypass = False

    def _bypassed(self) -> bool:
        return getattr(self._local, "bypass", False)

    def _file(self, key: str) -> Path:
        return self.path / f"{key}{_SUFFIX}"

    def get(self, key: str, *, counted: bool = True) -> bytes | None:
        """The entry's value, or None (absent, unreadable, damaged); counted=False: not in `stats` (an entry that is
        not a program, e.g. saved_programs.py's record of the programs a run used)."""
        if self._bypassed():
            return None
        file = self._file(key)
        try:
            data = file.read_bytes()
        except FileNotFoundError:
            self.stats.misses += counted
            return None
        except OSError as error:
            self.stats.misses += counted
            warn(f"entry {file} cannot be read ({error.strerror or error}); compiling instead")
            return None
        value, digest = data[:-_DIGEST], data[-_DIGEST:]
        if len(data) < _DIGEST or hashlib.sha256(value).digest() != digest:
            self.stats.misses += 1
            self.stats.damaged += 1
            if self.stats.damaged == 1:
                warn(f"entry {file} is damaged; compiling the program again and replacing it")
            try:
                file.unlink()
            except OSError:
                pass
            return None
        self.stats.hits += counted
        return value

    def put(self, key: str, value: bytes) -> None:
        if not self.writable or self._bypassed():
            return
        temporary = None
        try:
            with tempfile.NamedTemporaryFile(dir=self.path, prefix=".tmp-", delete=False) as out:
                temporary = out.name
                out.write(value)
                out.write(hashlib.sha256(value).digest())
            os.replace(temporary, self._file(key))
            self.stats.writes += 1
        except OSError as error:
            self.writable = False
            warn(f"{self.path} cannot be written ({error.strerror or error}); compiling without writing to it")
            if temporary is not None:
                try:
                    os.unlink(temporary)
                except OSError:
                    pass


def resolve(setting: str | None) -> Path | None:
    """The cache directory a setting names: a path, 'off' (None), or unset (the environment, else the default)."""
    if setting is None:
        setting = os.environ.get(ENV)
    if setting is None or setting == "":
        return user_cache_root() / "xla"
    if setting.lower() in OFF:
        return None
    return Path(setting).expanduser()


_store: CheckedFileCache | None = None


def enable(setting: str | None = None, min_compile_seconds: float = MIN_COMPILE_SECONDS) -> CheckedFileCache | None:
    """Turns the persistent cache on at `resolve(setting)` (or off), before the first compile; returns the store.

    Programs that compile in less than min_compile_seconds are compiled every time, never written.

    A directory that cannot be created or written is one warning line, and the run compiles without the cache.
    """
    global _store
    directory = resolve(setting)
    disable()
    if directory is None:
        return None
    path = directory / host_kind()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as error:
        warn(f"{directory} cannot be used ({error.strerror or error}); compiling without the cache")
        return None
    _store = CheckedFileCache(path)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax_cache._UNSUPPORTED_RUNTIMES.add(_COMPILE_ONLY)
    if not any(isinstance(f, _QuietCompileOnly) for f in jax_cache.logger.filters):
        jax_cache.logger.addFilter(_QuietCompileOnly())
    # jax builds its own file cache on first use unless one is installed; install ours in its place.
    with jax_cache._cache_initialized_mutex:
        jax_cache._cache = _store
        jax_cache._cache_initialized = True
    return _store


def disable() -> None:
    """Turns the persistent cache off (programs already loaded stay in memory)."""
    global _store
    _store = None
    jax.config.update("jax_compilation_cache_dir", None)
    with jax_cache._cache_initialized_mutex:
        jax_cache._cache = None
        jax_cache._cache_initialized = False


def store() -> CheckedFileCache | None:
    """The store enable() installed, if the cache is on (its `stats` count hits, misses and writes)."""
    return _store


@dataclasses.dataclass
class Programs:
    """The XLA programs this process built: compiled, or loaded from the persistent cache."""

    count: int = 0
    seconds: float = 0.0  # in XLA's compiler or reading the cache
    tracing_seconds: float = 0.0  # tracing and lowering: paid again on a jax cache hit, not on a saved_programs one
    functions: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # jitted name -> count


_programs = Programs()
_programs_lock = threading.Lock()  # saved_programs.py loads programs on background threads too


def _on_jax_event(event: str, seconds: float, fun_name: str = "?", **kwargs) -> None:
    # jax times every executable it builds under this event, a persistent-cache load included.
    if event == jax_dispatch.BACKEND_COMPILE_EVENT:
        count_program(fun_name, seconds)
    elif event in (jax_dispatch.JAXPR_TRACE_EVENT, jax_dispatch.JAXPR_TO_MLIR_MODULE_EVENT):
        _programs.tracing_seconds += seconds


jax.monitoring.register_event_duration_secs_listener(_on_jax_event)


def count_program(fun_name: str, seconds: float) -> None:
    """Counts a program built (compiled, or loaded: by jax, or by saved_programs.py without jax, whose store hits the
    store counts) and the seconds it took."""
    with _programs_lock:
        _programs.count += 1
        _programs.seconds += seconds
        _programs.functions[fun_name] += 1


def compilations() -> dict:
    """What the reports print: programs built so far in this process, how many came from the persistent cache
    (a cache on, else 0), how many XLA compiled, the seconds that took, the seconds spent tracing and lowering
    (which a jax cache hit does not save: its key is the lowered program; a saved_programs hit does), and the
    count per jitted function."""
    loaded = _store.stats.hits if _store is not None else 0
    return {
        "programs": _programs.count,
        "loaded_from_cache": loaded,
        "compiled": _programs.count - loaded,
        "seconds": round(_programs.seconds, 2),
        "tracing_seconds": round(_programs.tracing_seconds, 2),
        "cache": str(_store.path) if _store is not None else None,
        "functions": dict(_programs.functions.most_common()),
    }
