"""Devices of accelerators that this host does not have, for ahead-of-time compilation (train.py --plan, the
compile tests and benchmarks): the real TPU compiler runs on a CPU host through libtpu's topology description.

Install the compilers with `pip install -r requirements-aot.txt`. Nothing here runs a program; the devices only
serve `jax.jit(f).trace(...).lower(...).compile()` over a Mesh of them.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import topologies

from transformer_jax.errors import ConfigError

AOT_REQUIREMENTS = "requirements-aot.txt"


@functools.cache
def tpu_devices(topology_name: str) -> tuple[jax.Device, ...]:
    """The devices of a TPU slice named as libtpu names it, e.g. 'v5e:2x2', 'v4:2x2x1', 'v6e:2x4'."""
    try:
        topology = topologies.get_topology_desc(platform="tpu", topology_name=topology_name)
    except RuntimeError as error:
        if "TPU support not installed" in str(error):
            raise ConfigError(
                f"compiling for TPU {topology_name!r} needs libtpu: pip install -r {AOT_REQUIREMENTS}"
            ) from None
        raise ConfigError(f"TPU topology {topology_name!r}: {str(error).splitlines()[0]}") from None
    return tuple(topology.devices)
