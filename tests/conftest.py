"""Test-wide settings: compile fast. The tests' programs are tiny, so XLA's compile time, not run time, dominates
the suite; the lowest optimisation level compiles several times faster. Set before JAX starts its backend;
subprocesses (train.py in the resume tests) inherit it, so compared runs share it."""

import os

_FAST = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST}".strip()


# Imported after XLA_FLAGS is set: importing the helpers imports JAX.
import pathlib  # noqa: E402

import pytest  # noqa: E402

from tests.helpers.training import write_corpus  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
    """The training helpers' word-for-word corpus (write_corpus), written once per test module."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def tiny_corpus_env(corpus, monkeypatch) -> pathlib.Path:
    """`corpus`, named by $TINY_CORPUS: where tests/tiny_sweep_config.py reads its data."""
    monkeypatch.setenv("TINY_CORPUS", str(corpus))
    return corpus
