"""The token choice of one decode step, timed alone: greedy's argmax against the samplers; prints one JSON line.

    python -m benchmarks.sampling_step [--rows 64 --vocab_size 8000 --repeats 5]

Random logits [rows, vocab_size] (normal, scale 3). Each choice is jitted and called 20 times per repeat with the step
counter advancing (so each call draws new numbers); the best repeat's mean per call counts. The choices: greedy
search's first_argmax; jax.random.categorical over the plain distribution's log-probabilities (V Gumbel numbers
per row, the sampler this branch replaced); decoding.Sampling's chooser (one uniform number per row, inverse CDF)
with top_p 1 and 0.9.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from transformer_jax import cli, decoding
from transformer_jax.decoding.state import first_argmax

_ROWS = flags.DEFINE_integer("rows", 64, "Rows of the batch (sentences decoded together).")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 8000, "Vocabulary size (the Multi30k configs': 8000).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repeats of 20 calls; the fastest counts.")
CALLS = 20


def main(argv: list[str]) -> None:
    del argv
    rows, vocab = _ROWS.value, _VOCAB_SIZE.value
    logits_BV = jax.random.normal(jax.random.PRNGKey(0), (rows, vocab)) * 3
    keys_B2 = jnp.asarray(decoding.sample_keys(0, np.arange(rows), np.zeros(rows, np.int32)))
    plain = decoding.Sampling(1.0, 0, 1.0)

    def gumbel(logits, step):
        step_keys = jax.vmap(jax.random.fold_in)(keys_B2, step)
        return jax.vmap(jax.random.categorical)(step_keys, plain.log_probs(logits))

    choices = {
        "greedy_argmax": lambda logits, step: first_argmax(logits),
        "gumbel_categorical": gumbel,
        "inverse_cdf": plain.chooser(keys_B2),
        "inverse_cdf_top_p_0.9": decoding.Sampling(1.0, 0, 0.9).chooser(keys_B2),
    }
    step = jnp.zeros((rows,), jnp.int32)
    best = {}
    for name, fn in choices.items():
        fn = jax.jit(fn)
        fn(logits_BV, step).block_until_ready()
        times = []
        for _ in range(_REPEATS.value):
            start = time.perf_counter()
            for i in range(CALLS):
                fn(logits_BV, step + i).block_until_ready()
            times.append((time.perf_counter() - start) / CALLS)
        best[name] = round(1e3 * min(times), 3)
    report = {"backend": jax.default_backend(), "cores": os.cpu_count(), "rows": rows, "vocab_size": vocab}
    report["ms_per_step"] = best
    print(json.dumps(report))


if __name__ == "__main__":
    cli.run(main, "python -m benchmarks.sampling_step")
