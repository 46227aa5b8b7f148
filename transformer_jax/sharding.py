"""Device mesh, parameter and batch shardings, and multi-host setup.

One mesh axis, `data`, spans every device of every host. Batches are split along it. Parameters and optimizer
state are replicated (`train.mesh = "data"`, data parallel) or split along their largest divisible axis
(`train.mesh = "fsdp"`, fully sharded); XLA inserts the all-gathers and reduce-scatters.
"""

from __future__ import annotations

import contextlib
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax import runtime
from transformer_jax.errors import ConfigError

MESH_MODES = ("data", "fsdp")


def initialize_distributed() -> None:
    """Joins a multi-host run when the launcher says so; a single-host run does nothing.

    - JAX_COORDINATOR_ADDRESS (host:port of process 0) with JAX_NUM_PROCESSES and JAX_PROCESS_ID: any cluster,
      set by hand on every host (jax.distributed reads only the address from the environment, so we pass the
      other two).
    - TRANSFORMER_JAX_DISTRIBUTED=1: let jax.distributed.initialize() detect everything (TPU pods, SLURM, Open MPI).
    """
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address:
        values = {}
        for name in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
            raw = os.environ.get(name)
            try:
                values[name] = None if raw is None else int(raw)
            except ValueError:
                raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None
        num_processes, process_id = values["JAX_NUM_PROCESSES"], values["JAX_PROCESS_ID"]
        if (num_processes is None) != (process_id is None):
            raise ConfigError(
                "JAX_COORDINATOR_ADDRESS is set with only one of JAX_NUM_PROCESSES and JAX_PROCESS_ID: set both "
                "on every host, or neither to let SLURM / Open MPI supply them"
            )
        jax.distributed.initialize(address, num_processes, process_id)
    elif os.environ.get("TRANSFORMER_JAX_DISTRIBUTED") == "1":
        jax.distributed.initialize()


def make_mesh(devices: list | None = None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    return Mesh(np.asarray(devices), ("data",))


def tracing_mesh(mesh: Mesh) -> contextlib.AbstractContextManager:
    """The mesh to trace steps under: Mosaic kernels cannot be partitioned by XLA, so on a TPU target our Pallas
    attention (ops/pallas_tpu.py) runs per device in a shard_map over the mesh in context (jax.set_mesh); the
    other backends trace without one."""
    return jax.set_mesh(mesh) if runtime.target_backend() == "tpu" else contextlib.nullcontext()


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
