"""A decoding step's attention product against its key cache, with the cache in the CPU's caches or not; prints JSON.

    python -m benchmarks.attention_cache [--rows 64 --heads 4 --slots 32 --head_dim 64 --caches 1,4,24 --repeats 20]

The product is xla_attention's scores einsum for one query per row (greedy decoding), `btkgh,bksh->bkgts`, over a
[rows, heads, slots, head_dim] float32 key cache. One jitted call computes it against each of N distinct caches,
so that with N x (cache bytes) past the last-level cache every product reads its cache from memory, as a decoding
step does whose working set (weights and caches) is larger than that cache (docs/benchmarks.md). A sum over the
same caches is the memory-read floor. Per product: microseconds and GB/s of cache read (best of --repeats calls).

In that call XLA may run independent products side by side on the two cores. A step cannot: each layer's product
waits for its query. So the `chained_us` figures time the products one after another, each query depending on the
last product, for three forms of the same scores: `einsum` (the one above), `block_diagonal` (every head's query
against every head's keys, a batched matrix product with 4 query rows that YNNPACK accepts, then each head's own
block) and `halves` (two products over half the rows each, which XLA may run on the two cores at once).
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from transformer_jax import cli

_ROWS = flags.DEFINE_integer("rows", 64, "Rows (sentences x beams) of the step.")
_HEADS = flags.DEFINE_integer("heads", 4, "Key/value heads.")
_SLOTS = flags.DEFINE_integer("slots", 32, "Cache slots.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Key width per head.")
_CACHES = flags.DEFINE_list("caches", ["1", "4", "24"], "Distinct caches per call (N).")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed calls; the fastest counts.")


def best_s(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compiles
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def scores_einsum(q_BKH: jax.Array, k_BKSH: jax.Array) -> jax.Array:
    """[B, K, S]: each row's and head's query against its keys (xla_attention's product for one query)."""
    return jnp.einsum("bkh,bksh->bks", q_BKH, k_BKSH)


def scores_block_diagonal(q_BKH: jax.Array, k_BKSH: jax.Array) -> jax.Array:
    """The same scores from every head's query against every head's keys ([B, K, K*S]), diagonal blocks kept."""
    b, k, s, h = k_BKSH.shape
    every_BQKS = jnp.einsum("bqh,bnh->bqn", q_BKH, k_BKSH.reshape(b, k * s, h)).reshape(b, k, k, s)
    return jnp.einsum("bqks,qk->bqs", every_BQKS, jnp.eye(k, dtype=every_BQKS.dtype))


def scores_halves(q_BKH: jax.Array, k_BKSH: jax.Array) -> jax.Array:
    """The same scores as two products over half the rows each."""
    half = q_BKH.shape[0] // 2
    return jnp.concatenate([scores_einsum(q_BKH[:half], k_BKSH[:half]), scores_einsum(q_BKH[half:], k_BKSH[half:])])


FORMS = {"einsum": scores_einsum, "block_diagonal": scores_block_diagonal, "halves": scores_halves}


def chained(form, q_BKH: jax.Array, ks: list[jax.Array]) -> jax.Array:
    """The products against ks one after another: each query depends on the last product (as in a step)."""
    for k in ks:
        q_BKH = q_BKH + 1e-9 * form(q_BKH, k).sum(-1, keepdims=True)
    return q_BKH


def significant(x: float, digits: int = 3) -> float:
    """x to `digits` significant figures: a fixed number of decimals rounds a slow machine's small rate to 0."""
    return float(f"{x:.{digits}g}")


def measure(rows: int, heads: int, slots: int, head_dim: int, caches: int, repeats: int) -> dict:
    """The product's and the sum's time per cache, over `caches` distinct caches in one call."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(rows, 1, heads, 1, head_dim)), jnp.float32)
    ks = [jnp.asarray(rng.normal(size=(rows, heads, slots, head_dim)), jnp.float32) for _ in range(caches)]
    products = jax.jit(lambda q, ks: [jnp.einsum("btkgh,bksh->bkgts", q, k) for k in ks])
    sums = jax.jit(lambda ks: [k.sum() for k in ks])
    cache_bytes = rows * heads * slots * head_dim * 4
    report = {
        "caches": caches,
        "cache_mib": round(cache_bytes / 2**20, 3),
        "total_mib": round(caches * cache_bytes / 2**20, 1),
    }
    for name, fn, args in (("product", products, (q, ks)), ("sum", sums, (ks,))):
        each = best_s(fn, args, repeats) / caches
        report[f"{name}_us"] = significant(each * 1e6)
        report[f"{name}_gb_per_s"] = significant(cache_bytes / each / 1e9)
    for name, form in FORMS.items():
        fn = jax.jit(lambda q, ks, form=form: chained(form, q, ks))
        report[f"chained_us_{name}"] = significant(best_s(fn, (q[:, 0, :, 0], ks), repeats) / caches * 1e6)
    return report


def main(argv: list[str]) -> None:
    del argv
    shape = dict(rows=_ROWS.value, heads=_HEADS.value, slots=_SLOTS.value, head_dim=_HEAD_DIM.value)
    for n in map(int, _CACHES.value):
        report = measure(**shape, caches=n, repeats=_REPEATS.value)
        print(json.dumps({**shape, **report, "backend": jax.default_backend()}), flush=True)


if __name__ == "__main__":
    cli.run(main, "python -m benchmarks.attention_cache")
