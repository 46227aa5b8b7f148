"""Translate a corpus with a trained model, in chunks that survive a stop or a kill:

    python -m transformer_jax.translate_corpus --workdir W --input FILE --output OUT [--chunk_lines 1000] [--streams N]
        [--checkpoint latest|best|STEP] [--average_last N | --average_steps A,B | --average_best K]
        [--ensemble_workdirs B,C] [--beam_size B --alpha A ...] [--sampling --seed S --temperature T ...]
        [--engine jax|ctranslate2]

Line i of OUT translates line i of FILE (a line break in a translation, such as a sampled byte piece, is written as
a space: data/tokenizer.one_line; a blank line gives an empty line; a line longer than data.eval_max_len
tokens is cut, as evaluate.py does; input that is not UTF-8 stops the program in one line naming the line). OUT.scores
has one line per line: `log_prob<TAB>score`, the model's log P(output | source) summed over the output's tokens (EOS
included) and the search's length-normalised score, log_prob / lp(length) (--length_penalty, --alpha); `nan` for a
blank source, which is not decoded. The checkpoint, search and sampling flags are evaluate.py's (one table:
evaluation.command.FLAGS), with the same defaults.

The work is committed to OUT.parts/ one chunk of --chunk_lines lines at a time; a stopped or killed run, started
again with the same flags, continues where it stopped, and the finished OUT and OUT.scores equal an uninterrupted
run's byte for byte (sampling keys come from --seed and each line's number, not from the order of work). A resume
with another input or other flags is refused in one line; a damaged chunk is redone. When all chunks are there,
OUT and OUT.scores are written and OUT.parts is removed. Every local device decodes its own chunks, --streams of
them at once (by default run.CPU_STREAMS on a CPU, where concurrent searches use the cores that one search leaves
idle, and 1 on an accelerator); with several hosts (one process each, as train.py), each host takes every
process_count-th chunk and process 0 writes OUT. A JSON report goes to stdout; a progress bar (lines/s, ETA) to stderr.

--engine ctranslate2: the same checkpoints, exported once into OUT.parts/ctranslate2 (interop/ctranslate2.py), decode
the chunks on CTranslate2 (its device "auto"), with our sources, limits and language tokens: greedy OUT equals
--engine jax's; OUT.scores sums the engine's score_batch log-probabilities (EOS included, a forced language token
left out, as ours) and divides by our length penalty. Beam search only by CTranslate2's rules (--length_penalty
average --finished set_aside); sampling, ensembles and --streams are refused in one line.
"""

from __future__ import annotations

import json
import logging
import os

from absl import flags

from transformer_jax import cli
from transformer_jax.evaluation import command
from transformer_jax.sharding import initialize_distributed
from transformer_jax.translate_corpus import run

PROG = "python -m transformer_jax.translate_corpus"
FLAGS = flags.FLAGS

command.define(FLAGS, run.DECODING_FLAGS)  # evaluate.py's flags: same names, defaults and meaning
flags.DEFINE_string("input", None, "The file to translate, one sentence a line (UTF-8).")
flags.DEFINE_string("output", None, "The translations, one a line; OUTPUT.scores and OUTPUT.parts/ beside it.")
flags.DEFINE_integer(
    "chunk_lines", run.DEFAULT_CHUNK_LINES, "Lines per committed chunk (a resume redoes at most one per stream)."
)
flags.DEFINE_integer("streams", 0, f"Chunks each device decodes at once ({run.STREAMS_ZERO}).")
flags.DEFINE_enum("engine", run.JAX, list(run.ENGINES), "What decodes: our search, or CTranslate2 on an export.")


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (cli.run refuses them)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs each checkpoint handler it creates at INFO
    values = {name: FLAGS[name].value for name in run.FLAG_NAMES}
    job = run.job_of(values, FLAGS.input, FLAGS.output, FLAGS.chunk_lines, FLAGS.streams, FLAGS.engine)
    initialize_distributed()
    report = run.translate_corpus(job, progress=True)
    print(json.dumps(report))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cli.run(main, PROG)
