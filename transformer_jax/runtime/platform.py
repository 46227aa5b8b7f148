"""The platform a program is built for: the running backend, or the one an ahead-of-time compile targets.

Every choice that depends on the accelerator (which attention kernel `auto` runs, how Pallas lowers, whether the
CPU-only fused backward passes are used) asks `target_backend()`, never `jax.default_backend()` directly: a CPU
host that compiles for a TPU or GPU topology (train.py --plan) runs inside `compiling_for("tpu")`, so those
choices follow the target rather than the host.

Which backend jax runs on is jax's choice (its plugins, $JAX_PLATFORMS). The one exception is made by the command
lines, never by importing the package: `use_cpu_without_accelerators()` before the first backend use. With the
ahead-of-time compilers installed (requirements-aot.txt, for `train.py --plan`), jax would otherwise try the CUDA
plugin and libtpu on a host that has neither chip, and each prints its failure (a `cuInit` traceback, libtpu's
`TPU_ACCELERATOR_TYPE` and `TPU_WORKER_HOSTNAMES` warnings) before jax falls back to the CPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from pathlib import Path

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
