"""What the test modules share, so that no test module imports another: builders, fakes and reference
implementations, one module each (model, training, fakes, reference, sweeps, tfds, attention, aot), and the
paths below.

Fixtures shared by several modules (`corpus`) are in tests/conftest.py.
"""

import pathlib

import jax

from transformer_jax.data.sources import shared_data_dir

REPO = pathlib.Path(__file__).resolve().parents[2]  # the repository root: train.py, evaluate.py, configs/
DATA = shared_data_dir()  # the read-only corpora (../shared/data or $TRANSFORMER_JAX_DATA); tests skip without them


def jitted(fn, *args, **options):  # noqa: ANN001, ANN201
    """fn(*args, **options) as one compiled program: positional arguments traced, options (masks, flags) constants.

    Run eagerly, each operation of fn compiles a program of its own for every new shape (~20 ms each, ~100 a small
    attention call with its masks), which is most of the time of a test on small random shapes.
    """
    return jax.jit(lambda *a: fn(*a, **options))(*args)
