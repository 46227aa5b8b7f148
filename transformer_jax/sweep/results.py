"""A sweep's results: one row per variant in DIR/results.csv, DIR/results.md and DIR/results.png.

Every finished run is decoded on the whole validation split (the sweep does it, with the run's last checkpoint:
see sweep/runner.py); its hypotheses and scores stay in the run directory (valid.hyp, valid_scores.json),
so the results can be rebuilt without decoding again. BLEU and chrF come from those scores (sacreBLEU, every
validation sentence), perplexity from the last validation of training (also every sentence).

With `--split test` every finished run is also decoded on the test split (test.hyp, test_scores.json) and the
results go to DIR/results_test.csv/md/png: the same rows with the test scores (test_bleu, test_chrf, ...), the Δ
intervals and the paired bootstrap over the test sentences; the perplexity stays the validation one, and the
published (validation) references and the paper's direction are left out. sweep/splits.py names both layouts.

One seed per variant: each row holds the variant's last validation perplexity, BLEU and chrF, its mean training
throughput and wall time (a variant still running shows its perplexity so far).

Several seeds per variant (`--seeds N`): only finished runs (trained and decoded) count. For every metric a row
holds the mean over seeds (column `<metric>`), the sample standard deviation (`<metric>_std`, ddof=1; empty with
one seed) and the number of finished seeds (`n_seeds` of `seeds`). A row with a seed missing is marked in
results.md ("2 of 3 *") and a note below the table names the runs missing; its mean is over the finished seeds
only. For validation perplexity, BLEU and chrF a row also holds Δ = its mean minus the first variant's mean
(`delta_<metric>`) with a 95% confidence interval (`delta_<metric>_ci95_low/high`): Welch's t interval on the
difference of two means, which allows unequal variances and unequal numbers of finished seeds (it ignores that
seed i of two variants shares its init and data order, so it is conservative where that pairing matters). It
needs two finished seeds on both sides; otherwise the interval is empty. Whether BLEU and chrF differ from the
first variant's beyond chance, and whether a change goes the paper's way, is sweep/significance.py's
part (columns bleu_p, chrf_p, paired_seeds, paper_direction, paper_direction_by). The chart shows mean ± standard
deviation as error bars, or, when the config file gives published references, the change from the first variant
with the Δ interval as error bars.
"""

from __future__ import annotations

import csv
import json
import math
import pathlib
import statistics
from collections.abc import Sequence
from typing import Any

from transformer_jax.model import parameter_count
from transformer_jax.sweep import significance
from transformer_jax.sweep.splits import PERPLEXITY, VALID, Split
from transformer_jax.training.metrics import read_metrics

RESULT_FILE = "sweep_result.json"  # written when a run's training finished
REFERENCE_METRICS = (PERPLEXITY, f"{VALID.name}_bleu")  # published numbers are validation numbers
CONFIDENCE = 0.95


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
    row: dict[str, Any] = {key: "" for key in ("steps", PERPLEXITY, *split.scores)}
    row.update(tokens_per_s="", wall_s="")
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


def summarize_variant(variant, run_dir: pathlib.Path, split: Split) -> dict:
    """One results row from a variant's directory (empty fields where it has not run): the one-seed layout."""
    name, overrides, config, reference = variant
    row: dict[str, Any] = {
        "variant": name,
        "overrides": " ".join(f"{k}={v}" for k, v in overrides.items()) or "(none)",
        "parameters": parameter_count(config),
    }
    metrics = run_metrics(run_dir, split)
    del metrics["finished"]
    row.update(metrics)
    for key in REFERENCE_METRICS:
        row["ref_" + key] = reference.get(key, "")
    return row


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
    """Rows of mean, standard deviation and number of seeds per metric, and Δ against the first variant.

    Each entry of `variants`: variant, overrides, parameters, ref_* keys, and "runs": one run_metrics() dict per
    seed (a run that did not finish counts as missing, whatever its metrics file holds so far).
    """
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


def _markdown(rows: list[dict], columns: list[str], split: Split) -> list[str]:
    """The results table; several seeds: "mean ± std" cells, "2 of 3 *" for a row with seeds missing, Δ [CI].

    The test columns (bleu_p, chrf_p: p-values marked below 0.05; the paper_direction verdict with its metric) are
    formatted the same way in both layouts.
    """
    tests = "bleu_p" in columns
    direction = "paper_direction" in columns
    hidden = {"bleu_p", "chrf_p", "paired_seeds", "paper_direction", "paper_direction_by"}

    def test_cells(r: dict) -> list[str]:
        cells = [significance.format_p(r["bleu_p"]), significance.format_p(r["chrf_p"])] if tests else []
        if direction:
            by = {"bleu": "BLEU", "perplexity": "perplexity"}.get(r["paper_direction_by"], "")
            cells.append(f"{r['paper_direction']} ({by})" if by else r["paper_direction"])
        return cells

    test_header = ["BLEU p", "chrF p"] if tests else []
    direction_header = ["same direction as the paper?"] if direction else []
    if "n_seeds" not in columns:
        shown = [c for c in columns if c not in hidden]
        header = shown + test_header + direction_header
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join([*(str(r[c]) for c in shown), *test_cells(r)]) + " |" for r in rows]
        return lines + _legend(rows, tests, direction, split)
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
            notes.append(
                f"* {r['variant']}: {missing} not finished (trained and decoded); its means are over "
                f"{r['n_seeds']} seeds"
                + (
                    f", its p-values over the {r['paired_seeds'] or 0} seeds it shares with the base"
                    if tests and r["n_seeds"]
                    else ""
                )
            )
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
        cells += test_cells(r)[-1:] if direction else []
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines += ["", *notes]
    lines += [
        "",
        f"mean ± sample standard deviation over seeds; Δ: change from {rows[0]['variant']} with Welch's t 95% CI",
    ]
    return lines + _legend(rows, tests, direction, split)


def _legend(rows: list[dict], tests: bool, direction: bool, split: Split) -> list[str]:
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
            f"{rows[0]['variant']} over all {split.description} sentences; {significance.MARK}: p < "
            f"{significance.ALPHA}. With several seeds, seed i is paired with the base's seed i and each "
            "sentence is resampled with all its seeds' translations (transformer_jax/sweep/significance.py)."
        )
    if direction:
        lines.append(
            "same direction as the paper?: by BLEU where the paper gives BLEU (significant: p < "
            f"{significance.ALPHA} and, with 2 seeds or more on both sides, the 95% CI of Δ BLEU excludes 0); "
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
                ax.barh(
                    [p + offset for p in positions],
                    values,
                    height=0.4,
                    xerr=errors,
                    capsize=3,
                    color=color,
                    label=who or reference_label,
                )
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
