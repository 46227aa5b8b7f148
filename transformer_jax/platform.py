"""The platform a program is built for: the running backend, or the one an ahead-of-time compile targets.

Every choice that depends on the accelerator (which attention kernel `auto` runs, how Pallas lowers, whether the
CPU-only fused backward passes are used) asks `target_backend()`, never `jax.default_backend()` directly: a CPU
host that compiles for a TPU or GPU topology (train.py --plan) runs inside `compiling_for("tpu")`, so those
choices follow the target rather than the host.
"""

from __future__ import annotations

import contextlib
import contextvars
import glob
import os
from collections.abc import Iterator

import jax
from jax._src import xla_bridge  # backends_are_initialized: jax has no public way to ask

BACKENDS = ("cpu", "gpu", "tpu")
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}  # device platforms as jax names them -> backend names
# Device nodes of the accelerators jax has plugins for: TPU (v2-v5p /dev/accel*, v5e/v6e VFIO), NVIDIA, AMD.
ACCELERATOR_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")
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


def has_accelerator_nodes() -> bool:
    return any(glob.glob(pattern) for pattern in ACCELERATOR_NODES)


def configure_host() -> None:
    """On a host without accelerator device nodes, where the user chose no platform, jax uses the CPU alone.

    libtpu and the CUDA plugin (requirements-aot.txt) serve such a host only as compilers for other machines;
    left to themselves, jax's first backend start would try them, print TPU/CUDA initialisation errors and cost
    about a second. Their compilers stay reachable: accelerators.tpu_devices works under JAX_PLATFORMS=cpu. And
    several processes may then load libtpu at once (its lockfile guards a TPU this host does not have).
    Called once, on importing the package; does nothing once jax has started its backends.
    """
    if has_accelerator_nodes() or xla_bridge.backends_are_initialized():
        return
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if "JAX_PLATFORMS" not in os.environ and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
