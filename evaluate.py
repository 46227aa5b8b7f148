"""Translate with a trained model and score, or score existing translations.

Scores only (no model):
    python evaluate.py --hypotheses_file H --references_file R
prints sacreBLEU BLEU (with its signature), chrF and the paper-comparable tokenized BLEU, two decimals each.

Compare two systems (no model):
    python evaluate.py --hypotheses_file A --compare_file B --references_file R
prints the three scores of A and of the baseline B, each with its bootstrap mean and 95% confidence interval, and the
p-value of their difference: sacreBLEU's paired bootstrap test (1000 resamples, seed SACREBLEU_SEED or 12345), the
numbers `sacrebleu R -i B A -m bleu chrf --paired-bs` prints. Without a model there is no default report file: the
scores modes write their JSON report only to a given --scores_file.

Translate and score:
    python evaluate.py --workdir DIR [--config C] [--checkpoint latest|STEP] [--average_last N | --average_steps A,B]
        [--split valid|test | --source_file F [--references_file R]] [--beam_size B --alpha A] [--output_file O]
restores the parameters (the mean of the last N checkpoints up to --checkpoint; N defaults to config.eval.average_last),
decodes with beam search, writes one detokenized hypothesis per input line (empty line -> empty line) and a JSON report
with the scores, the checkpoint steps and the decoding settings (--scores_file, default OUTPUT_FILE.json), and prints
a few summary lines. `--source_file -` reads stdin and writes each translation as soon as its line is read (to stdout
without --output_file; the summary then goes to stderr and the report to WORKDIR/eval/stdin.<steps>.json).

Every line is kept, blank ones too (a blank source gives an empty hypothesis, scored against its reference as the
sacrebleu command scores it), and the report counts them. Bad flag values, an output that would overwrite an input,
an output location that cannot be written, input that is not UTF-8 or has no lines: each stops the program with one
line before the model is restored.

--json prints the JSON report on stdout, in every mode (the summary lines go to stderr); the report file is written
as without it.

A multilingual model's language matrix (docs/usage.md, "The language matrix"):
    python evaluate.py --workdir DIR --directions all|SRC-TGT,... [--split S --text_dir T --pivot en --output_dir O]
translates every direction between the languages of T's {S}.{lang} files in one search and prints tables of BLEU/chrF
and the off-target rate (zero-shot directions marked); writes each direction's outputs, report.json, meta.json and
heatmap.png in O (default WORKDIR/eval/matrix.<split>.<steps>/).

Decoding modes (docs/decoding.md): --length_penalty, --finished (what beam search does with a hypothesis that ends:
keeps it among its beams, or sets it aside as CTranslate2 does), --nbest N (OUTPUT_FILE.nbest), --score (forced
decoding of --source_file/--references_file), --prefix_file P, --sampling [--temperature --top_k --top_p
--num_samples --seed], --ensemble_workdirs B,C, --mbr N [--mbr_utility]. `python evaluate.py --help` lists every
flag with its allowed values and default (one table: evaluation.command.FLAGS).
"""

from __future__ import annotations

# The command line is evaluation/command.py's, also `python -m transformer_jax.evaluation`.
from transformer_jax.evaluation.command import run_command

if __name__ == "__main__":
    run_command("evaluate.py")
