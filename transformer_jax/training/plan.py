"""`train.py --plan TOPOLOGY`: compile the step training runs for a TPU or GPU slice on this (CPU) host, with no
data, and report what it needs per chip, whether it fits, its collectives and an estimated cost.

The program compiled is the loop's own: `abstract_train_state` and `compile_steps` (the same jitted function,
shardings, donation, micro-batching, dtype and attention implementation), for the batch shape of
`data.batching` with the most FLOPs (`training/flops.py`), inside `platform.compiling_for(target)` so that every
choice made from the backend follows the target. Nothing runs: the report's times are estimates from a roofline
(ROOFLINE), never measurements, and XLA's `optimal_seconds` is not used (it came out negative for this program).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from transformer_jax import platform
from transformer_jax.accelerators import Topology, parse_topology
from transformer_jax.data.batching import BATCH_KEYS
from transformer_jax.data.pipeline import batch_shapes
from transformer_jax.errors import ConfigError
from transformer_jax.model import TransformerSpec
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
    # A deviceless GPU compile returns no cost analysis; XLA's HloCostAnalysis, run by the host's CPU client over
    # the compiled GPU module, counts the same program (a private jax API: without it the formula stands in).
    try:
        from jax._src.lib import xla_client  # private: imported only where it is used, so its loss is caught

        module = compiled.runtime_executable().hlo_modules()[0]
        cost = xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
        return dict(cost), "compiled (XLA HloCostAnalysis of the compiled module)"
    except (AttributeError, ImportError, IndexError, RuntimeError):
        return {}, "formula (the compiler gave no count)"


def compile_train_step(
    config: ml_collections.ConfigDict, topology: Topology, mesh_mode: str, mesh: Mesh, shape: tuple[int, int, int]
):
    """The loop's train step compiled for the slice at one global batch shape; returns (compiled, abstract state)."""
    rows, s_len, t_len = shape
    jax.clear_caches()  # a trace made for the host backend must not be reused for the target
    with platform.compiling_for(topology.chip.platform), tracing_mesh(mesh):
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
        need = last.get("compiler") or f"needs {_gb(last['total_bytes'])} per chip of {_gb(topology.chip.hbm_bytes)}"
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


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _size(n: float) -> str:
    """Bytes in decimal units: 1.23 GB, 456 MB, 7.8 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def does_not_fit_line(report: dict) -> str:
    total = report["memory_analysis_per_chip"]["total"]
    return (
        f"does not fit: the train step (mesh={report['step']['mesh']}, batch {report['step']['batch_rows_src_tgt']}) "
        f"needs {_gb(total)} per chip on {report['topology']['name']}, {_gb(-report['headroom_bytes'])} more than "
        f"the chip's {_gb(report['hbm_bytes_per_chip'])}; lower the batch (--plan_search=batch finds the largest) "
        "or try train.mesh=fsdp"
    )


def decode_does_not_fit_line(decode: dict, topology_name: str) -> str:
    """One line for a plan whose validation decoding (a report's "decode" section) does not fit."""
    resident = decode["train_state_resident_bytes"]
    return (
        f"does not fit: validation's decoding (beam {decode['beam_size']}, {decode['sentences']} sentences x "
        f"{decode['source_len']} source tokens, {decode['output_slots']} output slots) needs "
        f"{_gb(decode['total_bytes'])} per chip on {topology_name} (program {decode['peak_program']} "
        f"{_gb(decode['total_bytes'] - resident)} + the train state's optimizer state {_gb(resident)}), "
        f"{_gb(-decode['headroom_bytes'])} more than the chip's {_gb(decode['hbm_bytes_per_chip'])}; "
        "lower eval.batch_size or data.eval_max_len"
    )


def _row(label: str, *values) -> str:
    return f"  {label:<34}" + "".join(f"{v:>22}" for v in values)


def format_reports(reports: dict[str, dict]) -> str:
    """A readable table of one or more reports (columns), every time and rate marked as an estimate."""
    first = next(iter(reports.values()))
    top = first["topology"]
    cols = list(reports.values())
    get = lambda f: [f(r) for r in cols]
    flops_ = lambda v: "n/a" if v is None else f"{v:.3e}"
    lines = [
        f"plan for {top['name']}: {top['chips']} x {top['device_kind']} on {top['hosts']} host(s); nothing was run",
        _row("", *reports),
        _row("mesh", *get(lambda r: r["step"]["mesh"])),
        _row("batch rows x S x T", *get(lambda r: "x".join(map(str, r["step"]["batch_rows_src_tgt"])))),
        _row(
            "dtype / attention / micro-batches",
            *get(lambda r: f"{r['step']['dtype']}/{r['step']['attention_impl']}/{r['step']['grad_accum_steps']}"),
        ),
        "per chip:",
    ]
    for key, label in (("parameters", "parameters"), ("optimizer_state", "optimizer state"), ("batch", "batch")):
        lines.append(_row(label, *get(lambda r, k=key: _size(r["per_chip_bytes"][k]))))
    for key in ("argument", "output", "alias", "temp", "generated_code", "total"):
        lines.append(_row(f"compiled {key}", *get(lambda r, k=key: _size(r["memory_analysis_per_chip"][k]))))
    lines += [
        _row("HBM", *get(lambda r: _size(r["hbm_bytes_per_chip"]))),
        _row("fits (headroom)", *get(lambda r: f"{'yes' if r['fits'] else 'NO'} ({_size(r['headroom_bytes'])})")),
        "FLOPs per step (all chips):",
        _row("compiled (XLA)", *get(lambda r: flops_(r["flops_per_step"]["compiled"]))),
        _row("formula (training/flops.py)", *get(lambda r: flops_(r["flops_per_step"]["formula"]))),
        _row(
            "compiled / formula",
            *get(
                lambda r: (
                    "n/a"
                    if r["flops_per_step"]["compiled_over_formula"] is None
                    else f"{r['flops_per_step']['compiled_over_formula']:.3f}"
                )
            ),
        ),
        "collectives per step in the compiled HLO (count, result bytes):",
    ]
    for op in COLLECTIVES:
        count = lambda r, o=op: (
            f"{r['collectives_per_step'][o]['count']}, {_size(r['collectives_per_step'][o]['bytes'])}"
        )
        lines.append(_row(op, *get(count)))
    lines.append("ESTIMATES (nothing was run): " + first["estimate"]["roofline"])
    for key, label, fmt in (
        ("compute_s", "estimated compute s", "{:.3g}"),
        ("hbm_s", "estimated HBM traffic s", "{:.3g}"),
        ("collective_s", "estimated collective s", "{:.3g}"),
        ("step_s", "estimated step s", "{:.3g}"),
        ("mfu", "estimated MFU", "{:.2f}"),
        ("target_token_slots_per_s", "estimated target tokens/s", "{:,.0f}"),
        ("hours", "estimated hours for num_steps", "{:.3g}"),
    ):
        lines.append(_row(label, *get(lambda r, k=key, f=fmt: f.format(r["estimate"][k]))))
    lines.append(_row("train.num_steps", *get(lambda r: r["estimate"]["num_steps"])))
    lines.append(_row("compile s (this host)", *get(lambda r: f"{r['compile_s']:.1f}")))
    if all("decode" in r for r in cols):
        lines += _decode_rows([r["decode"] for r in cols])
    return "\n".join(lines)


def _decode_rows(cols: list[dict]) -> list[str]:
    """The table's rows of the reports' "decode" sections (validation BLEU's beam search)."""
    get = lambda f: [f(d) for d in cols]
    flops_ = lambda v: "n/a" if v is None else f"{v:.3e}"
    first = cols[0]
    estimate = lambda key, fmt: get(lambda d: "n/a" if d["estimate"][key] is None else fmt.format(d["estimate"][key]))
    lines = [
        f"validation decoding (beam {first['beam_size']}, {first['sentences']} sentences x {first['source_len']} "
        f"source tokens, {first['output_slots']} output slots, {first['search']} search), per chip:",
        *[f"  {d['placement']}" for d in cols[:1]],
        _row("peak program", *get(lambda d: d["peak_program"])),
    ]
    for key in ("argument", "output", "alias", "temp", "total"):
        peak = lambda d, k=key: _size(d["memory_analysis_per_chip"][d["peak_program"]][k])
        lines.append(_row(f"compiled {key}", *get(peak)))
    lines += [
        _row("+ optimizer state (bleu_every > 0)", *get(lambda d: _size(d["train_state_resident_bytes"]))),
        _row("total", *get(lambda d: _size(d["total_bytes"]))),
        _row("fits (headroom)", *get(lambda d: f"{'yes' if d['fits'] else 'NO'} ({_size(d['headroom_bytes'])})")),
        _row("compiled FLOPs per step per chip", *get(lambda d: flops_(d["flops_per_step"]["compiled_per_chip"]))),
        _row("formula (training/flops.py)", *get(lambda d: flops_(d["flops_per_step"]["formula"]))),
        "ESTIMATES (nothing was run): " + first["estimate"]["roofline"],
        _row("estimated decoding step s", *estimate("step_s", "{:.3g}")),
        _row("estimated s per output token", *estimate("s_per_output_token", "{:.3g}")),
        _row("compile s (this host)", *get(lambda d: f"{sum(d['compile_s'].values()):.1f}")),
    ]
    return lines


SEARCHES = ("", "batch", "mesh")


# (config, topology, mesh mode) -> the report's "decode" section: validation's decoding compiled for the slice.
# Built outside training (train.py passes evaluation.decode_plan.plan_decode), so that training never imports it.
DecodePlanner = Callable[[ml_collections.ConfigDict, Topology, str], dict]


def run(
    config: ml_collections.ConfigDict,
    topology_name: str,
    search: str,
    as_json: bool,
    decode: DecodePlanner | None = None,
) -> dict:
    """train.py --plan: the report (or search) printed as a table or JSON; DoesNotFit if nothing planned fits.

    With `decode`, each mesh's report has a "decode" section, and a plan whose decoding does not fit on any mesh
    whose train step fits fails too."""
    if search not in SEARCHES:
        raise ConfigError(f"--plan_search={search!r}: choose batch or mesh (or leave it out)")
    topology = parse_topology(topology_name)
    # The host only compiles: its backend is the CPU's even where libtpu or the CUDA plugin is installed.
    jax.config.update("jax_platforms", "cpu")
    if search == "mesh":
        result = search_mesh(config, topology)
        reports = result["meshes"]
    else:
        report = (search_batch if search == "batch" else plan_train_step)(config, topology, config.train.mesh)
        result, reports = report, {config.train.mesh: report}
    if decode is not None:
        for mode, report in reports.items():
            report["decode"] = decode(config, topology, mode)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        if reports:
            print(format_reports(reports))
        if search == "batch":
            found = result["search"]
            print(
                f"largest batch that fits: {found['key']}={found['largest_that_fits']} ({len(found['tried'])} compiles)"
            )
        if search == "mesh":
            for mode, message in result["refused_by_compiler"].items():
                print(f"mesh {mode}: {message}")
            print(f"chosen mesh: {result['chosen'] or 'neither fits'}")
    if not any(r["fits"] for r in reports.values()):
        if not reports:  # both meshes refused by the compiler
            raise DoesNotFit(" | ".join(result["refused_by_compiler"].values()))
        raise DoesNotFit(does_not_fit_line(min(reports.values(), key=lambda r: r["memory_analysis_per_chip"]["total"])))
    trainable = [r["decode"] for r in reports.values() if r["fits"] and "decode" in r]
    if trainable and not any(d["fits"] for d in trainable):
        raise DoesNotFit(decode_does_not_fit_line(min(trainable, key=lambda d: d["total_bytes"]), topology.name))
    return result
