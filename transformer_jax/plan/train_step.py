"""The train step of `train.py --plan TOPOLOGY` compiled for a TPU or GPU slice on this (CPU) host, with no data:
what it needs per chip, whether it fits, its collectives and an estimated cost; and the searches over batch and mesh.

The program compiled is the loop's own: `abstract_train_state` and `compile_steps` (the same jitted function,
shardings, donation, micro-batching, dtype and attention implementation), for the batch shape of
`data.batching` with the most FLOPs (`training/flops.py`), inside `runtime.compiling_for(target)` so that every
choice made from the backend follows the target. Nothing runs: the report's times are estimates from a roofline
(ROOFLINE), never measurements, and XLA's `optimal_seconds` is not used (it came out negative for this program).

hlo_module_cost_from_private_jax holds the one use of a private jax API in transformer_jax (its docstring says
why); tests/test_layering.py allows it there and nowhere else.
"""

from __future__ import annotations

import math
import re
import time

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from transformer_jax import runtime
from transformer_jax.data.batching import BATCH_KEYS
from transformer_jax.data.pipeline import batch_shapes
from transformer_jax.errors import ConfigError
from transformer_jax.model import TransformerSpec
from transformer_jax.plan.accelerators import Topology
from transformer_jax.sharding import MESH_MODES, array_sharding, make_mesh, tracing_mesh
from transformer_jax.training import flops
from transformer_jax.training.loop import check_batch_shapes
from transformer_jax.training.state import abstract_train_state
from transformer_jax.training.step import compile_steps

ROOFLINE = (
    "estimated step s = max(compiled FLOPs per chip / bf16 peak, compiled bytes accessed per chip / HBM bandwidth) "
    "+ collective bytes on the wire per chip (ring algorithms) / interconnect bandwidth; a lower bound with "
    "nothing overlapped but compute with memory traffic"
)
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


class DoesNotFit(ConfigError):
    """The planned step needs more memory per chip than the chip has."""


def _array_bytes(text: str) -> list[int]:
    """Bytes of every array type in an HLO type string, e.g. '(bf16[8,128]{1,0}, f32[])'."""
    sizes = []
    for dtype, dims in _ARRAY.findall(text):
        if dtype in _DTYPE_BYTES:
            sizes.append(_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d))
    return sizes


def collectives(hlo_text: str, chips: int) -> dict:
    """Count and result bytes per step of each collective in a compiled module's HLO text, and the bytes each chip
    puts on the wire for them (ring algorithms over all `chips`: the mesh has one axis).

    An op inside a while loop counts once per iteration where the compiler states the trip count. An async op is
    counted at its -start; its bytes are its largest array (a start's tuple holds the operand and the result).
    """
    lines = hlo_text.splitlines()
    parent, loops, current = {}, {}, None
    for line in lines:
        header = _COMPUTATION.match(line)
        if header:
            current = header[1]
            continue
        loop = _WHILE.search(line)
        if loop:
            parent[loop[1]], loops[loop[1]] = current, int(loop[2])

    def repeats(computation: str | None) -> int:
        n = 1
        while computation in loops:
            n, computation = n * loops[computation], parent[computation]
        return n

    found = {op: {"count": 0, "bytes": 0} for op in COLLECTIVES}
    wire, current = 0.0, None
    for line in lines:
        header = _COMPUTATION.match(line)
        if header:
            current = header[1]
            continue
        op = _OP.match(line)
        if not op:
            continue
        sizes = _array_bytes(op[1])
        size = max(sizes, default=0) if op[3] else sum(sizes)
        n = repeats(current)
        found[op[2]]["count"] += n
        found[op[2]]["bytes"] += n * size
        wire += n * size * _WIRE[op[2]](chips) if chips > 1 else 0.0
    return {"ops": found, "wire_bytes_per_chip": wire}


def bytes_per_chip(tree, mesh, mode: str) -> int:
    """Bytes of one chip's shards of a pytree of arrays, sharded as the train state is (sharding.array_sharding)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = array_sharding(tuple(x.shape), mesh, mode).shard_shape(tuple(x.shape))
        total += math.prod(shard) * jnp.dtype(x.dtype).itemsize
    return total


def planned_shape(config: ml_collections.ConfigDict, topology: Topology, mesh) -> tuple[int, int, int]:
    """The global batch shape (rows, S, T) with the most FLOPs among those data.batching produces on this slice."""
    shapes = batch_shapes(config.data, topology.hosts, check_batch_shapes(config, mesh))
    spec = TransformerSpec.from_config(config)
    return max(shapes, key=lambda shape: (flops.train_step_flops(spec, *shape), shape[2]))


def _batch_shape(key: str, rows: int, s_len: int, t_len: int) -> tuple[int, int]:
    return (rows, s_len if key.startswith("src") else t_len)


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
    host's CPU client; ImportError or AttributeError when this jax no longer has the private entry point. The one
    use of a private jax API in transformer_jax, kept to this function.

    A GPU program compiled on a host without a GPU (`train.py --plan h100:8`) returns no `cost_analysis()`: the
    CUDA plugin's deviceless compile leaves it empty. XLA's HloCostAnalysis, run by the host's CPU client over the
    compiled module, counts the same program, and jax exposes it only as
    `jax._src.lib.xla_client._xla.hlo_module_cost_analysis`: there is no public API for it. Without it the plan
    reports the FLOPs formula instead (compiled_cost); tests/test_plan_xla_cost.py fails, naming the jax version,
    when jax moves or removes it.
    """
    from jax._src.lib import xla_client  # imported here so that its loss costs only this count, not the plan

    module = compiled.runtime_executable().hlo_modules()[0]
    return dict(xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module))


def compile_train_step(
    config: ml_collections.ConfigDict, topology: Topology, mesh_mode: str, mesh: Mesh, shape: tuple[int, int, int]
):
    """The loop's train step compiled for the slice at one global batch shape; returns (compiled, abstract state)."""
    rows, s_len, t_len = shape
    jax.clear_caches()  # a trace made for the host backend must not be reused for the target
    with runtime.compiling_for(topology.chip.platform), tracing_mesh(mesh):
        graphs, abstract = abstract_train_state(config)
        train_step, _, _ = compile_steps(
            graphs,
            abstract,
            mesh,
            mesh_mode,
            label_smoothing=config.train.label_smoothing,
            accum_steps=config.train.grad_accum_steps,
        )
        batch = {k: jax.ShapeDtypeStruct(_batch_shape(k, rows, s_len, t_len), jnp.int32) for k in BATCH_KEYS}
        compiled = compile_or_refuse(
            train_step.trace(abstract, batch),
            f"the train step (mesh={mesh_mode}, batch {[rows, s_len, t_len]}) on {topology.name}",
            "lower the batch (--plan_search=batch finds the largest) or try train.mesh=fsdp",
        )
    return compiled, abstract


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


def plan_train_step(config: ml_collections.ConfigDict, topology: Topology, mesh_mode: str) -> dict:
    """Compiles the train step for the slice and returns the report (see the module docstring)."""
    if mesh_mode not in MESH_MODES:
        raise ConfigError(f"config key train.mesh: unknown value {mesh_mode!r}; choose one of {list(MESH_MODES)}")
    chip = topology.chip
    mesh = make_mesh(list(topology.devices()))
    rows, s_len, t_len = planned_shape(config, topology, mesh)
    start = time.perf_counter()
    compiled, abstract = compile_train_step(config, topology, mesh_mode, mesh, (rows, s_len, t_len))
    compile_s = time.perf_counter() - start

    memory = memory_per_chip(compiled)
    used = memory["total"]
    params = nnx.filter_state(abstract["model"], nnx.Param)
    spec = TransformerSpec.from_config(config)
    formula = flops.train_step_flops(spec, rows, s_len, t_len)
    cost, cost_source = compiled_cost(compiled)
    compiled_flops = cost.get("flops")
    comms = collectives(compiled.as_text(), topology.chips)

    flops_per_chip = compiled_flops if compiled_flops else formula / topology.chips
    compute_s = flops_per_chip / chip.peak_bf16_flops
    memory_s = cost.get("bytes accessed", 0.0) / chip.hbm_bytes_per_s
    collective_s = comms["wire_bytes_per_chip"] / chip.interconnect_bytes_per_s
    step_s = max(compute_s, memory_s) + collective_s
    return {
        "topology": {
            "name": topology.name,
            "chip": chip.name,
            "chips": topology.chips,
            "hosts": topology.hosts,
            "device_kind": topology.devices()[0].device_kind,
        },
        "step": {
            "mesh": mesh_mode,
            "dtype": config.model.dtype,
            "attention_impl": config.attention.impl,
            "grad_accum_steps": config.train.grad_accum_steps,
            "batch_rows_src_tgt": [rows, s_len, t_len],
            "token_slots_per_side": rows * t_len,
        },
        "compile_s": compile_s,
        "per_chip_bytes": {
            "parameters": bytes_per_chip(params, mesh, mesh_mode),
            "optimizer_state": bytes_per_chip(abstract["optimizer"], mesh, mesh_mode),
            "batch": sum(math.prod(_batch_shape(k, rows, s_len, t_len)) * 4 for k in BATCH_KEYS) // topology.chips,
        },
        "memory_analysis_per_chip": memory,
        "hbm_bytes_per_chip": chip.hbm_bytes,
        "fits": used <= chip.hbm_bytes,
        "headroom_bytes": chip.hbm_bytes - used,
        "flops_per_step": {
            "compiled": compiled_flops * topology.chips if compiled_flops else None,
            "formula": formula,
            "compiled_over_formula": compiled_flops * topology.chips / formula if compiled_flops else None,
        },
        "collectives_per_step": comms["ops"],
        "estimate": {
            "roofline": ROOFLINE if compiled_flops else ROOFLINE.replace("compiled FLOPs", "formula FLOPs"),
            "flops_source": cost_source,
            "compute_s": compute_s,
            "hbm_s": memory_s,
            "collective_s": collective_s,
            "step_s": step_s,
            "mfu": formula / topology.chips / chip.peak_bf16_flops / step_s,
            "target_token_slots_per_s": rows * t_len / step_s,
            "num_steps": config.train.num_steps,
            "hours": step_s * config.train.num_steps / 3600,
        },
    }


def with_batch(config: ml_collections.ConfigDict, value: int) -> ml_collections.ConfigDict:
    """The config with its batch (data.batch_size rows, or data.tokens_per_batch for bucket) set to value."""
    config = config.copy_and_resolve_references()
    key = "tokens_per_batch" if config.data.batching == "bucket" else "batch_size"
    config.data[key] = value
    return config


def search_batch(
    config: ml_collections.ConfigDict, topology: Topology, mesh_mode: str, tolerance: float = 1 / 16
) -> dict:
    """The largest batch that fits, by doubling or halving from the config's then bisecting, over compiles.

    Steps are whole rows per device (and micro-batch); for bucket, data.tokens_per_batch moves in steps of that many
    rows of data.max_len tokens. Stops when the bracket is within `tolerance` of the batch. Returns the report of
    the largest batch that fits with a "search" entry; DoesNotFit if even one step does not.
    """
    key = "tokens_per_batch" if config.data.batching == "bucket" else "batch_size"
    multiple = check_batch_shapes(config, make_mesh(list(topology.devices())))
    unit = multiple * (config.data.max_len if key == "tokens_per_batch" else 1)
    tried = []

    def attempt(value: int) -> dict | None:
        """The report if the batch fits, else None."""
        try:
            report = plan_train_step(with_batch(config, value), topology, mesh_mode)
        except DoesNotFit as error:
            tried.append({key: value, "fits": False, "compiler": str(error)})
            return None
        tried.append({key: value, "fits": report["fits"], "total_bytes": report["memory_analysis_per_chip"]["total"]})
        return report if report["fits"] else None

    value = max(unit, config.data[key] // unit * unit)
    best, low, high = None, 0, None
    report = attempt(value)
    if report:
        best, low = report, value
        while high is None and value < 64 * config.data[key]:
            value *= 2
            report = attempt(value)
            best, low, high = (report, value, high) if report else (best, low, value)
    else:
        high = value
        while best is None and value > unit:
            value = max(unit, value // 2 // unit * unit)
            report = attempt(value)
            best, low, high = (report, value, high) if report else (best, low, value)
    if best is None:
        last = tried[-1]
        need = last.get("compiler") or f"needs {gb(last['total_bytes'])} per chip of {gb(topology.chip.hbm_bytes)}"
        raise DoesNotFit(f"does not fit: even data.{key}={unit}, the smallest batch on {topology.name}: {need}")
    while high is not None and high - low > max(unit, low * tolerance):
        value = (low + high) // 2 // unit * unit
        if value <= low:
            break
        report = attempt(value)
        best, low, high = (report, value, high) if report else (best, low, value)
    best["search"] = {"key": f"data.{key}", "largest_that_fits": low, "first_that_does_not": high, "tried": tried}
    return best


def search_mesh(config: ml_collections.ConfigDict, topology: Topology) -> dict:
    """Both meshes side by side; `chosen` is the one that fits with the smaller estimated step time."""
    reports, refused = {}, {}
    for mode in MESH_MODES:
        try:
            reports[mode] = plan_train_step(config, topology, mode)
        except DoesNotFit as error:  # the compiler refused it
            refused[mode] = str(error)
    fitting = [mode for mode in reports if reports[mode]["fits"]]
    chosen = min(fitting, key=lambda mode: reports[mode]["estimate"]["step_s"]) if fitting else None
    return {"meshes": reports, "refused_by_compiler": refused, "chosen": chosen}


def gb(n: float) -> str:
    """Bytes as decimal gigabytes: 1.23 GB."""
    return f"{n / 1e9:.2f} GB"
