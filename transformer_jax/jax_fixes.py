"""A fix to jax 0.10.2 that the package installs on import, so that tracing a Flax NNX model stays linear in its size.

flax NNX's `Variable.set_value` asks `getattr(value, "sharding", None)` of every value it assigns, and every random
draw assigns one: `rngs.params()` in each initialiser, `rngs.dropout()` in each dropout, each advancing its
stream's count. Under a trace the value is a tracer, whose `sharding` property raises AttributeError (so that
getattr and hasattr work), and jax 0.10.2 builds that error's message with `Tracer._origin_msg()`, which walks
every equation traced so far. Each probe therefore costs time in proportion to the program traced before it, and
tracing a model's construction or a train step with dropout grows with the square of its size: the abstract
`base` model (what a parameter count, evaluate.py's restore and train.py's resume trace) took 1.6 s, 0.4 s
without the walk (docs/compilation.md, "Tracing"). `install` makes the property raise the same AttributeError
with the message's first sentence only. Errors that concretize a tracer (`int(x)`, `x.tolist()`, control flow
on a traced value) keep their full message: only the attribute probe changes.
"""

from __future__ import annotations

from jax._src import core  # Tracer: jax has no public way to change how a tracer answers an attribute probe


def _sharding_without_origin(tracer: core.Tracer):
    raise AttributeError(f"The 'sharding' attribute is not available on {tracer._error_repr()}.")


def install() -> None:
    """Makes `tracer.sharding` raise its AttributeError without walking the trace. Idempotent; changes nothing on
    a jax whose `Tracer.sharding` does not build that message (a release with the walk removed, or a property that
    answers otherwise)."""
    current = core.Tracer.__dict__.get("sharding")
    code = getattr(getattr(current, "fget", None), "__code__", None)
    if isinstance(current, property) and code is not None and "_origin_msg" in code.co_names:
        core.Tracer.sharding = property(_sharding_without_origin, doc=current.__doc__)
