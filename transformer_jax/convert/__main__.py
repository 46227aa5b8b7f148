"""Convert a local Hugging Face Marian (OPUS-MT) folder into a workdir of ours.

    python -m transformer_jax.convert --from_marian DIR --workdir W [--allow_pickle]

W then holds config.json, the tokenizer (source.spm, target.spm, vocab.json[, target_vocab.json]) and a step-0
checkpoint of the model's parameters: `evaluate.py --workdir W` translates with our search and `train.init_from=W`
fine-tunes into a workdir of its own (see docs/pretrained.md). A folder that is not a Marian model, a missing or
inconsistent file, or a non-empty W: one line on stderr, exit status 1, and nothing left behind. Prints a JSON
report.
"""

from __future__ import annotations

import json
import logging
import os

from absl import flags

from transformer_jax import cli
from transformer_jax.convert import folder

PROG = "python -m transformer_jax.convert"
FLAGS = flags.FLAGS
flags.DEFINE_string("from_marian", None, "Local Hugging Face Marian folder (config.json, model.safetensors, ...).")
flags.DEFINE_string("workdir", None, "Workdir to create (must not exist, or be empty).")
flags.DEFINE_bool("allow_pickle", False, "Read pytorch_model.bin (a pickle: it can run code; needs torch).")
flags.mark_flags_as_required(["from_marian", "workdir"])


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (cli.run refuses them)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs each checkpoint handler it creates at INFO
    folder.check_workdir(FLAGS.workdir)  # before the folder is read
    marian_folder = folder.read_folder(FLAGS.from_marian, allow_pickle=FLAGS.allow_pickle)
    print(json.dumps(folder.write_workdir(marian_folder, FLAGS.workdir)))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cli.run(main, PROG)
