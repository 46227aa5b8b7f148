"""The platform a program is built for: the running backend, or the one an ahead-of-time compile targets.

Every choice that depends on the accelerator (which attention kernel `auto` runs, how Pallas lowers, whether the
CPU-only fused backward passes are used) asks `target_backend()`, never `jax.default_backend()` directly: a CPU
host that compiles for a TPU or GPU topology (train.py --plan) runs inside `compiling_for("tpu")`, so those
choices follow the target rather than the host.

Which backend jax runs on is jax's choice (its plugins, $JAX_PLATFORMS); nothing here configures it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

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
