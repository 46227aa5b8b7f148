"""Export a trained model for serving: a CTranslate2 model directory from a workdir's checkpoints.

    python -m transformer_jax.export --workdir DIR --format ctranslate2 --output OUT [--config C]
        [--checkpoint latest|best|STEP] [--average_last N | --average_steps A,B | --average_best K]
        [--quantization none|int8|int8_float32|bfloat16] [--force]

The checkpoints are chosen and averaged exactly as evaluate.py chooses them (the same flags and defaults:
--average_last defaults to config.eval.average_last). OUT holds model.bin, config.json, shared_vocabulary.json and
spm.model; an existing OUT is replaced only with --force and only if it is an earlier export (it holds
model.bin), and OUT appears whole or not at all. --quantization stores the weights in CTranslate2's int8,
int8_float32 or bfloat16 (its own quantization; default none: float32). A workdir without checkpoints, an
architecture the engine cannot express, or an existing OUT: one line on stderr, exit status 1.
The library functions are in transformer_jax.export.ctranslate2 (to_ctranslate2, ctranslate2_translate).
"""

from __future__ import annotations

import json
import logging
import os

from absl import flags

from transformer_jax import cli
from transformer_jax.evaluation import checkpoint_flags
from transformer_jax.export.ctranslate2 import QUANTIZATIONS, export_workdir

PROG = "python -m transformer_jax.export"
FLAGS = flags.FLAGS
checkpoint_flags.define()  # evaluate.py's: same names, defaults and meaning
flags.DEFINE_enum("format", "ctranslate2", ["ctranslate2"], "Inference engine to export to.")
flags.DEFINE_string("output", None, "Model directory to write (must not exist, unless --force).")
flags.DEFINE_enum(
    "quantization", "none", ["none", *QUANTIZATIONS], "Weight type in model.bin: none (float32) or CTranslate2's."
)
flags.DEFINE_bool("force", False, "Replace an existing --output directory that holds an earlier export.")
flags.mark_flags_as_required(["workdir", "output"])


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (cli.run refuses them)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs each checkpoint handler it creates at INFO
    selected = checkpoint_flags.selection()
    quantization = None if FLAGS.quantization == "none" else FLAGS.quantization
    report = export_workdir(
        selected.pop("workdir"), FLAGS.output, quantization=quantization, force=FLAGS.force, **selected
    )
    print(json.dumps(report))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cli.run(main, PROG)
