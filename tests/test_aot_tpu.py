"""Compiled for real TPUs on this CPU host: our Pallas TPU attention fwd+bwd goes through libtpu's compiler for
v5e and v4 slices (accelerators.tpu_devices); the whole train step with attention.impl=pallas is compiled by
tests/test_plan.py, through train.py --plan's own path. Figures from memory_analysis() are the compiler's
estimates of what the program would allocate, not measurements.

Needs libtpu (requirements-aot.txt); skipped without it. And a CPU host with libtpu installed stays quiet under
JAX_PLATFORMS=cpu.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from tests.helpers.aot import assert_linear_in_length, compile_attention
from tests.helpers.attention import TPU_CASES, TPU_SMALL, forward_backward, make_inputs
from transformer_jax import runtime
from transformer_jax.ops import attention
from transformer_jax.plan import accelerators
from transformer_jax.sharding import make_mesh

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason=f"compiling for TPU needs libtpu: pip install -r {accelerators.AOT_REQUIREMENTS}",
)


@needs_libtpu
@pytest.mark.parametrize(
    "topology,head_dim,mask",
    [("v5e:2x2", 64, "causal"), pytest.param("v4:2x2x1", 128, "packed", marks=pytest.mark.slow)],
    ids=lambda x: str(x),
)
def test_attention_compiles_for_tpu_at_2k(topology: str, head_dim: int, mask: str) -> None:
    device = accelerators.tpu_devices(topology)[0]
    assert_linear_in_length(compile_attention(device, 2048, head_dim, mask), 2048)


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v5e:2x2", "v4:2x2x1"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", ["causal", "packed"])
def test_attention_compiles_for_tpu_at_32k_with_memory_linear_in_length(topology: str, head_dim: int, mask: str):
    device = accelerators.tpu_devices(topology)[0]
    assert_linear_in_length(compile_attention(device, 32768, head_dim, mask), 32768)


@needs_libtpu
@pytest.mark.parametrize("case,dtype", TPU_CASES, ids=[c.name for c, _ in TPU_CASES])
def test_the_interpret_mode_cases_compile_for_tpu(case, dtype) -> None:
    """The shapes, masks and smallest tiles checked in interpret mode also pass Mosaic's own checks."""
    (q, k, v, do), kw = make_inputs(case, dtype)
    sharding = jax.sharding.SingleDeviceSharding(accelerators.tpu_devices("v5e:2x2")[0])
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in (q, k, v, do)]
    fn = functools.partial(forward_backward, "pallas", kw=kw, block_sizes=TPU_SMALL)
    with runtime.compiling_for("tpu"):
        jax.jit(lambda *a: fn(a)).trace(*specs).lower().compile()


@needs_libtpu
def test_a_batch_the_mesh_cannot_split_is_one_clear_line() -> None:
    mesh = make_mesh(list(accelerators.tpu_devices("v5e:2x2")))
    q = jax.ShapeDtypeStruct((3, 128, 2, 64), jnp.bfloat16)
    with (
        runtime.compiling_for("tpu"),
        jax.set_mesh(mesh),
        pytest.raises(ValueError, match="batch 3 is not a multiple"),
    ):
        jax.eval_shape(lambda q: attention(q, q, q, impl="pallas", causal=True), q)


def test_a_cpu_host_with_the_aot_compilers_installed_starts_quietly_with_jax_platforms_cpu() -> None:
    """No TPU/CUDA initialisation errors on stderr when jax runs on the CPU as docs/compilation.md tells such a
    host to choose (JAX_PLATFORMS=cpu): the package itself chooses no platform."""
    env = {k: v for k, v in os.environ.items() if k != "ALLOW_MULTIPLE_LIBTPU_LOAD"} | {"JAX_PLATFORMS": "cpu"}
    code = "import transformer_jax, jax; print(jax.numpy.ones(3).sum(), jax.default_backend())"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["3.0", "cpu"]
    assert result.stderr == ""
