"""benchmarks/attention_cache.py: the decoding scores product against N caches, timed per cache."""

from __future__ import annotations

from benchmarks import attention_cache


def test_measure_times_the_product_and_the_read_floor_per_cache():
    report = attention_cache.measure(rows=8, heads=2, slots=4, head_dim=8, caches=3, repeats=2)
    assert report["caches"] == 3 and report["cache_mib"] == round(8 * 2 * 4 * 8 * 4 / 2**20, 3)
    for name in ("product", "sum"):
        assert report[f"{name}_us"] > 0 and report[f"{name}_gb_per_s"] > 0
