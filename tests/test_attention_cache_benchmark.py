"""benchmarks/attention_cache.py: the decoding scores product against N caches, timed per cache."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from benchmarks import attention_cache


def test_measure_times_the_product_and_the_read_floor_per_cache():
    report = attention_cache.measure(rows=8, heads=2, slots=4, head_dim=8, caches=3, repeats=2)
    assert report["caches"] == 3 and report["cache_mib"] == round(8 * 2 * 4 * 8 * 4 / 2**20, 3)
    for name in ("product", "sum"):
        assert report[f"{name}_us"] > 0 and report[f"{name}_gb_per_s"] > 0
    assert all(report[f"chained_us_{name}"] > 0 for name in attention_cache.FORMS)


def test_small_values_keep_three_significant_figures():
    """A slow machine's rate of a tiny cache is small, never rounded to 0."""
    assert attention_cache.significant(0.0432) == 0.0432 and attention_cache.significant(1234.5) == 1230.0


def test_the_timed_forms_compute_the_same_scores():
    rng = np.random.default_rng(0)
    q_BKH = jnp.asarray(rng.normal(size=(6, 3, 8)), jnp.float32)
    k_BKSH = jnp.asarray(rng.normal(size=(6, 3, 5, 8)), jnp.float32)
    want = np.einsum("bkh,bksh->bks", np.asarray(q_BKH, np.float64), np.asarray(k_BKSH, np.float64))
    for name, form in attention_cache.FORMS.items():
        np.testing.assert_allclose(form(q_BKH, k_BKSH), want, rtol=1e-5, atol=1e-5, err_msg=name)
