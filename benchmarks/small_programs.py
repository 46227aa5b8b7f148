"""Whether the persistent cache pays for the smallest programs: compiled in one process, loaded in the next.

    python -m benchmarks.small_programs [--shapes 40]

Two fresh processes share an empty cache directory (runtime.enable_compile_cache with MIN_COMPILE_SECONDS): each runs
`(x * 2 + 1).sum()` eagerly on `shapes` new shapes, four XLA programs per shape (ones, multiply, add, sum), and
reports the time of the loop and jax's own compile, lowering and cache-read durations (jax.monitoring). The first
compiles and writes every program, the second loads them. Prints one JSON line. The processes use the test
suite's XLA flags (tests/conftest.py), where these small programs are most of the compile time.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

from absl import flags

from transformer_jax import cli

_SHAPES = flags.DEFINE_integer("shapes", 40, "New shapes [n, 7], n = 1 .. shapes, each its own four programs.")
_FAST = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

CHILD = """
import collections, json, sys, time
import jax, jax.numpy as jnp
from transformer_jax import runtime
runtime.enable_compile_cache(sys.argv[1])
seconds = collections.Counter()
jax.monitoring.register_event_duration_secs_listener(lambda event, s, **_: seconds.update({event: s, event + "#n": 1}))
jnp.ones(3).block_until_ready()  # the backend's start, not timed
seconds.clear()
start = time.perf_counter()
for n in range(1, int(sys.argv[2]) + 1):
    x = jnp.ones((n, 7))
    (x * 2 + 1).sum().block_until_ready()
wall = time.perf_counter() - start
keys = {"backend_compile": "/jax/core/compile/backend_compile_duration",
        "lowering": "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "cache_read": "/jax/compilation_cache/cache_retrieval_time_sec"}
out = {"loop_s": round(wall, 3), "programs": seconds[keys["backend_compile"] + "#n"]}
out |= {f"{name}_s": round(seconds[key], 3) for name, key in keys.items()}
print(json.dumps(out))
"""


def main(argv: list[str]) -> None:
    del argv
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {_FAST}".strip(), "JAX_PLATFORMS": "cpu"}
    with tempfile.TemporaryDirectory() as cache:
        runs = []
        for _ in ("compiled", "loaded"):
            done = subprocess.run(
                [sys.executable, "-c", CHILD, cache, str(_SHAPES.value)], env=env, capture_output=True, text=True
            )
            if done.returncode:
                sys.exit(f"small_programs: the child process failed:\n{done.stderr}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        size = sum(f.stat().st_size for f in pathlib.Path(cache).rglob("*") if f.is_file())
    first, second = runs
    print(
        json.dumps(
            {
                "benchmark": "small_programs",
                "shapes": _SHAPES.value,
                "first_process_compiles": first,
                "second_process_loads": second,
                "first_over_second": round(first["loop_s"] / second["loop_s"], 2),
                "cache_bytes": size,
            }
        )
    )


if __name__ == "__main__":
    cli.run(main, "python -m benchmarks.small_programs")
