"""train.py --plan's decoding section: validation BLEU's beam search compiled for the slice the train step is
planned for, at its peak of memory, so that a run that trains but whose validation would not fit is caught too.

The programs are the Searcher's own (`decoding.Searcher.peak_programs`): the batch of `validation.bleu_evaluator`
(train.bleu_sentences sentences, eval.batch_size at a time: `refill.batch_rows`), its longest source
(data.eval_max_len) and its largest cache stage, with the search `validation.decoding_settings` gives translate().
The parameters sit as the train state places them (`sharding.array_sharding` for train.mesh) and the host's inputs
are replicated, as jit places the numpy sources validation passes: with mesh `data` nothing is sharded, every chip
decodes the whole batch and the numbers are one chip's; with `fsdp` XLA's sharding propagation splits the work
around the sharded parameters. During validation the train state stays in HBM, so with train.bleu_every > 0 the
fit counts its optimizer state beside the decoding program (without validation BLEU the plan is evaluate.py's,
which holds the parameters only). Nothing runs: the times are estimates from DECODE_ROOFLINE.
"""

from __future__ import annotations

import time

import jax
import ml_collections

from transformer_jax import decoding
from transformer_jax.decoding.refill import batch_rows
from transformer_jax.evaluation.translate import batch_shape, input_limit, output_cap, position_limit
from transformer_jax.evaluation.validation import decoding_settings
from transformer_jax.plan.accelerators import Topology
from transformer_jax.plan.train_step import (
    bytes_per_chip,
    collectives,
    compile_or_refuse,
    compiled_cost,
    memory_per_chip,
)
from transformer_jax.runtime import platform
from transformer_jax.sharding import array_sharding, make_mesh, replicated, tracing_mesh
from transformer_jax.training import flops
from transformer_jax.training.state import abstract_train_state, eval_model

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


def plan_decode(config: ml_collections.ConfigDict, topology: Topology, mesh_mode: str) -> dict:
    """Compiles validation's decoding programs for the slice and returns the report's "decode" section."""
    settings = decoding_settings(config)
    search, chip = settings.search, topology.chip
    mesh = make_mesh(list(topology.devices()))
    rows = batch_rows(config.train.bleu_sentences, settings.batch_size)
    compile_s: dict[str, float] = {}
    jax.clear_caches()  # a trace made for the host backend must not be reused for the target
    with platform.compiling_for(chip.platform), tracing_mesh(mesh):
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

        searcher = decoding.searcher(model)
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
            "formula": flops.decode_step_flops(model.spec, rows * search.beam_size, src_len, max_steps),
        },
        "estimate": estimate,
    }


def _step_estimate(stage: jax.stages.Compiled | None, topology: Topology, rows: int) -> dict:
    """DECODE_ROOFLINE for one decoding step; None values where the search is one jitted call (its count mixes the
    encoder with every cache stage's loop)."""
    if stage is None:
        keys = ("flops_per_step_per_chip", "compute_s", "hbm_s", "collective_s", "step_s", "s_per_output_token")
        return {"roofline": DECODE_ROOFLINE, "flops_source": None} | dict.fromkeys(keys)
    chip = topology.chip
    cost, source = compiled_cost(stage)
    wire = collectives(stage.as_text(), topology.chips)["wire_bytes_per_chip"]
    compute_s = cost.get("flops", 0.0) / chip.peak_bf16_flops
    hbm_s = cost.get("bytes accessed", 0.0) / chip.hbm_bytes_per_s
    step_s = max(compute_s, hbm_s) + wire / chip.interconnect_bytes_per_s
    return {
        "roofline": DECODE_ROOFLINE,
        "flops_source": source,
        "flops_per_step_per_chip": cost.get("flops"),
        "compute_s": compute_s,
        "hbm_s": hbm_s,
        "collective_s": wire / chip.interconnect_bytes_per_s,
        "step_s": step_s,
        "s_per_output_token": step_s / rows,
    }
