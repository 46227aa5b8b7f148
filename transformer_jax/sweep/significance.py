"""Is a sweep variant's change real, and does it go the paper's way? Columns of the sweep's results.

For BLEU and chrF each variant is tested against the first variant (the base row) with sacreBLEU's paired bootstrap
over the sentences of the reported split (`evaluation.significance.pooled_paired_bootstrap`), on the hypotheses each
finished run stored (DIR/NAME[/seedI]/valid.hyp, or test.hyp against the test references with `--split test`), so
`--aggregate_only` recomputes it without decoding.

Several seeds: we use the per-seed hypotheses, not a seed-averaged system. Seed i of the variant is paired with
seed i of the base (they share the initialisation seed and data order), the seeds finished in both are pooled, and
each test sentence is one resampled item carrying all those seeds' translations of it; the tested score is the
corpus score of all paired seeds' outputs together. A seed-averaged system does not exist as a translation: the
parameters of independently initialised models cannot be averaged, and an ensemble would be another (slower)
system than the ones the table reports. Resampling sentences with their seeds keeps the test honest about the one
source of chance it resamples, the test sentences; the spread between seeds is what the Welch interval over
seeds (sweep/results.py) reports.

Columns: bleu_p, chrf_p (sacreBLEU's p-value; 1.0 where the two systems wrote identical lines, for which sacreBLEU
prints its smallest p), paired_seeds (how many seeds were paired), and, when the config gives the paper's numbers,
paper_direction: "yes" / "no" / "not significant" / "untested", and paper_direction_by: the metric it used. That is
BLEU wherever the paper gives a BLEU and our BLEU was tested (significant: p < 0.05 and, when both sides have two
finished seeds, the Welch 95% interval of Δ BLEU over seeds excludes 0: the bootstrap alone ignores how much a
retrained model moves, so on the Multi30k Table 3 sweep it gave p = 0.001 to BLEU changes of 0.4-1 whose seed
intervals straddle 0); a row with only a paper perplexity uses perplexity (significant: the Welch 95% interval of
Δ perplexity excludes 0, which needs two finished seeds on both sides; "untested" otherwise). A significant change
against a paper change of exactly 0 is "no". The paper's numbers are validation numbers: the test split's results have
no paper_direction.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

from transformer_jax.errors import ScoreError
from transformer_jax.evaluation import bleu
from transformer_jax.evaluation.run import split_pairs
from transformer_jax.evaluation.significance import pooled_paired_bootstrap
from transformer_jax.sweep.splits import Split

ALPHA = 0.05  # a p-value below this marks a row
TESTED = ("bleu", "chrf")
MARK = "†"  # results.md's mark of p < ALPHA


def direction(ours: float, paper: float, significant: bool) -> str:
    """'not significant', or whether our significant change has the sign of the paper's ('no' if the paper's is 0)."""
    if not significant:
        return "not significant"
    return "yes" if ours * paper > 0 else "no"


def format_p(p: Any) -> str:
    """A results.md cell: the p-value, marked when below ALPHA; empty when there was no test."""
    if p == "":
        return ""
    return f"{p:.3f} {MARK}" if p < ALPHA else f"{p:.3f}"


def compare_runs(
    base_runs: Sequence[pathlib.Path | None],
    variant_runs: Sequence[pathlib.Path | None],
    references: list[str],
    split: Split,
) -> dict[str, Any]:
    """bleu_p, chrf_p, paired_seeds and bleu_difference (pooled score minus the base's) of one variant on the split.

    `*_runs[i]` is seed i's run directory, or None where that seed has not finished (trained and decoded on the
    split). Nothing to pair: empty values.
    """
    pairs = [(b, v) for b, v in zip(base_runs, variant_runs, strict=True) if b is not None and v is not None]
    if not pairs:
        return {"bleu_p": "", "chrf_p": "", "paired_seeds": 0, "bleu_difference": ""}
    lines: dict[pathlib.Path, list[str]] = {}
    for directory in {d for pair in pairs for d in pair}:
        path = directory / split.hypotheses_file
        lines[directory] = bleu.read_lines(path)
        if len(lines[directory]) != len(references):
            raise ScoreError(
                f"{path} has {len(lines[directory])} lines, the {split.description} split {len(references)}; delete "
                f"{directory / split.scores_file} and run the sweep again to decode it anew"
            )
    result = pooled_paired_bootstrap([lines[b] for b, _ in pairs], [lines[v] for _, v in pairs], references)
    row: dict[str, Any] = {"paired_seeds": len(pairs)}
    for key in TESTED:
        # sacreBLEU gives identical outputs its smallest p; identical outputs differ by nothing, so p is 1.
        row[key + "_p"] = 1.0 if result["identical_outputs"] else round(result[key]["p_value"], 4)
    row["bleu_difference"] = result["bleu"]["system"]["score"] - result["bleu"]["baseline"]["score"]
    return row


def paper_direction(row: dict[str, Any], base: dict[str, Any], bleu_difference: Any) -> tuple[str, str]:
    """(verdict, metric) of the paper_direction columns for a variant's row; ('', '') with no paper numbers."""
    paper_bleu = (row.get("ref_valid_bleu", ""), base.get("ref_valid_bleu", ""))
    if "" not in paper_bleu and row.get("bleu_p", "") != "":
        # The bootstrap resamples sentences, not training runs: with 3 seeds x 1,014 sentences it calls a 0.4 BLEU
        # change significant that the seeds' own spread does not support. Both must hold where seeds allow it.
        low, high = row.get("delta_valid_bleu_ci95_low", ""), row.get("delta_valid_bleu_ci95_high", "")
        seeds_agree = low == "" or not low <= 0 <= high
        significant = row["bleu_p"] < ALPHA and seeds_agree
        return direction(bleu_difference, paper_bleu[0] - paper_bleu[1], significant), "bleu"
    paper_ppl = (row.get("ref_valid_perplexity", ""), base.get("ref_valid_perplexity", ""))
    if "" in paper_ppl:
        return "", ""
    low, high = row.get("delta_valid_perplexity_ci95_low", ""), row.get("delta_valid_perplexity_ci95_high", "")
    ours = row.get("delta_valid_perplexity", "")
    if low == "" or ours == "":
        return "untested", "perplexity"
    return direction(ours, paper_ppl[0] - paper_ppl[1], not low <= 0 <= high), "perplexity"


def add_significance(
    rows: list[dict[str, Any]],
    finished: Sequence[Sequence[pathlib.Path | None]],
    references: Sequence[list[str] | None],
    split: Split,
) -> list[dict[str, Any]]:
    """The rows with the test and direction columns; rows[0] is the base.

    `finished[v][i]`: the directory of variant v's seed i if it finished (trained and decoded on the split), else
    None. `references[v]`: variant v's references of the split (None: not read, as no run of it finished). A
    variant scored on other sentences than the base gets no test.
    """
    out = []
    for i, (row, runs, refs) in enumerate(zip(rows, finished, references, strict=True)):
        row = dict(row)
        test = {"bleu_p": "", "chrf_p": "", "paired_seeds": "", "bleu_difference": ""}
        if i > 0 and refs is not None and refs == references[0]:
            test = compare_runs(finished[0], runs, refs, split)
        difference = test.pop("bleu_difference")
        row.update(test)
        # Nothing to judge for the base itself, before both sides have a finished run, or on another split than the
        # paper's numbers.
        judged = split.published and i > 0 and any(runs) and any(finished[0])
        row["paper_direction"], row["paper_direction_by"] = (
            paper_direction(row, rows[0], difference) if judged else ("", "")
        )
        out.append(row)
    return out


def references_of(config, split: Split) -> list[str]:
    """The references of the split of a config's data, as the sweep's decoding scored them."""
    return split_pairs(config, split.name)[1]
