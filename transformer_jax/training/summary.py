"""`train.py --dry_run`: what a config will build and cost, without data or compute."""

from __future__ import annotations

import jax
import ml_collections

from transformer_jax.data.pipeline import batch_shapes
from transformer_jax.model import TransformerSpec, parameter_count
from transformer_jax.sharding import make_mesh
from transformer_jax.training import flops
from transformer_jax.training.loop import check_batch_shapes


def dry_run_summary(config: ml_collections.ConfigDict) -> dict:
    """Parameters, FLOPs, the batch shapes training will use (from the data pipeline), the mesh and a time estimate.

    Gradient accumulation does not change the FLOPs or tokens of a step: the step splits the same batch into
    train.grad_accum_steps micro-batches.
    """
    spec = TransformerSpec.from_config(config)
    params = parameter_count(config)
    mesh = make_mesh()
    shapes = batch_shapes(config.data, jax.process_count(), check_batch_shapes(config, mesh))
    # FLOPs per target token at the longest shape, and per step for the largest batch by tokens.
    rows, s_len, t_len = max(shapes, key=lambda s: s[0] * s[1])
    forward = flops.forward_flops(spec, rows, s_len, t_len)
    step = flops.train_step_flops(spec, rows, s_len, t_len)
    summary = {
        "parameters": params,
        "forward_flops_per_target_token": forward / (rows * t_len),
        "train_flops_per_target_token": 3 * forward / (rows * t_len),
        "train_flops_per_step": step,
        "batch_shapes_rows_src_tgt": shapes,
        "tokens_per_step_per_side": rows * s_len,
        "mesh": {"axes": dict(mesh.shape), "devices": [str(d) for d in mesh.devices.flat], "mode": config.train.mesh},
    }
    devices = config.train.estimate_devices or mesh.size
    if config.train.peak_flops:
        step_s = step / (config.train.peak_flops * devices * config.train.assumed_mfu)
        summary["estimate"] = {
            "devices": devices,
            "peak_flops_per_device": config.train.peak_flops,
            "assumed_mfu": config.train.assumed_mfu,
            "step_s": step_s,
            "total_hours": step_s * config.train.num_steps / 3600,
        }
    else:
        summary["estimate"] = "set --config.train.peak_flops (FLOP/s of one device) for a time estimate"
    return summary
