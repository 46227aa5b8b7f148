"""transformer_jax.jax_fixes: probing a tracer's `sharding` no longer walks the trace, and nothing else changes."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax._src import core
from jax._src.interpreters import partial_eval

from tests.helpers.model import tiny_spec
from transformer_jax import jax_fixes
from transformer_jax.model import Transformer, model_rngs


@pytest.fixture
def walks(monkeypatch):
    """How many times jax walked a trace's equations to explain where a tracer came from."""
    count = [0]
    walk = partial_eval.JaxprStackFrame.find_progenitors

    def counted(self, tracer):
        count[0] += 1
        return walk(self, tracer)

    monkeypatch.setattr(partial_eval.JaxprStackFrame, "find_progenitors", counted)
    return count


def test_tracing_a_models_construction_walks_no_trace(walks):
    # Every initialiser draws from rngs.params(), and flax probes the new count's `sharding`: one walk per draw
    # (and tracing quadratic in the model's size) without the fix.
    model = nnx.eval_shape(lambda: Transformer(tiny_spec(), rngs=model_rngs(0)))
    assert jax.tree.leaves(nnx.state(model, nnx.Param)) and walks[0] == 0


def test_a_probe_still_finds_no_sharding_on_a_tracer_and_install_is_idempotent():
    jax_fixes.install()
    seen = []

    @jax.jit
    def probe(x):
        seen.append((hasattr(x, "sharding"), getattr(x, "sharding", None)))
        with pytest.raises(AttributeError, match="'sharding' attribute is not available on"):
            _ = x.sharding
        return x + 1

    assert probe(jnp.ones(3)).tolist() == [2.0, 2.0, 2.0] and seen == [(False, None)]
    assert jnp.ones(3).sharding is not None  # concrete arrays keep theirs


def test_concretizing_a_tracer_still_says_where_it_came_from(walks):
    @jax.jit
    def concretize(x):
        return x.tolist()

    with pytest.raises(jax.errors.ConcretizationTypeError, match="depends on the value of the argument x"):
        concretize(jnp.ones(3))
    assert walks[0] > 0  # the message still traces the value back


def test_install_leaves_a_sharding_property_that_does_not_walk_the_trace(monkeypatch):
    # A jax release that answers `sharding` otherwise (or without the walk) keeps its own property.
    own = property(lambda tracer: None)
    monkeypatch.setattr(core.Tracer, "sharding", own)
    jax_fixes.install()
    assert core.Tracer.__dict__["sharding"] is own
