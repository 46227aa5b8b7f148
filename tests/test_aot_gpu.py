"""Compiled for real GPUs on this CPU host: our Pallas attention (Triton) fwd+bwd and the whole train step with
attention.impl=pallas go through the CUDA plugin's compiler for H100 and H200 (accelerators.parse_topology, the
target configs in transformer_jax/plan/gpu_targets/). Figures from memory_analysis() are the compiler's estimates of
what the program would allocate, not measurements.

Needs the CUDA plugin (requirements-aot.txt); skipped without it.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import pytest

from tests.helpers.aot import assert_linear_in_length, compile_attention
from tests.helpers.training import one_layer_config
from transformer_jax import runtime
from transformer_jax.ops import attention
from transformer_jax.plan import accelerators, report
from transformer_jax.sharding import make_mesh

needs_cuda_plugin = pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda12_plugin") is None,
    reason=f"compiling for GPU needs the CUDA plugin: pip install -r {accelerators.AOT_REQUIREMENTS}",
)

TRITON = "__gpu$xla.gpu.triton"
KERNELS = ('name = "attention_forward"', 'name = "attention_dkdv"', 'name = "attention_dq"')


def gpu(name: str) -> jax.Device:
    return accelerators.parse_topology(f"{name}:1").devices()[0]


def assert_our_kernels(compiled: jax.stages.Compiled) -> None:
    hlo = compiled.as_text()
    assert hlo.count(TRITON) >= 3 and all(kernel in hlo for kernel in KERNELS)


@needs_cuda_plugin
@pytest.mark.parametrize(
    "chip,head_dim,mask",
    [("h100", 64, "causal"), pytest.param("h200", 128, "packed", marks=pytest.mark.slow)],  # one in the default run
    ids=str,
)
def test_attention_compiles_for_gpu_at_2k(chip: str, head_dim: int, mask: str) -> None:
    compiled = compile_attention(gpu(chip), 2048, head_dim, mask)
    assert_our_kernels(compiled)
    assert_linear_in_length(compiled, 2048)


@needs_cuda_plugin
@pytest.mark.slow
@pytest.mark.parametrize("chip", ["h100", "h200"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", ["causal", "packed"])
def test_attention_compiles_for_gpu_at_32k_with_memory_linear_in_length(chip: str, head_dim: int, mask: str):
    compiled = compile_attention(gpu(chip), 32768, head_dim, mask)
    assert_our_kernels(compiled)
    assert_linear_in_length(compiled, 32768)


@pytest.mark.slow  # the default run compiles our Triton kernels at 2k and a whole Pallas train step for a TPU
@needs_cuda_plugin
def test_train_step_with_pallas_attention_compiles_for_an_h100() -> None:
    config = one_layer_config()
    config.attention.impl = "pallas"
    topology = accelerators.parse_topology("h100:1")
    compiled, _ = report.compile_train_step(config, topology, "data", make_mesh(list(topology.devices())), (8, 32, 32))
    assert_our_kernels(compiled)


def test_a_dtype_the_triton_kernels_cannot_take_is_one_line_at_trace_time() -> None:
    """int8 q, k, v (one dtype, but not a float): refused before Triton sees it. Head dims above 256 and mixed
    dtypes are checked in test_attention_ops.py; the checks do not depend on the GPU target."""
    q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.int8)
    with runtime.compiling_for("gpu"), pytest.raises(ValueError, match="one dtype among") as error:
        jax.eval_shape(lambda q: attention(q, q, q, impl="pallas", causal=True), q)
    assert "\n" not in str(error.value)
