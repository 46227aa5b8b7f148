"""Is system A better than baseline B, or is the difference chance? sacreBLEU's paired bootstrap resampling test
(`PairedTest`, Koehn 2004), for evaluate.py --compare_file and, pooled over seeds, for the sweep's results.

BLEU and chrF equal what `sacrebleu REF -i BASELINE SYSTEM -m bleu chrf --paired-bs` prints (its first system is the
baseline); the tokenized BLEU is that test on the tokenized, compound-split lines with `--tokenize none --force`.
The seed is sacreBLEU's: the SACREBLEU_SEED environment variable, default 12345.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.significance import PairedTest
from sacrebleu.utils import sum_of_lists

from transformer_jax.errors import ScoreError
from transformer_jax.evaluation.translate import TOKENIZED_BLEU_LABEL, read_lines, tokenize_for_bleu

N_SAMPLES = 1000  # sacreBLEU's default number of bootstrap resamples (--paired-bs-n)
TEST_NAME = "paired bootstrap resampling (sacreBLEU PairedTest, Koehn 2004)"


def paired_bootstrap(
    baseline_hyps: Sequence[str], system_hyps: Sequence[str], refs: Sequence[str], *, n_samples: int = N_SAMPLES
) -> dict[str, Any]:
    """The paired bootstrap test of `system_hyps` against `baseline_hyps`, one reference per line, scored as given.

    Each metric of the result is {'name', 'signature', 'baseline', 'system', 'p_value'}, a system's entry {'score',
    'mean': bootstrap mean, 'ci': half-width of the 95% interval}. p_value is sacreBLEU's: the chance of an absolute
    difference at least as large if both came from the same process, at least 1/(n_samples + 1), which it also gives
    identical outputs.
    """
    baseline_hyps, system_hyps, refs = list(baseline_hyps), list(system_hyps), list(refs)
    if not refs:
        raise ScoreError("no lines to compare: the references are empty")
    if not len(baseline_hyps) == len(system_hyps) == len(refs):
        raise ScoreError(
            f"line counts differ: baseline {len(baseline_hyps)}, system {len(system_hyps)}, references {len(refs)}; "
            "each system needs one line per reference line"
        )
    identical = baseline_hyps == system_hyps  # sacreBLEU's p is then its smallest, which means nothing here
    out: dict[str, Any] = {"test": TEST_NAME, "n_samples": n_samples, "seed": _seed(), "identical_outputs": identical}
    out.update(_run({"bleu": BLEU(), "chrf": CHRF()}, baseline_hyps, system_hyps, refs, n_samples))
    tokenized_bleu = {"tokenized_bleu": BLEU(tokenize="none", force=True)}
    tok = tokenize_for_bleu
    tokenized = _run(tokenized_bleu, tok(baseline_hyps), tok(system_hyps), tok(refs), n_samples)
    tokenized["tokenized_bleu"]["name"] = TOKENIZED_BLEU_LABEL
    return {**out, **tokenized}


class _PooledSeeds:
    """A sacreBLEU metric whose hypotheses are one tuple per sentence (its translation by each seed) and whose
    statistics for a sentence are the sum of the seeds' (`_extract_corpus_statistics` is what PairedTest calls).
    BLEU's and chrF's corpus statistics are sums over sentences, so this scores all seeds' outputs concatenated while
    PairedTest resamples sentences with all their seeds; with one seed the statistics are BLEU's or chrF's own."""

    def _extract_corpus_statistics(self, hypotheses, references):
        extract = super()._extract_corpus_statistics  # bound here: super() does not work inside the comprehension
        per_seed = [extract(list(seed), references) for seed in zip(*hypotheses, strict=True)]
        return [sum_of_lists(seeds) for seeds in zip(*per_seed, strict=True)]


class _PooledBLEU(_PooledSeeds, BLEU):
    pass


class _PooledCHRF(_PooledSeeds, CHRF):
    pass


def pooled_paired_bootstrap(
    baseline_runs: Sequence[Sequence[str]],
    system_runs: Sequence[Sequence[str]],
    refs: Sequence[str],
    *,
    n_samples: int = N_SAMPLES,
) -> dict[str, Any]:
    """sacreBLEU's paired bootstrap of BLEU and chrF over sentences, for systems trained with several seeds.

    `baseline_runs[i]` and `system_runs[i]` are seed i's hypotheses (one line per reference line), seed i of both
    sharing its initialisation and data order. A resampled item is a sentence with all its seeds' translations, so
    the p-value says how often the choice of test sentences alone gives a seed-pooled difference as large; resampling
    (sentence, seed) items independently would count a sentence's seeds as independent draws and make p-values too
    small. The spread between seeds is not resampled (the sweep's Welch interval covers it). With one seed this is
    `paired_bootstrap`'s BLEU and chrF; 'score' is the corpus score of all seeds' lines together.
    """
    if not baseline_runs or len(baseline_runs) != len(system_runs):
        raise ScoreError(
            f"seeds to pair: baseline {len(baseline_runs)}, system {len(system_runs)}; give each system's hypotheses "
            "for the same seeds, at least one"
        )
    refs = list(refs)
    if not refs:
        raise ScoreError("no lines to compare: the references are empty")
    for name, runs in (("baseline", baseline_runs), ("system", system_runs)):
        for i, hyps in enumerate(runs):
            if len(hyps) != len(refs):
                raise ScoreError(
                    f"{name} seed {i} has {len(hyps)} lines, the references {len(refs)}; "
                    "each seed needs one line per reference line"
                )
    baseline = list(zip(*baseline_runs, strict=True))
    system = list(zip(*system_runs, strict=True))
    out: dict[str, Any] = {
        "test": TEST_NAME + ", sentences resampled with all their seeds",
        "n_samples": n_samples,
        "seed": _seed(),
        "seeds": len(baseline_runs),
        "identical_outputs": baseline == system,
    }
    out.update(_run({"bleu": _PooledBLEU(), "chrf": _PooledCHRF()}, baseline, system, refs, n_samples))
    return out


def _seed() -> str:
    return os.environ.get("SACREBLEU_SEED", "12345").lower()  # how PairedTest reads it


def _run(metrics: dict[str, Any], baseline: list, system: list, refs: list[str], n: int) -> dict[str, Any]:
    logger = logging.getLogger("sacrebleu")  # it logs each step at INFO, which absl's handler would print
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        test = PairedTest(
            [("baseline", baseline), ("system", system)], metrics, references=[refs], test_type="bs", n_samples=n
        )
        signatures, results = test()
    finally:
        logger.setLevel(level)
    out = {}
    for key, (name, (base, other)) in zip(metrics, [(k, v) for k, v in results.items() if k != "System"], strict=True):
        out[key] = {
            "name": name,
            "signature": str(signatures[name]),
            "baseline": _numbers(base),
            "system": _numbers(other),
            "p_value": float(other.p_value),
        }
    return out


def _numbers(result: Any) -> dict[str, float]:
    # sacreBLEU computes the resampled scores from float32 statistics; plain floats keep the report JSON-writable.
    return {"score": float(result.score), "mean": float(result.mean), "ci": float(result.ci)}


def compare_files(system_file: str, baseline_file: str, references_file: str) -> dict[str, Any]:
    """`paired_bootstrap` on files read as the `sacrebleu` command reads them; the flags name the files in errors."""
    files = {"--hypotheses_file": system_file, "--compare_file": baseline_file, "--references_file": references_file}
    lines = {flag: read_lines(path) for flag, path in files.items()}
    counts = {flag: len(v) for flag, v in lines.items()}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{flag} {files[flag]} has {n}" for flag, n in counts.items())
        raise ScoreError(f"line counts differ: {listed}; compare two systems' outputs of the same references")
    if not counts["--references_file"]:
        raise ScoreError(f"{', '.join(files.values())} have no lines: nothing to compare")
    return paired_bootstrap(lines["--compare_file"], lines["--hypotheses_file"], lines["--references_file"])


def format_comparison(result: dict[str, Any], system_name: str, baseline_name: str) -> str:
    """Lines as the sacrebleu command's table reads (score (mean ± 95% CI), p-value), two decimals, signatures."""
    lines = [
        f"{result['test']}, {result['n_samples']} resamples, seed {result['seed']}; "
        f"score (bootstrap mean ± 95% CI); baseline: {baseline_name}",
    ]
    for key in ("bleu", "chrf", "tokenized_bleu"):
        m = result[key]
        name = f"sacreBLEU {m['name']}" if key != "tokenized_bleu" else m["name"]
        p = m["p_value"]
        if result["identical_outputs"]:
            verdict = " (the two outputs are identical: no difference; sacreBLEU reports its smallest p here)"
        else:
            verdict = " (significant at 0.05)" if p < 0.05 else " (not significant at 0.05)"
        lines.append(
            f"{name}: {system_name} {_fmt(m['system'])} vs baseline {baseline_name} {_fmt(m['baseline'])}; "
            f"p = {p:.4f}{verdict}"
        )
    lines += [f"  signature {result[key]['name']}: {result[key]['signature']}" for key in ("bleu", "chrf")]
    lines.append(f"  signature tokenized BLEU: {result['tokenized_bleu']['signature']}")
    return "\n".join(lines)


def _fmt(n: dict[str, float]) -> str:
    return f"{n['score']:.2f} ({n['mean']:.2f} ± {n['ci']:.2f})"
