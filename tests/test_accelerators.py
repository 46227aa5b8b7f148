"""Slice names users type, the chip table, and what a missing compiler says (no libtpu needed here)."""

from __future__ import annotations

import pytest
from jax.experimental import topologies

from transformer_jax.errors import ConfigError
from transformer_jax.plan import accelerators
from transformer_jax.plan.accelerators import CHIPS, parse_topology


@pytest.mark.parametrize(
    "name, chip, chips, hosts, shape",
    [
        ("v5e-8", "v5e", 8, 1, "2x4"),
        ("v5e:2x4", "v5e", 8, 1, "2x4"),
        ("v5e-16", "v5e", 16, 4, "4x4"),
        ("v4-8", "v4", 4, 1, "2x2x1"),  # a v4 accelerator type counts TensorCores: two per chip
        ("v4-32", "v4", 16, 4, "2x2x4"),
        ("v5p-8", "v5p", 4, 1, "2x2x1"),
        ("v6e-8", "v6e", 8, 1, "2x4"),
        ("V6E-64", "v6e", 64, 16, "8x8"),
        ("h100:8", "h100", 8, 1, "1x1x8"),
        ("h200:16", "h200", 16, 2, "1x2x8"),
        ("h100-1", "h100", 1, 1, "1x1x1"),
    ],
)
def test_names_users_type_parse_to_slices(name, chip, chips, hosts, shape):
    topology = parse_topology(name)
    assert (topology.chip.name, topology.chips, topology.hosts, topology.shape) == (chip, chips, hosts, shape)


def test_an_unknown_topology_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="unknown topology") as error:
        parse_topology("v7-8")
    for chip in CHIPS:
        assert chip in str(error.value)


@pytest.mark.parametrize("name, says", [("v5e-3", "valid sizes: v5e-1, v5e-4"), ("v4:2x2", "3 axes"), ("h100:12", "8")])
def test_a_slice_that_does_not_exist_says_what_does(name, says):
    with pytest.raises(ConfigError, match=says):
        parse_topology(name)


def test_every_chip_has_positive_facts():
    for chip in CHIPS.values():
        assert chip.hbm_bytes > 1e9 and chip.peak_bf16_flops > 1e13 and chip.hbm_bytes_per_s > 1e11
        assert chip.interconnect_bytes_per_s > 1e10 and chip.chips_per_host >= 1


@pytest.mark.parametrize(
    "name, raised",
    [
        ("v5e-8", RuntimeError("JAX TPU support not installed; cannot generate TPU topology.")),
        ("h100:8", NotImplementedError("topology not implemented for cuda")),
    ],
)
def test_a_missing_compiler_says_how_to_install_it(monkeypatch, name, raised):
    def missing(*args, **kwargs):
        raise raised

    monkeypatch.setattr(topologies, "get_topology_desc", missing)
    accelerators._devices.cache_clear()
    with pytest.raises(ConfigError, match=r"pip install -r requirements-aot\.txt"):
        parse_topology(name).devices()
    accelerators._devices.cache_clear()
