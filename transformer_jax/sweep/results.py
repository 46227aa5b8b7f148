"""A sweep's results (docs/usage.md, "Sweeps and ablations"): one row per variant in DIR/results.csv, .md and .png
(results_test.* for --split test), the split they report, and each variant's significance against the first.

Scores come from each finished run's stored translation of the whole split (valid.hyp and valid_scores.json, or
test.*), so the results are rebuilt without decoding; perplexity is training's last validation perplexity, whichever
split is reported. With several seeds only finished runs (trained and decoded) count: a row holds each metric's
mean, sample standard deviation (ddof=1) and number of seeds, and for perplexity, BLEU and chrF the change Δ from
the first variant with Welch's t 95% interval (unequal variances and seed counts; it ignores that seed i of two
variants shares init and data order, so it is conservative).

Significance (bleu_p, chrf_p, paired_seeds): sacreBLEU's paired bootstrap over the split's sentences on the stored
hypotheses, seed i paired with the base's seed i and each sentence resampled with all its seeds' translations
(`evaluation.significance.pooled_paired_bootstrap`; a seed-averaged system does not exist as a translation). It
resamples sentences, not training runs, so paper_direction (whether a significant change has the paper's sign) by
BLEU also needs the Welch interval of Δ BLEU to exclude 0 where both sides have two seeds: on the Multi30k Table 3
sweep the bootstrap alone gave p = 0.001 to BLEU changes of 0.4-1 whose seed intervals straddle 0. A row with only a
paper perplexity is judged by the Welch interval of Δ perplexity. The paper's numbers are validation numbers.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import pathlib
import statistics
from collections.abc import Sequence
from typing import Any

from transformer_jax.errors import ScoreError
from transformer_jax.evaluation.significance import pooled_paired_bootstrap
from transformer_jax.evaluation.translate import read_lines
from transformer_jax.model import parameter_count
from transformer_jax.training.metrics import read_metrics

PERPLEXITY = "valid_perplexity"  # from training's last validation: the same column whichever split is reported
SCORE_KEYS = ("bleu", "chrf", "chrfpp", "ter")  # keys of evaluate.py's report; ter is lower-better, the rest higher
TIMING = ("tokens_per_s", "wall_s")


@dataclasses.dataclass(frozen=True)
class Split:
    """A split of the config's data (evaluate.py's --split) as a sweep decodes and reports it (--split), and every
    file and column name that follows from it."""

    name: str  # "valid" or "test"
    description: str  # in messages and results.md: "the validation split"

    @property
    def hypotheses_file(self) -> str:  # a finished run's translation of the whole split, in its run directory
        return f"{self.name}.hyp"

    @property
    def scores_file(self) -> str:  # evaluate.py's report on the hypotheses; written last, so it means decoded
        return f"{self.name}_scores.json"

    @property
    def results_name(self) -> str:  # DIR/<results_name>.csv, .md and .png
        return "results" if self.name == "valid" else f"results_{self.name}"

    @property
    def scores(self) -> dict[str, str]:  # results column -> key of the scores report
        return {f"{self.name}_{key}": key for key in SCORE_KEYS}

    @property
    def metrics(self) -> tuple[str, ...]:  # the columns averaged over seeds
        return (PERPLEXITY, *self.scores, *TIMING)

    @property
    def delta_metrics(self) -> tuple[str, ...]:  # the columns compared with the first variant over seeds
        return (PERPLEXITY, f"{self.name}_bleu", f"{self.name}_chrf")

    @property
    def published(self) -> bool:  # the config's published numbers are validation numbers
        return self.name == "valid"

    @property
    def decodes(self) -> tuple[Split, ...]:
        """The splits a run is decoded on for these results: always validation, then this one."""
        return (VALID,) if self == VALID else (VALID, self)  # ==: a job gets an unpickled copy


VALID = Split("valid", "validation")
TEST = Split("test", "test")
SPLITS = {s.name: s for s in (VALID, TEST)}

RESULT_FILE = "sweep_result.json"  # written when a run's training finished
REFERENCE_METRICS = (PERPLEXITY, f"{VALID.name}_bleu")  # published numbers are validation numbers
CONFIDENCE = 0.95
ALPHA = 0.05  # a p-value below this marks a row
MARK = "†"  # results.md's mark of p < ALPHA


def decoded(run_dir: pathlib.Path, split: Split) -> bool:
    """Whether the run finished training and its last checkpoint's translation of the split is stored."""
    result, scores = run_dir / RESULT_FILE, run_dir / split.scores_file
    if not (result.exists() and scores.exists() and (run_dir / split.hypotheses_file).exists()):
        return False
    # A run trained further after it was decoded (a larger train.num_steps) needs decoding again.
    steps = json.loads(result.read_text())["num_steps"]
    return json.loads(scores.read_text()).get("checkpoint_steps") == [steps]


def run_metrics(run_dir: pathlib.Path, split: Split) -> dict[str, Any]:
    """steps, valid_perplexity, the split's sacreBLEU scores (split.scores), tokens_per_s, wall_s of one run
    directory ("" where absent) and finished (trained and decoded on the split)."""
    row: dict[str, Any] = {key: "" for key in ("steps", PERPLEXITY, *split.scores, *TIMING)}
    metrics_file = run_dir / "metrics.jsonl"
    if metrics_file.exists():
        records = read_metrics(metrics_file)
        train = [r for r in records if "tokens_per_s" in r]
        if train:
            row["steps"] = train[-1]["step"]
            row["tokens_per_s"] = round(sum(r["tokens_per_s"] for r in train) / len(train), 1)
        found = [r[PERPLEXITY] for r in records if PERPLEXITY in r]
        if found:
            row[PERPLEXITY] = round(found[-1], 2)
    row["finished"] = decoded(run_dir, split)
    if row["finished"]:
        scores = json.loads((run_dir / split.scores_file).read_text())["scores"]
        for column, key in split.scores.items():
            if key in scores:  # a run decoded before chrF++ and TER were reported lacks them
                row[column] = round(scores[key]["score"], 2)
        row["wall_s"] = round(json.loads((run_dir / RESULT_FILE).read_text())["wall_s"], 1)
    return row


def describe(variant: Any) -> dict[str, Any]:
    """The columns that name a variant (runner.Variant): variant, overrides, parameters."""
    overrides = " ".join(f"{k}={v}" for k, v in variant.overrides.items()) or "(none)"
    return {"variant": variant.name, "overrides": overrides, "parameters": parameter_count(variant.config)}


def reference_columns(variant: Any) -> dict[str, Any]:
    """The ref_* columns: the variant's published numbers ("" where the config gives none)."""
    return {"ref_" + key: variant.reference.get(key, "") for key in REFERENCE_METRICS}


def summarize_variant(variant: Any, run_dir: pathlib.Path, split: Split) -> dict[str, Any]:
    """One results row from a variant's directory (empty fields where it has not run): the one-seed layout."""
    metrics = run_metrics(run_dir, split)
    del metrics["finished"]
    return {**describe(variant), **metrics, **reference_columns(variant)}


def welch_interval(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Welch's t interval for mean(a) - mean(b): Δ ± t_{(1+c)/2, ν} · sqrt(s_a²/n_a + s_b²/n_b), ν by
    Welch–Satterthwaite. Both samples need at least two values (ValueError otherwise)."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"Welch's interval needs two values per sample; got {len(a)} and {len(b)}")
    delta = statistics.fmean(a) - statistics.fmean(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return delta, delta
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    from scipy import stats  # here: a slow import, for the one quantile of a sweep with seeds

    half = float(stats.t.ppf((1 + confidence) / 2, dof)) * math.sqrt(va + vb)
    return delta - half, delta + half


def aggregate_seeds(variants: Sequence[dict[str, Any]], num_seeds: int, split: Split) -> list[dict[str, Any]]:
    """Rows of mean, standard deviation and number of seeds per metric, and Δ against the first variant. Each entry
    of `variants`: describe()'s and reference_columns()'s keys, and "runs": one run_metrics() dict per seed (a run
    that did not finish counts as missing, whatever its metrics file holds so far)."""
    samples = []
    for v in variants:
        finished = [r for r in v["runs"] if r["finished"]]
        samples.append({m: [float(r[m]) for r in finished if r[m] != ""] for m in split.metrics})
    rows = []
    for v, sample in zip(variants, samples, strict=True):
        finished = [i for i, r in enumerate(v["runs"]) if r["finished"]]
        row: dict[str, Any] = {
            "variant": v["variant"],
            "overrides": v["overrides"],
            "parameters": v["parameters"],
            "n_seeds": len(finished),
            "seeds": num_seeds,
            "missing_seeds": " ".join(str(i) for i in range(num_seeds) if i not in finished),
        }
        for m in split.metrics:
            values = sample[m]
            row[m] = round(statistics.fmean(values), 4) if values else ""
            row[m + "_std"] = round(statistics.stdev(values), 4) if len(values) > 1 else ""
        for m in split.delta_metrics:
            base = samples[0][m]
            row["delta_" + m] = (
                round(statistics.fmean(sample[m]) - statistics.fmean(base), 4) if base and sample[m] else ""
            )
            low = high = ""
            if v is not variants[0] and len(base) > 1 and len(sample[m]) > 1:
                low, high = (round(x, 4) for x in welch_interval(sample[m], base))
            row[f"delta_{m}_ci95_low"], row[f"delta_{m}_ci95_high"] = low, high
        for key in REFERENCE_METRICS:
            row["ref_" + key] = v.get("ref_" + key, "")
        rows.append(row)
    return rows


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
    """bleu_p, chrf_p, paired_seeds and bleu_difference (pooled score minus the base's) of one variant on the split;
    `*_runs[i]` is seed i's run directory, or None where that seed has not finished. Nothing to pair: empty values."""
    pairs = [(b, v) for b, v in zip(base_runs, variant_runs, strict=True) if b is not None and v is not None]
    if not pairs:
        return {"bleu_p": "", "chrf_p": "", "paired_seeds": 0, "bleu_difference": ""}
    lines: dict[pathlib.Path, list[str]] = {}
    for directory in {d for pair in pairs for d in pair}:
        path = directory / split.hypotheses_file
        lines[directory] = read_lines(path)
        if len(lines[directory]) != len(references):
            raise ScoreError(
                f"{path} has {len(lines[directory])} lines, the {split.description} split {len(references)}; delete "
                f"{directory / split.scores_file} and run the sweep again to decode it anew"
            )
    result = pooled_paired_bootstrap([lines[b] for b, _ in pairs], [lines[v] for _, v in pairs], references)
    row: dict[str, Any] = {"paired_seeds": len(pairs)}
    for key in ("bleu", "chrf"):
        # sacreBLEU gives identical outputs its smallest p; identical outputs differ by nothing, so p is 1.
        row[key + "_p"] = 1.0 if result["identical_outputs"] else round(result[key]["p_value"], 4)
    row["bleu_difference"] = result["bleu"]["system"]["score"] - result["bleu"]["baseline"]["score"]
    return row


def paper_direction(row: dict[str, Any], base: dict[str, Any], bleu_difference: Any) -> tuple[str, str]:
    """(verdict, metric) of the paper_direction columns for a variant's row; ('', '') with no paper numbers."""
    paper_bleu = (row.get("ref_valid_bleu", ""), base.get("ref_valid_bleu", ""))
    if "" not in paper_bleu and row.get("bleu_p", "") != "":
        # The bootstrap resamples sentences, not training runs: both must hold where seeds allow it.
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


def _markdown(rows: list[dict], columns: list[str], split: Split) -> list[str]:
    """The results table; several seeds: "mean ± std" cells, "2 of 3 *" for a row with seeds missing, Δ [CI]. The
    test columns (p-values marked below ALPHA; the paper_direction verdict with its metric) read the same in both."""
    tests = "bleu_p" in columns
    verdicts = "paper_direction" in columns
    hidden = {"bleu_p", "chrf_p", "paired_seeds", "paper_direction", "paper_direction_by"}

    def test_cells(r: dict) -> list[str]:
        cells = [format_p(r["bleu_p"]), format_p(r["chrf_p"])] if tests else []
        if verdicts:
            by = {"bleu": "BLEU", "perplexity": "perplexity"}.get(r["paper_direction_by"], "")
            cells.append(f"{r['paper_direction']} ({by})" if by else r["paper_direction"])
        return cells

    test_header = ["BLEU p", "chrF p"] if tests else []
    direction_header = ["same direction as the paper?"] if verdicts else []
    if "n_seeds" not in columns:
        shown = [c for c in columns if c not in hidden]
        header = shown + test_header + direction_header
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join([*(str(r[c]) for c in shown), *test_cells(r)]) + " |" for r in rows]
        return lines + _legend(rows, tests, verdicts, split)
    refs = [c for c in columns if c.startswith("ref_")]
    header = ["variant", "overrides", "parameters", "seeds", *split.metrics]
    header += [f"Δ {m} [95% CI]" for m in split.delta_metrics] + test_header + refs + direction_header
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes = []
    for r in rows:
        seeds = f"{r['n_seeds']} of {r['seeds']}"
        if r["missing_seeds"]:
            seeds += " *"
            missing = ", ".join(f"seed{i}" for i in r["missing_seeds"].split())
            note = f"* {r['variant']}: {missing} not finished (trained and decoded); "
            note += f"its means are over {r['n_seeds']} seeds"
            if tests and r["n_seeds"]:
                note += f", its p-values over the {r['paired_seeds'] or 0} seeds it shares with the base"
            notes.append(note)
        cells = [r["variant"], r["overrides"], str(r["parameters"]), seeds]
        for m in split.metrics:
            mean, std = r[m], r[m + "_std"]
            cells.append("" if mean == "" else f"{mean:.2f} ± {std:.2f}" if std != "" else f"{mean:.2f}")
        for m in split.delta_metrics:
            delta, low, high = r["delta_" + m], r[f"delta_{m}_ci95_low"], r[f"delta_{m}_ci95_high"]
            if r is rows[0]:
                cells.append("(base)")
            elif delta == "":
                cells.append("")
            elif low == "":
                cells.append(f"{delta:+.2f} [needs 2 seeds each]")
            else:
                cells.append(f"{delta:+.2f} [{low:+.2f}, {high:+.2f}]")
        cells += test_cells(r)[:2] if tests else []
        cells += [str(r[c]) for c in refs]
        cells += test_cells(r)[-1:] if verdicts else []
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines += ["", *notes]
    lines += [
        "",
        f"mean ± sample standard deviation over seeds; Δ: change from {rows[0]['variant']} with Welch's t 95% CI",
    ]
    return lines + _legend(rows, tests, verdicts, split)


def _legend(rows: list[dict], tests: bool, verdicts: bool, split: Split) -> list[str]:
    lines = []
    if not split.published:
        lines.append(
            f"{', '.join(split.scores)}: sacreBLEU on the whole {split.description} split (last checkpoint); "
            f"{PERPLEXITY}: the last validation perplexity of training (the {split.description} split has none). "
            f"Published reference numbers are validation numbers: they and the paper's direction are in "
            f"{VALID.results_name}.md only."
        )
    if tests:
        lines.append(
            f"BLEU p, chrF p: sacreBLEU's paired bootstrap (1000 resamples) of each variant against "
            f"{rows[0]['variant']} over all {split.description} sentences; {MARK}: p < "
            f"{ALPHA}. With several seeds, seed i is paired with the base's seed i and each "
            "sentence is resampled with all its seeds' translations (transformer_jax/evaluation/significance.py)."
        )
    if verdicts:
        lines.append(
            "same direction as the paper?: by BLEU where the paper gives BLEU (significant: p < "
            f"{ALPHA} and, with 2 seeds or more on both sides, the 95% CI of Δ BLEU excludes 0); "
            "by perplexity where it gives only perplexity (significant: the 95% CI of Δ perplexity excludes 0; "
            "untested with fewer than 2 seeds on either side)."
        )
    return ["", *lines] if lines else []


def write_results(rows: list[dict], workdir: pathlib.Path, split: Split, reference_label: str = "reference") -> None:
    """results.csv, results.md and results.png (results_test.* for the test split): validation perplexity and the
    split's BLEU per variant."""
    if not split.published or not any(row["ref_" + key] != "" for row in rows for key in REFERENCE_METRICS):
        # No published numbers for these results: neither their columns nor the comparison with them.
        rows = [{k: v for k, v in row.items() if not k.startswith(("ref_", "paper_direction"))} for row in rows]
    columns = list(rows[0])
    with open(workdir / f"{split.results_name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    (workdir / f"{split.results_name}.md").write_text("\n".join(_markdown(rows, columns, split)) + "\n")
    _chart(rows, columns, workdir, split, reference_label)


def _chart(rows: list[dict], columns: list[str], workdir: pathlib.Path, split: Split, reference_label: str) -> None:
    from matplotlib.figure import Figure  # here: a slow import, for the chart alone

    names = [r["variant"] for r in rows]
    seeds = "n_seeds" in columns
    fig = Figure(figsize=(12, max(3, 0.35 * len(rows) + 1.5)), dpi=100)  # no pyplot: no backend, no global state
    axes = fig.subplots(1, 2)
    bleu = f"{split.name}_bleu"
    if "ref_" + bleu not in columns:
        for ax, key, label in (
            (axes[0], PERPLEXITY, "validation perplexity"),
            (axes[1], bleu, "BLEU" if split == VALID else f"BLEU ({split.description} split)"),
        ):
            errors = [_number(r[key + "_std"]) for r in rows] if seeds else None
            ax.barh(names, [_number(r[key]) for r in rows], xerr=errors, capsize=3, color="tab:blue")
            ax.set_xlabel(label + (" (mean ± std over seeds)" if seeds else ""))
    else:
        # Scales differ (model size, data, steps), so compare each variant's change from the first variant.
        panels = (
            (axes[0], PERPLEXITY, lambda x, x0: 100 * (x / x0 - 1), "validation perplexity, % change from "),
            (axes[1], bleu, lambda x, x0: x - x0, "BLEU, change in points from "),
        )
        positions = range(len(rows))
        for ax, key, change, label in panels:
            largest = 0.0
            for offset, prefix, color, who in ((-0.2, "", "tab:blue", "this run"), (0.2, "ref_", "tab:gray", "")):
                x0 = _number(rows[0][prefix + key])
                values = [change(_number(r[prefix + key]), x0) if x0 and r[prefix + key] != "" else 0.0 for r in rows]
                errors = None
                if seeds and not prefix and x0:
                    # Half the Δ interval, in the panel's unit (percent of the first variant's perplexity).
                    halves = [
                        (_number(r[f"delta_{key}_ci95_high"]) - _number(r[f"delta_{key}_ci95_low"])) / 2 for r in rows
                    ]
                    errors = [change(x0 + h, x0) for h in halves]
                bars = [p + offset for p in positions]
                ax.barh(bars, values, height=0.4, xerr=errors, capsize=3, color=color, label=who or reference_label)
                largest = max([largest, *map(abs, values)])
            ax.axvline(0.0, color="black", linewidth=0.8)
            ax.set_yticks(list(positions), names)
            ax.set_xlabel(label + names[0])
            if key == PERPLEXITY and largest > 100:
                # One run that failed to learn (+300%) would flatten every other bar to a sliver.
                ax.set_xscale("symlog", linthresh=50)
                ticks = [-50, -25, 0, 25, 50] + [100 * 2**k for k in range(int(math.log2(largest / 100)) + 2)]
                ax.set_xticks(ticks, [f"{t:+d}" if t else "0" for t in ticks])
                ax.set_xlabel(label + names[0] + " (linear to ±50%, logarithmic beyond)")
        axes[0].legend(loc="lower right")
    for ax in axes:
        ax.invert_yaxis()
    axes[1].set_yticklabels([])
    fig.tight_layout()
    fig.savefig(workdir / f"{split.results_name}.png")


def _number(value: Any) -> float:
    return float(value) if value != "" else 0.0
