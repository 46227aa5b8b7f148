"""benchmarks/profile_decode.py: its reading of a jax.profiler trace (the window, busy time and self time by kind),
and its timing of the host's waits for results."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import profile_decode


def test_summarise_counts_a_traced_programs_matmuls(tmp_path):
    # Microseconds of work in all: a summary rounded to the millisecond counted it as none (and a bigger program
    # flaked on a fast machine).
    x = jnp.ones((32, 32), jnp.float32)
    w = jnp.ones((32, 32), jnp.float32)
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


def test_device_get_waits_times_the_reads_inside_the_block_only():
    x = jnp.arange(4)
    get = jax.device_get
    with profile_decode.device_get_waits() as waits:
        start = time.perf_counter()
        np.testing.assert_array_equal(jax.device_get(x), np.arange(4))
        jax.device_get([x, x])
        elapsed = time.perf_counter() - start
    jax.device_get(x)
    assert waits[1] == 2 and 0 < waits[0] <= elapsed
    assert jax.device_get is get
