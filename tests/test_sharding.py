"""Multi-host start-up: which arguments reach jax.distributed.initialize, and clear errors for bad environments."""

import jax
import pytest

from transformer_jax import sharding
from transformer_jax.errors import ConfigError

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "TRANSFORMER_JAX_DISTRIBUTED")


@pytest.fixture
def calls(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    seen = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args: seen.append(args))
    return seen


def test_single_host_does_not_initialize(calls):
    sharding.initialize_distributed()
    assert calls == []


def test_coordinator_with_process_count_and_id(calls, monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    sharding.initialize_distributed()
    assert calls == [("10.0.0.1:1234", 4, 2)]


def test_auto_detection_on_pods_and_slurm(calls, monkeypatch):
    monkeypatch.setenv("TRANSFORMER_JAX_DISTRIBUTED", "1")
    sharding.initialize_distributed()
    assert calls == [()]


@pytest.mark.parametrize(
    "env, message",
    [
        ({"JAX_NUM_PROCESSES": "four", "JAX_PROCESS_ID": "0"}, "JAX_NUM_PROCESSES='four'"),
        ({"JAX_PROCESS_ID": "1"}, "both"),
    ],
)
def test_bad_environment_names_the_variable(calls, monkeypatch, env, message):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        sharding.initialize_distributed()
    assert calls == []
