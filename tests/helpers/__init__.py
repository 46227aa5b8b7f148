"""What the test modules share, so that no test module imports another: builders, fakes and reference
implementations, one module each (model, training, fakes, reference, sweeps, tfds, attention, aot), and the
paths below.

Fixtures shared by several modules (`corpus`) are in tests/conftest.py.
"""

import pathlib

from transformer_jax.data.sources import shared_data_dir

REPO = pathlib.Path(__file__).resolve().parents[2]  # the repository root: train.py, evaluate.py, configs/
DATA = shared_data_dir()  # the read-only corpora (../shared/data or $TRANSFORMER_JAX_DATA); tests skip without them
