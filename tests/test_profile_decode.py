"""benchmarks/profile_decode.py's reading of a jax.profiler trace: the window, busy time and self time by kind."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import profile_decode


def test_summarise_counts_a_traced_programs_matmuls(tmp_path):
    x = jnp.ones((64, 256), jnp.float32)
    w = jnp.ones((256, 1024), jnp.float32)
    program = jax.jit(lambda x, w: jnp.tanh(x @ w).sum())
    program(x, w).block_until_ready()
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(str(tmp_path), profiler_options=options):
        for _ in range(3):
            program(x, w).block_until_ready()
    summary = profile_decode.summarise(next(tmp_path.rglob("*.xplane.pb")))
    assert summary["self_s_by_kind"]["matmul"] > 0
    assert 0 < summary["some_operation_running_s"] <= summary["window_s"]
    assert sum(op["calls"] for op in summary["largest"] if op["op"].startswith(profile_decode.MATMUL_KINDS)) >= 3
