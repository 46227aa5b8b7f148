"""Translate with a trained model and score, or score existing translations.

Scores only (no model):
    python evaluate.py --hypotheses_file H --references_file R
prints sacreBLEU BLEU (with its signature), chrF and the paper-comparable tokenized BLEU, two decimals each.

Compare two systems (no model):
    python evaluate.py --hypotheses_file A --compare_file B --references_file R
prints the three scores of A and of the baseline B, each with its bootstrap mean and 95% confidence interval, and the
p-value of their difference: sacreBLEU's paired bootstrap test (1000 resamples, seed SACREBLEU_SEED or 12345), the
numbers `sacrebleu R -i B A -m bleu chrf --paired-bs` prints.

Translate and score:
    python evaluate.py --workdir DIR [--config C] [--checkpoint latest|STEP] [--average_last N | --average_steps A,B]
        [--split valid|test | --source_file F [--references_file R]] [--beam_size B --alpha A] [--output_file O]
restores the parameters (the mean of the last N checkpoints up to --checkpoint; N defaults to config.eval.average_last),
decodes with beam search, writes one detokenized hypothesis per input line (empty line -> empty line), and prints
and writes a JSON report with the scores, the checkpoint steps and the decoding settings. `--source_file -` reads
stdin and writes each translation as soon as its line is read. Every line is kept, blank ones too (a blank source
gives an empty hypothesis, scored against its reference as the sacrebleu command scores it), and the report counts
them. Bad flag values, an output that would overwrite an input, an output location that cannot be written, input
that is not UTF-8 or has no lines: each stops the program with one line before the model is restored.

Decoding modes (docs/decoding.md): --length_penalty gnmt|average|none, --finished in_beam|set_aside (what beam search
does with a hypothesis that ends: keeps it among its beams, or sets it aside as CTranslate2 does), --nbest N
(OUTPUT_FILE.nbest), --score
(forced decoding of --source_file/--references_file), --prefix_file P, --sampling [--temperature --top_k --top_p
--num_samples --seed], --ensemble_workdirs B,C, --mbr N [--mbr_utility bleu|chrf].
"""

from __future__ import annotations

import logging
import os

from absl import flags

from transformer_jax import cli
from transformer_jax.evaluation import checkpoint_flags
from transformer_jax.evaluation.options import Options
from transformer_jax.evaluation.run import evaluate

FLAGS = flags.FLAGS
checkpoint_flags.define()  # --config --workdir --checkpoint --average_last --average_steps, shared with the export
flags.DEFINE_enum("split", "test", ["valid", "test"], "Split of the configured data to translate.")
flags.DEFINE_string("source_file", None, "Translate this file (one sentence a line; '-' = stdin) instead of --split.")
flags.DEFINE_string("references_file", None, "References, one a line, for --source_file or --hypotheses_file.")
flags.DEFINE_string("hypotheses_file", None, "Score this file against --references_file; no model is loaded.")
flags.DEFINE_string(
    "compare_file", None, "With --hypotheses_file: the baseline system's translations; paired bootstrap test."
)
flags.DEFINE_integer("beam_size", None, "Beams (default config.eval.beam_size); 1 is greedy search.")
flags.DEFINE_float("alpha", None, "Length penalty exponent (default config.eval.alpha).")
flags.DEFINE_integer("max_extra_len", None, "Output tokens beyond the input length (default config.eval).")
flags.DEFINE_integer("batch_size", None, "Sentences per decoding batch (default config.eval.batch_size).")
flags.DEFINE_string("output_file", None, "Hypotheses file; default WORKDIR/eval/<name>.<steps>.txt (stdin: stdout).")
flags.DEFINE_string("scores_file", None, "JSON report; default OUTPUT_FILE.json.")
flags.DEFINE_string("length_penalty", None, "Score normalisation: gnmt (default), average (score / len^alpha), none.")
flags.DEFINE_string(
    "finished", None, "Beam search: in_beam (default: ended hypotheses keep a beam) or set_aside (CTranslate2's rule)."
)
flags.DEFINE_string("prefix_file", None, "Line i's translation starts with line i of this file (empty line: none).")
flags.DEFINE_bool("sampling", False, "Draw translations from the model instead of searching (beam size 1).")
flags.DEFINE_float("temperature", None, "--sampling: divide the logits by this (> 0; default 1).")
flags.DEFINE_integer("top_k", None, "--sampling: draw among the k most probable tokens (default 0: all).")
flags.DEFINE_float("top_p", None, "--sampling: draw from the smallest set holding this probability (default 1).")
flags.DEFINE_integer("num_samples", None, "--sampling: samples per line (default 1); more go to OUTPUT_FILE.nbest.")
flags.DEFINE_integer("seed", None, "--sampling: the seed (default 0); a line's samples depend on it and the line only.")
flags.DEFINE_integer("mbr", None, "Choose among N candidates (the N-best, or N samples) by expected utility (MBR).")
flags.DEFINE_string("mbr_utility", None, "--mbr: the utility, bleu (default) or chrf.")
flags.DEFINE_list("ensemble_workdirs", None, "More workdirs whose models decode with --workdir's (one tokenizer).")
flags.DEFINE_bool("score", False, "Forced decoding: log P(reference | source) per line and the perplexity.")
flags.DEFINE_integer("nbest", None, "Also write each line's N (<= beam) best to OUTPUT_FILE.nbest (Marian format).")


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (transformer_jax.cli.run refuses them)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs each checkpoint handler it creates at INFO
    # Every value is checked in one place, options.check_options, before any file is read or the model restored.
    options = Options(
        **checkpoint_flags.selection(),
        split=FLAGS.split if FLAGS["split"].present else None,  # None: test, unless --source_file
        source_file=FLAGS.source_file,
        references_file=FLAGS.references_file,
        hypotheses_file=FLAGS.hypotheses_file,
        compare_file=FLAGS.compare_file,
        beam_size=FLAGS.beam_size,
        alpha=FLAGS.alpha,
        max_extra_len=FLAGS.max_extra_len,
        batch_size=FLAGS.batch_size,
        output_file=FLAGS.output_file,
        scores_file=FLAGS.scores_file,
        length_penalty=FLAGS.length_penalty,
        finished=FLAGS.finished,
        nbest=FLAGS.nbest,
        prefix_file=FLAGS.prefix_file,
        sampling=FLAGS.sampling,
        temperature=FLAGS.temperature,
        top_k=FLAGS.top_k,
        top_p=FLAGS.top_p,
        num_samples=FLAGS.num_samples,
        seed=FLAGS.seed,
        mbr=FLAGS.mbr,
        mbr_utility=FLAGS.mbr_utility,
        ensemble_workdirs=FLAGS.ensemble_workdirs,
        score=FLAGS.score,
    )
    evaluate(options)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cli.run(main, "evaluate.py")
