"""Device mesh, parameter and batch shardings, and multi-host setup.

One mesh axis, `data`, spans every device of every host. Batches are split along it. Parameters and optimizer
state are replicated (`train.mesh = "data"`, data parallel) or split along their largest divisible axis
(`train.mesh = "fsdp"`, fully sharded); XLA inserts the all-gathers and reduce-scatters.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax.errors import ConfigError

MESH_MODES = ("data", "fsdp")


def initialize_distributed() -> None:
    """Joins a multi-host run when the launcher says so (JAX_COORDINATOR_ADDRESS, or a TPU pod / SLURM cluster).

    jax.distributed.initialize() reads the coordinator, process count and id from the environment on TPU pods,
    SLURM and Open MPI; JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID set them by hand.
    """
    if os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("TRANSFORMER_JAX_DISTRIBUTED") == "1":
        jax.distributed.initialize()


def make_mesh(devices: list | None = None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    return Mesh(np.asarray(devices), ("data",))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over `data`."""
    return NamedSharding(mesh, P("data"))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def array_sharding(shape: tuple[int, ...], mesh: Mesh, mode: str) -> NamedSharding:
    """Replicated for data parallel; for FSDP, split the largest axis that the device count divides."""
    if mode not in MESH_MODES:
        raise ConfigError(f"config key train.mesh: unknown value {mode!r}; choose one of {list(MESH_MODES)}")
    size = mesh.shape["data"]
    if mode == "data" or size == 1 or not shape:
        return replicated(mesh)
    for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
        if shape[axis] % size == 0 and shape[axis] >= size:
            spec = [None] * len(shape)
            spec[axis] = "data"
            return NamedSharding(mesh, P(*spec))
    return replicated(mesh)  # small or indivisible arrays (biases, norms) stay whole


def state_shardings(state, mesh: Mesh, mode: str):
    """A sharding for every array of a state pytree."""
    return jax.tree.map(lambda x: array_sharding(tuple(getattr(x, "shape", ())), mesh, mode), state)
