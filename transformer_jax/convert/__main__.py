"""Convert a local Hugging Face folder into a workdir of ours (see docs/pretrained.md).

    python -m transformer_jax.convert --from_hf DIR --workdir W [--allow_pickle]
    python -m transformer_jax.convert --from_marian DIR --workdir W [--allow_pickle]

--from_hf picks the family from DIR/config.json's model_type: marian (OPUS-MT) or m2m_100 (M2M-100 and the dense
NLLB-200 models); --from_marian reads a Marian folder. W then holds config.json, the tokenizer files and a step-0
checkpoint, for evaluate.py and train.init_from. A folder that cannot be converted, or a non-empty W: one line on
stderr, exit status 1, nothing left behind.
"""

from __future__ import annotations

import json
import logging
import os

from absl import flags

from transformer_jax import cli
from transformer_jax.convert import FAMILIES, read_hf_folder
from transformer_jax.interop import marian_folder

PROG = "python -m transformer_jax.convert"
FLAGS = flags.FLAGS
flags.DEFINE_string("from_hf", None, f"Local Hugging Face folder of a {' or '.join(FAMILIES)} model.")
flags.DEFINE_string("from_marian", None, "Local Hugging Face Marian folder (config.json, model.safetensors, ...).")
flags.DEFINE_string("workdir", None, "Workdir to create (must not exist, or be empty).")
flags.DEFINE_bool("allow_pickle", False, "Read pytorch_model.bin (a pickle: it can run code; needs torch).")
flags.mark_flags_as_required(["workdir"])
flags.mark_flags_as_mutual_exclusive(["from_hf", "from_marian"], required=True)


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (cli.run refuses them)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs each checkpoint handler it creates at INFO
    marian_folder.check_workdir(FLAGS.workdir)  # before the folder is read
    if FLAGS.from_marian:
        folder = marian_folder.read_folder(FLAGS.from_marian, allow_pickle=FLAGS.allow_pickle)
    else:
        folder = read_hf_folder(FLAGS.from_hf, allow_pickle=FLAGS.allow_pickle)
    print(json.dumps(marian_folder.write_workdir(folder, FLAGS.workdir)))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cli.run(main, PROG)
