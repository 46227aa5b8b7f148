"""Test-wide settings: compile fast. The tests' programs are tiny, so XLA's compile time, not run time, dominates
the suite; the lowest optimisation level compiles several times faster. Set before JAX starts its backend;
subprocesses (train.py in the resume tests) inherit it, so compared runs share it."""

import os

_FAST = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST}".strip()
