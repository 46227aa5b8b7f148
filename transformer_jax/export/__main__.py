"""Export a trained model for serving: a CTranslate2 model directory or a Hugging Face Marian or M2M-100 / NLLB-200
folder.

    python -m transformer_jax.export --workdir DIR --format ctranslate2|marian|m2m100 --output OUT [--config C]
        [--checkpoint latest|best|STEP] [--average_last N | --average_steps A,B | --average_best K] [--force]
        [--quantization none|int8|int8_float32|bfloat16]     (ctranslate2 only)

The checkpoints are chosen and averaged as evaluate.py chooses them (the same flags and defaults). OUT appears whole
or not at all, and replaces an existing directory only with --force and only if it is an earlier export of the
same format (transformer_jax.interop). A model the format cannot express, a workdir without checkpoints or an
existing OUT: one line on stderr, exit status 1. A model.norm_epsilon other than transformers' 1e-5 exports to
Marian or M2M-100 with one warning line on stderr stating the largest logit difference it makes.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from absl import flags

from transformer_jax import cli
from transformer_jax.errors import EvalError
from transformer_jax.evaluation import command
from transformer_jax.interop import ctranslate2, m2m100_export, marian_folder

PROG = "python -m transformer_jax.export"
FLAGS = flags.FLAGS
command.define_checkpoint_flags()  # evaluate.py's: same names, defaults and meaning
EXPORTERS = {
    "ctranslate2": ctranslate2.export_workdir,
    "marian": marian_folder.export_workdir,
    m2m100_export.FORMAT: m2m100_export.export_workdir,
}
NAMES = {"marian": "Marian", m2m100_export.FORMAT: "M2M-100"}  # transformers' classes, in messages
flags.DEFINE_enum("format", "ctranslate2", list(EXPORTERS), "Inference engine or format to export to.")
flags.DEFINE_string("output", None, "Model directory to write (must not exist, unless --force).")
flags.DEFINE_enum(
    "quantization",
    "none",
    ["none", *ctranslate2.QUANTIZATIONS],
    "--format ctranslate2: weight type in model.bin, none (float32) or CTranslate2's.",
)
flags.DEFINE_bool("force", False, "Replace an existing --output directory that holds an earlier export.")
flags.mark_flags_as_required(["workdir", "output"])


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (cli.run refuses them)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs each checkpoint handler it creates at INFO
    options = {"quantization": None if FLAGS.quantization == "none" else FLAGS.quantization}
    if FLAGS.format != "ctranslate2":
        if options.pop("quantization") is not None:
            raise EvalError(f"--quantization is CTranslate2's: --format {FLAGS.format} writes float32 weights")
    choice = command.choice_of(FLAGS.flag_values_dict())
    report = EXPORTERS[FLAGS.format](
        FLAGS.workdir, FLAGS.output, config=FLAGS.config, choice=choice, force=FLAGS.force, **options
    )
    if "epsilon_logit_difference" in report:
        print(
            f"{PROG}: warning: model.norm_epsilon={report['norm_epsilon']} but transformers' "
            f"{NAMES[FLAGS.format]} uses 1e-5; "
            f"the exported model's logits differ by up to {report['epsilon_logit_difference']:.3g} on "
            f"{len(marian_folder.SAMPLE_SENTENCES)} sentences",
            file=sys.stderr,
        )
    print(json.dumps(report))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cli.run(main, PROG)
