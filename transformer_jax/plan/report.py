"""`train.py --plan`: the loop's own train step (`compile_steps`) and validation's decoding, compiled for a TPU or
GPU slice on this CPU host inside `runtime.compiling_for(target)`, so that every choice made from the backend
follows the target; the searches over batch and mesh; the table or JSON. docs/plan.md describes the report.
Nothing runs: the times are roofline estimates (ROOFLINE); XLA's `optimal_seconds` came out negative here.
"""

from __future__ import annotations

import json
import time

import jax
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from transformer_jax import decoding, runtime
from transformer_jax.data.pipeline import batch_shapes
from transformer_jax.errors import ConfigError
from transformer_jax.evaluation.translate import (
    batch_shape,
    input_limit,
    output_cap,
    position_limit,
    validation_settings,
)
from transformer_jax.model import TransformerSpec
from transformer_jax.plan.accelerators import (
    COLLECTIVES,
    Chip,
    DoesNotFit,
    Topology,
    bytes_per_chip,
    collectives,
    compile_or_refuse,
    compiled_cost,
    gb,
    memory_per_chip,
    parse_topology,
)
from transformer_jax.sharding import MESH_MODES, array_sharding, make_mesh, replicated, tracing_mesh
from transformer_jax.training.loop import abstract_batch, check_batch_shapes
from transformer_jax.training.metrics import decode_step_flops, train_step_flops
from transformer_jax.training.step import abstract_train_state, compile_steps, eval_model

SEARCHES = ("", "batch", "mesh")

ROOFLINE = (
    "estimated step s = max(compiled FLOPs per chip / bf16 peak, compiled bytes accessed per chip / HBM bandwidth) "
    "+ collective bytes on the wire per chip (ring algorithms) / interconnect bandwidth; a lower bound with "
    "nothing overlapped but compute with memory traffic"
)

DECODE_ROOFLINE = (
    "estimated decoding step s = max(compiled FLOPs per chip / bf16 peak, compiled bytes accessed per chip / HBM "
    "bandwidth) + collective bytes on the wire per chip / interconnect bandwidth, for one step of the 'stage' "
    "program (XLA counts a while loop's body once); s per output token = step s / sentences in the batch"
)

PLACEMENT = {
    "data": "not sharded: parameters and sources replicated, each of the {chips} chips decodes all {rows} sentences "
    "(one chip's program, repeated)",
    "fsdp": "parameters sharded as train.mesh=fsdp places them, sources replicated: XLA's sharding propagation "
    "splits the rest over the {chips} chips",
}


def run(config: ml_collections.ConfigDict, topology_name: str, search: str = "") -> dict:
    """The plan of `config` on the slice (search "": as configured; "batch": the largest batch that fits; "mesh":
    data and fsdp side by side), each mesh's report with a "decode" section."""
    if search not in SEARCHES:
        raise ConfigError(f"--plan_search={search!r}: choose batch or mesh (or leave it out)")
    topology = parse_topology(topology_name)
    if search == "mesh":
        result = search_mesh(config, topology)
    else:
        result = (search_batch if search == "batch" else plan_train_step)(config, topology, config.train.mesh)
    for mode, report in meshes(result, config).items():
        report["decode"] = plan_decode(config, topology, mode)
    return result


def compile_train_step(
    config: ml_collections.ConfigDict, topology: Topology, mesh_mode: str, mesh: Mesh, shape: tuple[int, int, int]
):
    """The loop's train step compiled for the slice at one global batch shape; returns (compiled, abstract state)."""
    jax.clear_caches()  # a trace made for the host backend must not be reused for the target
    with runtime.compiling_for(topology.chip.platform), tracing_mesh(mesh):
        graphs, abstract = abstract_train_state(config)
        train = config.train
        train_step, _, _ = compile_steps(
            graphs, abstract, mesh, mesh_mode, label_smoothing=train.label_smoothing, accum_steps=train.grad_accum_steps
        )
        compiled = compile_or_refuse(
            train_step.trace(abstract, abstract_batch(*shape)),
            f"the train step (mesh={mesh_mode}, batch {list(shape)}) on {topology.name}",
            "lower the batch (--plan_search=batch finds the largest) or try train.mesh=fsdp",
        )
    return compiled, abstract


def plan_train_step(config: ml_collections.ConfigDict, topology: Topology, mesh_mode: str) -> dict:
    """The report of the train step compiled for the slice at data.batching's shape with the most FLOPs."""
    if mesh_mode not in MESH_MODES:
        raise ConfigError(f"config key train.mesh: unknown value {mesh_mode!r}; choose one of {list(MESH_MODES)}")
    chip = topology.chip
    mesh = make_mesh(list(topology.devices()))
    spec = TransformerSpec.from_config(config)
    shapes = batch_shapes(config.data, topology.hosts, check_batch_shapes(config, mesh))
    rows, s_len, t_len = max(shapes, key=lambda shape: (train_step_flops(spec, *shape), shape[2]))
    start = time.perf_counter()
    compiled, abstract = compile_train_step(config, topology, mesh_mode, mesh, (rows, s_len, t_len))
    compile_s = time.perf_counter() - start

    memory = memory_per_chip(compiled)
    formula = train_step_flops(spec, rows, s_len, t_len)
    cost, cost_source = compiled_cost(compiled)
    compiled_flops = cost.get("flops")
    comms = collectives(compiled.as_text(), topology.chips)

    flops_per_chip = compiled_flops if compiled_flops else formula / topology.chips
    times = _roofline(flops_per_chip, cost.get("bytes accessed", 0.0), comms["wire_bytes_per_chip"], chip)
    step_s = times["step_s"]
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
            "parameters": bytes_per_chip(nnx.filter_state(abstract["model"], nnx.Param), mesh, mesh_mode),
            "optimizer_state": bytes_per_chip(abstract["optimizer"], mesh, mesh_mode),
            "batch": sum(x.size * x.dtype.itemsize for x in abstract_batch(rows, s_len, t_len).values())
            // topology.chips,
        },
        "memory_analysis_per_chip": memory,
        "hbm_bytes_per_chip": chip.hbm_bytes,
        "fits": memory["total"] <= chip.hbm_bytes,
        "headroom_bytes": chip.hbm_bytes - memory["total"],
        "flops_per_step": {
            "compiled": compiled_flops * topology.chips if compiled_flops else None,
            "formula": formula,
            "compiled_over_formula": compiled_flops * topology.chips / formula if compiled_flops else None,
        },
        "collectives_per_step": comms["ops"],
        "estimate": {
            "roofline": ROOFLINE if compiled_flops else ROOFLINE.replace("compiled FLOPs", "formula FLOPs"),
            "flops_source": cost_source,
            **times,
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
    """The report of the largest batch that fits, with a "search" entry: doubling or halving from the config's, then
    bisecting to within `tolerance`, in steps of whole rows per device and micro-batch (for bucket, that many rows
    of data.max_len tokens). DoesNotFit if even one step does not fit."""
    key = "tokens_per_batch" if config.data.batching == "bucket" else "batch_size"
    multiple = check_batch_shapes(config, make_mesh(list(topology.devices())))
    unit = multiple * (config.data.max_len if key == "tokens_per_batch" else 1)
    tried = []
    best, low, high = None, 0, None  # largest fitting batch: its report and value; smallest that does not fit

    def attempt(value: int) -> bool:
        """Plans the batch `value` and narrows the bracket; whether it fits."""
        nonlocal best, low, high
        try:
            report = plan_train_step(with_batch(config, value), topology, mesh_mode)
        except DoesNotFit as error:
            tried.append({key: value, "fits": False, "compiler": str(error)})
            report = None
        else:
            total = report["memory_analysis_per_chip"]["total"]
            tried.append({key: value, "fits": report["fits"], "total_bytes": total})
        if report and report["fits"]:
            best, low = report, value
            return True
        high = value
        return False

    value = max(unit, config.data[key] // unit * unit)
    if attempt(value):
        while high is None and value < 64 * config.data[key]:
            value *= 2
            attempt(value)
    else:
        while best is None and value > unit:
            value = max(unit, value // 2 // unit * unit)
            attempt(value)
    if best is None:
        last = tried[-1]
        need = last.get("compiler") or f"needs {gb(last['total_bytes'])} per chip of {gb(topology.chip.hbm_bytes)}"
        raise DoesNotFit(f"does not fit: even data.{key}={unit}, the smallest batch on {topology.name}: {need}")
    while high is not None and high - low > max(unit, low * tolerance):
        value = (low + high) // 2 // unit * unit
        if value <= low:
            break
        attempt(value)
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


def _roofline(flops_per_chip: float, bytes_accessed: float, wire_bytes: float, chip: Chip) -> dict[str, float]:
    """ROOFLINE's times of one step from per-chip counts."""
    compute_s = flops_per_chip / chip.peak_bf16_flops
    hbm_s = bytes_accessed / chip.hbm_bytes_per_s
    collective_s = wire_bytes / chip.interconnect_bytes_per_s
    return {
        "compute_s": compute_s,
        "hbm_s": hbm_s,
        "collective_s": collective_s,
        "step_s": max(compute_s, hbm_s) + collective_s,
    }


def plan_decode(config: ml_collections.ConfigDict, topology: Topology, mesh_mode: str) -> dict:
    """The report's "decode" section (docs/plan.md): the Searcher's own programs (`peak_programs`) for validation's
    batch, longest source and largest cache stage, compiled for the slice, so that a run whose validation would not
    fit is caught too. Parameters sit as the train state places them, host inputs are replicated (as jit places
    validation's numpy sources)."""
    settings = validation_settings(config)
    search, chip = settings.search, topology.chip
    mesh = make_mesh(list(topology.devices()))
    rows = decoding.batch_rows(config.train.bleu_sentences, settings.batch_size)
    compile_s: dict[str, float] = {}
    jax.clear_caches()  # a trace made for the host backend must not be reused for the target
    with runtime.compiling_for(chip.platform), tracing_mesh(mesh):
        graphs, abstract = abstract_train_state(config)
        place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=array_sharding(x.shape, mesh, mesh_mode))
        model = eval_model(graphs, jax.tree.map(place, abstract))
        limit = position_limit(model.spec)
        longest = input_limit(settings.max_input_len, limit)
        src_len, max_steps = batch_shape(longest, longest, settings.max_extra_len, output_cap(settings.max_len, limit))
        what = (
            f"validation's decoding (beam {search.beam_size}, {rows} sentences x {src_len} source tokens, "
            f"{max_steps} output slots, mesh={mesh_mode}) on {topology.name}"
        )

        def compile_one(name: str, traced: jax.stages.Traced) -> jax.stages.Compiled:
            start = time.perf_counter()
            compiled = compile_or_refuse(
                traced, f"{what}, program {name}", "lower eval.batch_size or data.eval_max_len"
            )
            compile_s[name] = time.perf_counter() - start
            return compiled

        searcher = decoding.Searcher(model)
        programs = searcher.peak_programs(
            rows, src_len, max_steps, search, host=replicated(mesh), compile_one=compile_one
        )
    memory = {name: memory_per_chip(compiled) for name, compiled in programs.items()}
    estimate = _step_estimate(programs.get("stage"), topology, rows)
    peak = max(memory, key=lambda name: memory[name]["total"])
    # The train state stays in HBM while validation decodes; its parameters are already the programs' arguments.
    optimizer = bytes_per_chip(abstract["optimizer"], mesh, mesh_mode)
    resident = optimizer if config.train.bleu_every else 0
    needed = memory[peak]["total"] + resident
    return {
        "beam_size": search.beam_size,
        "alpha": search.alpha,
        "sentences": rows,
        "source_len": src_len,
        "output_slots": max_steps,
        "cache_stages": decoding.cache_stages(max_steps),
        "search": "refilling" if searcher.refills(rows) else "one jitted call",
        "placement": PLACEMENT[mesh_mode].format(rows=rows, chips=topology.chips),
        "compile_s": compile_s,
        "memory_analysis_per_chip": memory,
        "peak_program": peak,
        "optimizer_state_bytes": optimizer,
        "train_state_resident_bytes": resident,
        "total_bytes": needed,
        "hbm_bytes_per_chip": chip.hbm_bytes,
        "fits": needed <= chip.hbm_bytes,
        "headroom_bytes": chip.hbm_bytes - needed,
        "flops_per_step": {
            "compiled_per_chip": estimate.pop("flops_per_step_per_chip"),
            # every chip decodes every row (mesh data); with fsdp XLA may split them, so compare per chip with care
            "formula": decode_step_flops(model.spec, rows * search.beam_size, src_len, max_steps),
        },
        "estimate": estimate,
    }


def _step_estimate(stage: jax.stages.Compiled | None, topology: Topology, rows: int) -> dict:
    """DECODE_ROOFLINE for one decoding step; None values for a search in one jitted call (its count mixes the
    encoder with every cache stage's loop)."""
    if stage is None:
        keys = ("flops_per_step_per_chip", "compute_s", "hbm_s", "collective_s", "step_s", "s_per_output_token")
        return {"roofline": DECODE_ROOFLINE, "flops_source": None} | dict.fromkeys(keys)
    cost, source = compiled_cost(stage)
    wire = collectives(stage.as_text(), topology.chips)["wire_bytes_per_chip"]
    times = _roofline(cost.get("flops", 0.0), cost.get("bytes accessed", 0.0), wire, topology.chip)
    return {
        "roofline": DECODE_ROOFLINE,
        "flops_source": source,
        "flops_per_step_per_chip": cost.get("flops"),
        **times,
        "s_per_output_token": times["step_s"] / rows,
    }


def meshes(result: dict, config: ml_collections.ConfigDict) -> dict[str, dict]:
    """The train-step reports of a result of `run`, by mesh."""
    return result["meshes"] if "meshes" in result else {config.train.mesh: result}


def render(result: dict, config: ml_collections.ConfigDict, as_json: bool = False) -> str:
    """A result of `run` as JSON, or as the table with the search's conclusion."""
    if as_json:
        return json.dumps(result, indent=2)
    reports = meshes(result, config)
    lines = [format_reports(reports)] if reports else []
    if "search" in result:
        found = result["search"]
        lines.append(
            f"largest batch that fits: {found['key']}={found['largest_that_fits']} ({len(found['tried'])} compiles)"
        )
    if "meshes" in result:
        lines += [f"mesh {mode}: {message}" for mode, message in result["refused_by_compiler"].items()]
        lines.append(f"chosen mesh: {result['chosen'] or 'neither fits'}")
    return "\n".join(lines)


def check_fits(result: dict, config: ml_collections.ConfigDict) -> None:
    """DoesNotFit, one line saying what to lower, unless a planned train step fits and so does its decoding."""
    reports = meshes(result, config)
    if not any(r["fits"] for r in reports.values()):
        if not reports:  # both meshes refused by the compiler
            raise DoesNotFit(" | ".join(result["refused_by_compiler"].values()))
        report = min(reports.values(), key=lambda r: r["memory_analysis_per_chip"]["total"])
        raise DoesNotFit(
            f"does not fit: the train step (mesh={report['step']['mesh']}, batch "
            f"{report['step']['batch_rows_src_tgt']}) needs {gb(report['memory_analysis_per_chip']['total'])} per "
            f"chip on {report['topology']['name']}, {gb(-report['headroom_bytes'])} more than the chip's "
            f"{gb(report['hbm_bytes_per_chip'])}; lower the batch (--plan_search=batch finds the largest) or try "
            "train.mesh=fsdp"
        )
    trainable = [r for r in reports.values() if r["fits"] and "decode" in r]
    if trainable and not any(r["decode"]["fits"] for r in trainable):
        worst = min(trainable, key=lambda r: r["decode"]["total_bytes"])
        decode, resident = worst["decode"], worst["decode"]["train_state_resident_bytes"]
        raise DoesNotFit(
            f"does not fit: validation's decoding (beam {decode['beam_size']}, {decode['sentences']} sentences x "
            f"{decode['source_len']} source tokens, {decode['output_slots']} output slots) needs "
            f"{gb(decode['total_bytes'])} per chip on {worst['topology']['name']} (program {decode['peak_program']} "
            f"{gb(decode['total_bytes'] - resident)} + the train state's optimizer state {gb(resident)}), "
            f"{gb(-decode['headroom_bytes'])} more than the chip's {gb(decode['hbm_bytes_per_chip'])}; "
            "lower eval.batch_size or data.eval_max_len"
        )


def _size(n: float) -> str:
    """Bytes in decimal units: 1.23 GB, 456 MB, 7.8 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _row(label: str, *values) -> str:
    return f"  {label:<34}" + "".join(f"{v:>22}" for v in values)


def _or_na(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def format_reports(reports: dict[str, dict]) -> str:
    """A readable table of one or more reports (columns), every time and rate marked as an estimate."""
    first = next(iter(reports.values()))
    top = first["topology"]
    cols = list(reports.values())
    get = lambda f: [f(r) for r in cols]
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
        _row("compiled (XLA)", *get(lambda r: _or_na(r["flops_per_step"]["compiled"], "{:.3e}"))),
        _row("formula (training/metrics.py)", *get(lambda r: _or_na(r["flops_per_step"]["formula"], "{:.3e}"))),
        _row("compiled / formula", *get(lambda r: _or_na(r["flops_per_step"]["compiled_over_formula"], "{:.3f}"))),
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
    first = cols[0]
    estimate = lambda key, fmt: get(lambda d: _or_na(d["estimate"][key], fmt))
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
        _row(
            "compiled FLOPs per step per chip",
            *get(lambda d: _or_na(d["flops_per_step"]["compiled_per_chip"], "{:.3e}")),
        ),
        _row("formula (training/metrics.py)", *get(lambda d: _or_na(d["flops_per_step"]["formula"], "{:.3e}"))),
        "ESTIMATES (nothing was run): " + first["estimate"]["roofline"],
        _row("estimated decoding step s", *estimate("step_s", "{:.3g}")),
        _row("estimated s per output token", *estimate("s_per_output_token", "{:.3g}")),
        _row("compile s (this host)", *get(lambda d: f"{sum(d['compile_s'].values()):.1f}")),
    ]
    return lines
