"""JAX's persistent compilation cache, turned on by every command line through jax's public settings: a restarted,
resumed or repeated run loads its compiled programs from disk instead of compiling them again.

Where: `--compilation_cache DIR` (every command line), else $TRANSFORMER_JAX_COMPILATION_CACHE, else
`~/.cache/transformer_jax/xla`; `off` disables it. Entries go in a subdirectory per host CPU type (XLA:CPU code is
compiled for the host's instruction set, and a home directory may be shared by machines of several kinds). Nothing
is evicted: `rm -r` the directory to clear it.

jax keys an entry by a hash of the lowered program (every shape, dtype, sharding and static setting that reaches
it), the jaxlib version, the backend and its platform version, XLA_FLAGS and the compile options; a process still
traces and lowers each program to find its entry. Entries are zlib streams, whose checksum makes a truncated or
damaged entry fail to load: jax then warns ("Error reading persistent compilation cache entry"), compiles, and
the result is right. jax never replaces such an entry; delete it or the directory (docs/compilation.md).

jax's size limit (`jax_compilation_cache_max_size`) is left unset: with it, jax locks the directory around each read
and write, but an entry whose writer was killed (or hit a full disk) before jax wrote its access-time file makes
every later write to that directory fail (docs/compilation.md).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import tempfile
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

ENV = "TRANSFORMER_JAX_COMPILATION_CACHE"
OFF = ("off", "none", "false", "0")
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


def resolve(setting: str | None) -> Path | None:
    """The cache directory a setting names: a path, 'off' (None), or unset (the environment, else the default)."""
    if setting is None:
        setting = os.environ.get(ENV)
    if setting is None or setting == "":
        return user_cache_root() / "xla"
    if setting.lower() in OFF:
        return None
    return Path(setting).expanduser()


def enable(setting: str | None = None, min_compile_seconds: float = MIN_COMPILE_SECONDS) -> Path | None:
    """Turns jax's persistent cache on at `resolve(setting)`'s per-host subdirectory (or off); returns that
    directory, or None when off. Called by entry points before their first compile; calling it again switches.

    Programs that compile in less than min_compile_seconds are compiled every time, never written. A directory
    that cannot be created or written is one warning line on stderr, and the run compiles without the cache.
    """
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


def disable() -> None:
    """Turns the persistent cache off (programs already loaded stay in memory)."""
    jax.config.update("jax_compilation_cache_dir", None)
    jax_cache.reset_cache()


def directory() -> Path | None:
    """The directory jax's persistent cache uses now, or None when it is off."""
    path = jax.config.jax_compilation_cache_dir
    return Path(path) if path else None
