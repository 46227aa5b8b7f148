"""The beam step's per-row top-k: decoding.state.top_k (blocks of TOP_K_BLOCK) against jax.lax.top_k; prints JSON.

    python -m benchmarks.top_k [--rows 256 --vocab 8000 --k 4 --blocks 16,32,64,128 --repeats 5]

Each variant runs inside one jitted loop of --steps steps over [rows, vocab] float32 logits (a beam-4 step of 64
sentences proposes k = 4 tokens per row from the Multi30k vocabulary of 8,000), so a step's time excludes dispatch.
Variants alternate, --repeats rounds, the best round counts. Both return the same values and indices (checked here
and in tests/test_decoding.py). Bytes: one read of the logits (rows x vocab x 4 B) per step is the floor.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from transformer_jax import cli
from transformer_jax.decoding import state

_ROWS = flags.DEFINE_integer("rows", 256, "Rows (sentences x beams).")
_VOCAB = flags.DEFINE_integer("vocab", 8000, "Entries per row.")
_K = flags.DEFINE_integer("k", 4, "Entries kept per row.")
_BLOCKS = flags.DEFINE_list("blocks", ["16", "32", "64", "128"], "TOP_K_BLOCK values to time.")
_STEPS = flags.DEFINE_integer("steps", 20, "Steps of the jitted loop.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Alternating rounds; the best counts.")


def looped(top_k, steps: int):
    """A jitted loop of `steps` top-ks, each on logits perturbed by the step (so that no step is hoisted)."""

    def run(x_RV):
        def body(i, acc):
            values, index = top_k(x_RV + i.astype(jnp.float32) * 1e-3, _K.value)
            return acc + values.sum() + index.sum().astype(jnp.float32)

        return jax.lax.fori_loop(0, steps, body, jnp.float32(0))

    return jax.jit(run)


def main(argv):
    del argv
    x_RV = jnp.asarray(np.random.default_rng(0).normal(size=(_ROWS.value, _VOCAB.value)).astype(np.float32))
    variants = {"lax.top_k": jax.lax.top_k}
    for block in map(int, _BLOCKS.value):

        def blockwise(x, k, block=block):
            old, state.TOP_K_BLOCK = state.TOP_K_BLOCK, block
            try:  # read at trace time
                return state.top_k(x, k)
            finally:
                state.TOP_K_BLOCK = old

        variants[f"state.top_k block {block}"] = blockwise
    want = jax.lax.top_k(x_RV, _K.value)
    for name, fn in variants.items():
        got = jax.jit(fn, static_argnums=1)(x_RV, _K.value)
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), name
    programs = {name: looped(fn, _STEPS.value) for name, fn in variants.items()}
    for program in programs.values():
        program(x_RV).block_until_ready()  # compile
    best = dict.fromkeys(programs, float("inf"))
    for _ in range(_REPEATS.value):
        for name, program in programs.items():
            start = time.perf_counter()
            program(x_RV).block_until_ready()
            best[name] = min(best[name], (time.perf_counter() - start) / _STEPS.value)
    base = best["lax.top_k"]
    print(
        json.dumps(
            {
                "rows": _ROWS.value,
                "vocab": _VOCAB.value,
                "k": _K.value,
                "cores": os.cpu_count(),
                "backend": jax.default_backend(),
                "bytes_read_per_step": _ROWS.value * _VOCAB.value * 4,
                "ms_per_step": {name: round(1e3 * t, 3) for name, t in best.items()},
                "speedup_over_lax_top_k": {name: round(base / t, 2) for name, t in best.items()},
            }
        )
    )


if __name__ == "__main__":
    cli.run(main, "python -m benchmarks.top_k")
