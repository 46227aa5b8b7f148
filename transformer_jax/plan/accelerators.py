"""Accelerators this host does not have, for ahead-of-time compilation (train.py --plan, the compile tests and
benchmarks): the facts of each chip in one table, the slice names users type, and the devices of such a slice,
which the real TPU or GPU compiler accepts on a CPU host (libtpu's and the CUDA plugin's topology descriptions).

Install the compilers with `pip install -r requirements-aot.txt`. Nothing here runs a program; the devices only
serve `jax.jit(f).trace(...).lower(...).compile()` over a Mesh of them.

Names (`parse_topology`): Cloud TPU accelerator types `v5e-8`, `v4-32`, `v5p-16`, `v6e-8` (the number counts
TensorCores, two per chip on v4 and v5p, one on v5e and v6e), libtpu topologies `v5e:2x4`, `v4:2x2x4` (chips
along each axis), and GPUs `h100:8`, `h200:16` (GPUs, 8 per host). Slices of several hosts are allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from importlib import resources

import jax
from jax.experimental import topologies

from transformer_jax.errors import ConfigError

AOT_REQUIREMENTS = "requirements-aot.txt"


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip as its vendor states it (bytes and per-second rates are per chip)."""

    name: str  # what users type before '-' or ':'
    platform: str  # "tpu" | "cuda": the jax platform that compiles for it
    device_kind: str  # jax's Device.device_kind of the compiled-for device
    hbm_bytes: float  # high-bandwidth memory
    peak_bf16_flops: float  # dense bfloat16 matmul FLOP/s
    hbm_bytes_per_s: float
    interconnect_bytes_per_s: float  # chip-to-chip (TPU ICI, NVLink), both directions together
    chips_per_host: int  # chips of one host in a slice of several hosts
    cores_per_chip: int  # TensorCores per chip: what a Cloud TPU accelerator type's number counts
    axes: int  # dimensions of a libtpu topology (2: v5e 2x4, 3: v4 2x2x1); 1 for GPUs


CHIPS = {
    chip.name: chip
    for chip in (
        # https://cloud.google.com/tpu/docs/v4 (275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GB/s, 4 chips per host);
        # ICI: 6 links of 90 GB/s both ways, https://jax-ml.github.io/scaling-book/tpus/
        Chip("v4", "tpu", "TPU v4", 32 * 2**30, 275e12, 1200e9, 540e9, 4, 2, 3),
        # https://cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, ICI 400 GB/s per chip;
        # 8 chips on a one-host slice, 4 per host on larger ones)
        Chip("v5e", "tpu", "TPU v5 lite", 16e9, 197e12, 819e9, 400e9, 4, 1, 2),
        # https://cloud.google.com/tpu/docs/v5p (459 TFLOP/s bf16, 95 GiB HBM2e at 2765 GB/s, ICI 1200 GB/s per chip,
        # 4 chips per host)
        Chip("v5p", "tpu", "TPU v5", 95 * 2**30, 459e12, 2765e9, 1200e9, 4, 2, 3),
        # https://cloud.google.com/tpu/docs/v6e (918 TFLOP/s bf16, 32 GB HBM at 1638 GB/s, ICI 800 GB/s per chip;
        # 8 chips on a one-host slice, 4 per host on larger ones)
        Chip("v6e", "tpu", "TPU v6 lite", 32e9, 918e12, 1638e9, 800e9, 4, 1, 2),
        # https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: 80 GB HBM3 at 3.35 TB/s, 989 TFLOP/s bf16 dense
        # (the page's 1979 is with sparsity), NVLink 900 GB/s; 8 GPUs per HGX host)
        Chip("h100", "cuda", "NVIDIA H100 80GB HBM3", 80e9, 989e12, 3.35e12, 900e9, 8, 1, 1),
        # https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: 141 GB HBM3e at 4.8 TB/s, 989 TFLOP/s bf16 dense,
        # NVLink 900 GB/s; 8 GPUs per HGX host)
        Chip("h200", "cuda", "NVIDIA H200", 141e9, 989e12, 4.8e12, 900e9, 8, 1, 1),
    )
}

# Cloud TPU slice shapes by chips (https://cloud.google.com/tpu/docs/v5e, .../v4, .../v5p, .../v6e).
_TPU_SHAPES = {
    2: {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
    3: {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8", 512: "8x8x8"},
}
_NAME = re.compile(r"(?P<chip>[a-z0-9]+)(?:-(?P<count>\d+)|:(?P<shape>\d+(?:x\d+)*))")


@dataclasses.dataclass(frozen=True)
class Topology:
    """A slice of `chips` chips of one kind, `hosts` hosts; `shape` as libtpu (2x4, 2x2x1) or the CUDA plugin
    (slices x hosts x GPUs per host) name it."""

    name: str
    chip: Chip
    chips: int
    hosts: int
    shape: str

    def devices(self) -> tuple[jax.Device, ...]:
        """One jax device per chip (compile-only: placing data on them fails)."""
        return _devices(self)


def valid_names() -> list[str]:
    """Every form parse_topology accepts, by chip, for error messages."""
    names = []
    for chip in CHIPS.values():
        if chip.platform == "cuda":
            names.append(f"{chip.name}:N (N <= {chip.chips_per_host} or a multiple of {chip.chips_per_host})")
        else:
            counts = sorted(_TPU_SHAPES[chip.axes])
            cores = [c * chip.cores_per_chip for c in counts]
            axes = "x".join("ABC"[: chip.axes])
            names.append(f"{chip.name}-{cores[0]} .. {chip.name}-{cores[-1]} or {chip.name}:{axes}")
    return names


def parse_topology(name: str) -> Topology:
    """The slice a user names (see the module docstring); an unknown name lists the valid forms."""
    match = _NAME.fullmatch(name.strip().lower())
    chip = CHIPS.get(match["chip"]) if match else None
    if chip is None:
        raise ConfigError(
            f"topology {name!r}: unknown topology; valid names: {'; '.join(valid_names())} (e.g. v5e-8, v5e:2x4, "
            "v4-32, v6e-8, h100:8)"
        )
    if chip.platform == "cuda":
        gpus = int(match["count"] or match["shape"])
        if "x" in (match["shape"] or "") or gpus < 1 or (gpus > chip.chips_per_host and gpus % chip.chips_per_host):
            raise ConfigError(
                f"topology {name!r}: name GPUs as {chip.name}:N with N <= {chip.chips_per_host} or a multiple of "
                f"{chip.chips_per_host} (hosts of {chip.chips_per_host} GPUs)"
            )
        per_host = min(gpus, chip.chips_per_host)
        return Topology(name, chip, gpus, gpus // per_host, f"1x{gpus // per_host}x{per_host}")
    shapes = _TPU_SHAPES[chip.axes]
    if match["count"]:
        cores = int(match["count"])
        chips = cores // chip.cores_per_chip
        if cores % chip.cores_per_chip or chips not in shapes:
            sizes = ", ".join(f"{chip.name}-{c * chip.cores_per_chip}" for c in sorted(shapes))
            raise ConfigError(f"topology {name!r}: no such {chip.name} slice; valid sizes: {sizes}")
        shape = shapes[chips]
    else:
        shape = match["shape"]
        if shape.count("x") + 1 != chip.axes:
            raise ConfigError(
                f"topology {name!r}: a {chip.name} topology has {chip.axes} axes, e.g. {chip.name}:{shapes[8]}"
            )
        chips = math.prod(int(n) for n in shape.split("x"))
    per_host = chips if chips <= 8 // chip.cores_per_chip else chip.chips_per_host
    return Topology(name, chip, chips, max(1, chips // per_host), shape)


def _host_bounds(topology: Topology) -> tuple[int, int, int]:
    """Chips of one host along each axis: the whole slice if it fits one host, else a 2x2x1 block of 4."""
    dims = [int(n) for n in topology.shape.split("x")] + [1] * (3 - topology.chip.axes)
    return tuple(dims) if topology.hosts == 1 else (2, 2, 1)


@functools.cache
def _devices(topology: Topology) -> tuple[jax.Device, ...]:
    chip = topology.chip
    try:
        if chip.platform == "cuda":
            target = resources.files("transformer_jax.plan").joinpath("gpu_targets", f"{chip.name}.txtpb").read_text()
            desc = topologies.get_topology_desc(platform="cuda", target_config=target, topology=topology.shape)
        else:
            # libtpu looks for a TPU VM's metadata when it loads and warns on stderr without these; a plan needs
            # neither (the slice is named below), so say there is one local worker. It also locks the host's TPU
            # chips against a second process, which compiling never uses: let several plans run at once.
            os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
            os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{chip.name}-{topology.chips * chip.cores_per_chip}")
            desc = topologies.get_topology_desc(
                platform="tpu",
                topology_name=f"{chip.name}:{topology.shape}",
                chips_per_host_bounds=_host_bounds(topology),
                # One device per chip, as jax shows a v4 or v5p chip's two TensorCores on a real host.
                **({"chip_config_name": "megacore"} if chip.cores_per_chip == 2 else {}),
            )
    except (RuntimeError, NotImplementedError) as error:
        text = str(error)
        if "not installed" in text or "not implemented for cuda" in text:
            compiler = "libtpu" if chip.platform == "tpu" else "the CUDA plugin (jax-cuda12-plugin)"
            raise ConfigError(
                f"compiling for {topology.name!r} needs {compiler}: pip install -r {AOT_REQUIREMENTS}"
            ) from None
        raise ConfigError(f"topology {topology.name!r}: {text.splitlines()[0]}") from None
    return tuple(desc.devices)


def tpu_devices(topology_name: str) -> tuple[jax.Device, ...]:
    """The devices of a TPU slice, e.g. 'v5e:2x2', 'v4:2x2x1', 'v6e-8' (one per chip)."""
    topology = parse_topology(topology_name)
    if topology.chip.platform != "tpu":
        raise ConfigError(f"{topology_name!r} is not a TPU slice")
    return topology.devices()
