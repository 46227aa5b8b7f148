"""The one private jax API of transformer_jax (plan/accelerators.py: hlo_module_cost_from_private_jax): when a jax
upgrade moves or removes it, this test says so by name instead of the plan silently falling back to the FLOPs
formula."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from transformer_jax.plan import accelerators

PRIVATE_API = "jax._src.lib.xla_client._xla.hlo_module_cost_analysis"


def matmul() -> jax.stages.Compiled:
    return jax.jit(lambda a, b: a @ b).trace(jnp.ones((8, 16)), jnp.ones((16, 4))).lower().compile()


def test_the_private_cost_analysis_still_counts_a_compiled_module():
    try:
        cost = accelerators.hlo_module_cost_from_private_jax(matmul())
    except (AttributeError, ImportError) as error:
        pytest.fail(
            f"jax {jax.__version__} no longer provides {PRIVATE_API} ({error}); --plan for GPUs reports the FLOPs "
            "formula instead of the compiled count: find its new home and update "
            "transformer_jax/plan/accelerators.py: hlo_module_cost_from_private_jax"
        )
    assert cost["flops"] == 2 * 8 * 16 * 4  # one multiply and one add per term of the matmul
    assert cost["flops"] == matmul().cost_analysis()["flops"]  # the same count the public API gives on CPU


class WithoutCount:
    """A compiled program as a deviceless GPU compile returns it: an executable, but no cost_analysis()."""

    def __init__(self, executable):
        self.runtime_executable = executable

    def cost_analysis(self):
        return None


def test_a_program_the_compiler_gave_no_count_is_counted_by_xla_or_by_the_formula():
    cost, source = accelerators.compiled_cost(WithoutCount(matmul().runtime_executable))
    assert cost["flops"] == 2 * 8 * 16 * 4 and source == "compiled (XLA HloCostAnalysis of the compiled module)"

    def missing():
        raise AttributeError("no executable")

    assert accelerators.compiled_cost(WithoutCount(missing)) == ({}, "formula (the compiler gave no count)")
