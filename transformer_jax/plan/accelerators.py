"""Accelerators this host does not have, for ahead-of-time compilation (train.py --plan, the compile tests and
benchmarks): the chips' facts, the slice names users type (docs/plan.md), the devices of a slice that the real TPU
or GPU compiler accepts on a CPU host, and what a program compiled for them needs per chip. Nothing here runs.
hlo_module_cost_from_private_jax is transformer_jax's one private jax use (tests/test_layering.py allows it here).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from importlib import resources

import jax
import jax.numpy as jnp
from jax.experimental import topologies

from transformer_jax.errors import ConfigError
from transformer_jax.sharding import array_sharding

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
            cores = [c * chip.cores_per_chip for c in sorted(_TPU_SHAPES[chip.axes])]
            axes = "x".join("ABC"[: chip.axes])
            names.append(f"{chip.name}-{cores[0]} .. {chip.name}-{cores[-1]} or {chip.name}:{axes}")
    return names


def parse_topology(name: str) -> Topology:
    """The slice a user names: Cloud TPU accelerator types `v5e-8`, `v4-32` (TensorCores: two per chip on v4 and
    v5p), libtpu shapes `v5e:2x4`, `v4:2x2x4` (chips per axis), GPUs `h100:8` (8 per host)."""
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
            # Chips of one host along each axis: the whole slice if it fits one host, else a 2x2x1 block of 4.
            dims = [int(n) for n in topology.shape.split("x")] + [1] * (3 - chip.axes)
            desc = topologies.get_topology_desc(
                platform="tpu",
                topology_name=f"{chip.name}:{topology.shape}",
                chips_per_host_bounds=tuple(dims) if topology.hosts == 1 else (2, 2, 1),
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


# What a program compiled for such a slice needs and does per chip.


class DoesNotFit(ConfigError):
    """The planned step needs more memory per chip than the chip has."""


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Bytes each chip sends per byte of the op's result in a ring over n chips (reduce-scatter: of its input).
_WIRE = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: n - 1,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
_DTYPE_BYTES |= {"f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = (.+?) (" + "|".join(COLLECTIVES) + r")(-start)?\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{\s*$")
_WHILE = re.compile(r" while\(.*body=%([^,\s]+).*\"known_trip_count\":\{\"n\":\"(\d+)\"")


def _array_bytes(text: str) -> list[int]:
    """Bytes of every array type in an HLO type string, e.g. '(bf16[8,128]{1,0}, f32[])'."""
    arrays = _ARRAY.findall(text)
    return [
        _DTYPE_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in arrays if t in _DTYPE_BYTES
    ]


def collectives(hlo_text: str, chips: int) -> dict:
    """Count and result bytes per step of each collective in a compiled module's HLO text, and the bytes each chip
    puts on the wire for them (ring algorithms over all `chips`: the mesh has one axis). An op inside a while loop
    counts once per iteration where the compiler states the trip count; an async op counts at its -start, as its
    largest array (a start's tuple holds the operand and the result)."""
    parent, loops, ops, current = {}, {}, [], None  # ops: (computation, op, bytes) in the text's order
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header[1]
        elif loop := _WHILE.search(line):
            parent[loop[1]], loops[loop[1]] = current, int(loop[2])
        elif op := _OP.match(line):
            sizes = _array_bytes(op[1])
            ops.append((current, op[2], max(sizes, default=0) if op[3] else sum(sizes)))

    found = {op: {"count": 0, "bytes": 0} for op in COLLECTIVES}
    wire = 0.0
    for computation, name, size in ops:
        n = 1  # times the computation runs per step: the trip counts of the loops around it
        while computation in loops:
            n, computation = n * loops[computation], parent[computation]
        found[name]["count"] += n
        found[name]["bytes"] += n * size
        wire += n * size * _WIRE[name](chips) if chips > 1 else 0.0
    return {"ops": found, "wire_bytes_per_chip": wire}


def bytes_per_chip(tree, mesh, mode: str) -> int:
    """Bytes of one chip's shards of a pytree of arrays, sharded as the train state is (sharding.array_sharding)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = array_sharding(tuple(x.shape), mesh, mode).shard_shape(tuple(x.shape))
        total += math.prod(shard) * jnp.dtype(x.dtype).itemsize
    return total


def compiled_cost(compiled) -> tuple[dict, str]:
    """XLA's cost analysis of the compiled per-chip program (flops, bytes accessed) and where it came from."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older jax: one dict per program
        cost = cost[0] if cost else None
    if cost:
        return dict(cost), "compiled (XLA cost_analysis)"
    # A deviceless GPU compile returns no cost analysis: XLA's HloCostAnalysis counts the same compiled module
    # (a private jax API: without it the formula stands in).
    try:
        return hlo_module_cost_from_private_jax(compiled), "compiled (XLA HloCostAnalysis of the compiled module)"
    except (AttributeError, ImportError, IndexError, RuntimeError):
        return {}, "formula (the compiler gave no count)"


def hlo_module_cost_from_private_jax(compiled: jax.stages.Compiled) -> dict[str, float]:
    """XLA's HloCostAnalysis of a compiled program's first module (flops, bytes accessed, ...), counted by the
    host's CPU client. The CUDA plugin's deviceless compile (`--plan h100:8`) leaves `cost_analysis()` empty, and
    jax exposes HloCostAnalysis only privately; once it moves (ImportError, AttributeError; tests/test_plan_xla_cost.py
    names the jax version) the plan reports the FLOPs formula."""
    from jax._src.lib import xla_client  # imported here so that its loss costs only this count, not the plan

    module = compiled.runtime_executable().hlo_modules()[0]
    return dict(xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module))


def compile_or_refuse(traced: jax.stages.Traced, what: str, remedy: str) -> jax.stages.Compiled:
    """The traced program compiled; DoesNotFit, quoting the compiler, if it refuses for want of memory."""
    try:
        return traced.lower().compile()
    except jax.errors.JaxRuntimeError as error:
        # The TPU compiler refuses a program whose buffers exceed the chip's HBM and says by how much.
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        detail = str(error).splitlines()[0].removeprefix("RESOURCE_EXHAUSTED: ").rstrip(".")
        raise DoesNotFit(f"does not fit: {what}: XLA: {detail}; {remedy}") from None


def memory_per_chip(compiled: jax.stages.Compiled) -> dict[str, int]:
    """XLA's memory_analysis() of a compiled per-chip program, and its total: argument + output - alias (donated
    inputs the outputs reuse) + temp + generated code."""
    memory = compiled.memory_analysis()
    found = {
        "argument": memory.argument_size_in_bytes,
        "output": memory.output_size_in_bytes,
        "alias": memory.alias_size_in_bytes,
        "temp": memory.temp_size_in_bytes,
        "generated_code": memory.generated_code_size_in_bytes,
    }
    return found | {
        "total": found["argument"] + found["output"] - found["alias"] + found["temp"] + found["generated_code"]
    }


def gb(n: float) -> str:
    """Bytes as decimal gigabytes: 1.23 GB."""
    return f"{n / 1e9:.2f} GB"
