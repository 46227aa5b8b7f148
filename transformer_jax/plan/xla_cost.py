"""XLA's cost analysis of a compiled module that came back without one: the one use of a private jax API in
transformer_jax, kept to this module.

A GPU program compiled on a host without a GPU (`train.py --plan h100:8`) returns no `cost_analysis()`: the CUDA
plugin's deviceless compile leaves it empty. XLA's HloCostAnalysis, run by the host's CPU client over the compiled
module, counts the same program, and jax exposes it only as `jax._src.lib.xla_client._xla.hlo_module_cost_analysis`:
there is no public API for it. Without it the plan reports the FLOPs formula instead (train_step.compiled_cost);
tests/test_plan_xla_cost.py fails, naming the jax version, when jax moves or removes it.
"""

from __future__ import annotations

import jax


def hlo_module_cost(compiled: jax.stages.Compiled) -> dict[str, float]:
    """XLA's HloCostAnalysis of a compiled program's first module (flops, bytes accessed, ...), counted by the
    host's CPU client; ImportError or AttributeError when this jax no longer has the private entry point."""
    from jax._src.lib import xla_client  # imported here so that its loss costs only this count, not the plan

    module = compiled.runtime_executable().hlo_modules()[0]
    return dict(xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module))
