"""What the test modules share, so that no test module imports another: builders, fakes and reference
implementations, one module each (model, training, fakes, reference, sweeps, tfds, attention, aot), and the
paths below.

Fixtures shared by several modules (`corpus`) are in tests/conftest.py.
"""

import os
import pathlib

import jax

from transformer_jax.data.sources import DATA_ENV

REPO = pathlib.Path(__file__).resolve().parents[2]  # the repository root: train.py, evaluate.py, configs/


def local_corpora() -> pathlib.Path:
    """The read-only corpora the tests read: $TRANSFORMER_JAX_DATA, else ../shared/data beside this checkout (where
    CI keeps them), exported when it exists so that the package and the commands the tests start use it too. Tests
    that need a corpus skip without it."""
    path = pathlib.Path(os.environ.get(DATA_ENV) or REPO.parent / "shared" / "data")
    if path.is_dir():
        os.environ.setdefault(DATA_ENV, str(path))
    return path


DATA = local_corpora()


def jitted(fn, *args, **options):
    """fn(*args, **options) as one compiled program: positional arguments traced, options (masks, flags) constants.

    Run eagerly, each operation of fn compiles a program of its own for every new shape (~20 ms each, ~100 a small
    attention call with its masks), which is most of the time of a test on small random shapes.
    """
    return jax.jit(lambda *a: fn(*a, **options))(*args)
