"""Seeds as a sweep axis: what a seed changes, the run layout, and mean ± std / Δ with CI in the results."""

from __future__ import annotations

import csv
import json
import pathlib
import shlex

import jax
import numpy as np
import pytest
from flax import nnx
from matplotlib.figure import Figure

from tests.helpers.fakes import WordTokenizer
from tests.helpers.sweeps import fails, write_run
from transformer_jax.data import pipeline
from transformer_jax.errors import ConfigError
from transformer_jax.sweep import __main__ as sweep
from transformer_jax.sweep import results, runner
from transformer_jax.sweep.results import VALID
from transformer_jax.training import loop
from transformer_jax.training.step import model_params, new_train_state, split_train_state

CONFIG = str(pathlib.Path(__file__).resolve().parent / "tiny_sweep_config.py")
PNG = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("tiny_corpus_env")  # the conftest corpus, where the sweep's config reads it


def test_a_seed_changes_init_dropout_and_data_order_and_the_same_seed_repeats(corpus):
    base = runner.variants(CONFIG)[0]
    seed0, seed1 = (r.config for r in runner.runs(base, 2))
    assert (seed1.train.seed, seed1.data.shuffle_seed) == (
        base.config.train.seed + 1,
        base.config.data.shuffle_seed + 1,
    )

    def state(config):
        return split_train_state(new_train_state(config))[1]

    def first_batch(config):
        it, _ = pipeline.make_train_iterator(config.data, WordTokenizer(), process_index=0, process_count=1)
        return next(it)

    def same(a, b):
        return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))

    a, again, b = state(seed0), state(seed0.copy_and_resolve_references()), state(seed1)
    assert same(model_params(a), model_params(again)) and not same(model_params(a), model_params(b))  # init
    dropout = [
        [jax.random.key_data(k) for k in jax.tree.leaves(nnx.filter_state(s["model"], nnx.RngKey))]
        for s in (a, again, b)
    ]
    assert same(dropout[0], dropout[1]) and not same(dropout[0], dropout[2])  # dropout masks
    x, y, z = first_batch(seed0), first_batch(seed0), first_batch(seed1)
    assert same(x, y) and not np.array_equal(x["src_tokens"], z["src_tokens"])  # data order


def test_one_seed_keeps_the_layout_and_commands_of_before(corpus, tmp_path, capsys):
    assert sweep.main(["--config", CONFIG, "--workdir", str(tmp_path), "--print_commands", "--seeds", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    args = shlex.split(lines[0])
    assert f"--workdir={tmp_path / 'base'}" in args and not any(a.startswith("--config.train.seed") for a in args)


def test_seeds_flag_runs_every_variant_with_each_seed(corpus, tmp_path, capsys):
    args = ["--config", CONFIG, "--workdir", str(tmp_path), "--seeds", "3"]
    assert sweep.main([*args, "--dry_run", "--only", "pre_ln"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["pre_ln/seed0", "pre_ln/seed1", "pre_ln/seed2"]
    assert json.loads(lines[2].partition(": ")[2]) == {
        "model.norm_position": "pre",
        "train.seed": 2,
        "data.shuffle_seed": 2,
    }
    assert sweep.main([*args, "--print_commands"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 6
    assert f"--workdir={tmp_path / 'base' / 'seed1'}" in lines[1]
    assert "--config.train.seed=1 --config.data.shuffle_seed=1" in lines[1]


def test_seeds_from_the_config_file_and_bad_seed_counts(corpus, tmp_path, capsys):
    config = tmp_path / "seeded.py"
    config.write_text("from tests.tiny_sweep_config import get_config, get_sweep\n\nSEEDS = 2\n")
    assert sweep.main(["--config", str(config), "--workdir", str(tmp_path / "sw"), "--dry_run"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 4
    assert sweep.main(["--config", str(config), "--workdir", str(tmp_path / "sw"), "--dry_run", "--seeds", "1"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[0] == "base: {}"  # the flag wins
    assert "--seeds" in fails(["--config", CONFIG, "--workdir", str(tmp_path), "--seeds", "0"], capsys)
    runner.load_config_module.cache_clear()
    config.write_text("from tests.tiny_sweep_config import get_config, get_sweep\n\nSEEDS = '3'\n")
    assert "SEEDS = '3'; it must be a whole number >= 1" in fails(["--config", str(config), "--workdir", "x"], capsys)
    runner.load_config_module.cache_clear()
    with pytest.raises(ConfigError, match="sweep variant 'base', seed 1 of --seeds 2: config key train.seed"):
        runner.runs(runner.variants(CONFIG, {"train.seed": 2**32 - 1})[0], 2)


def _run(ppl, bleu, finished=True):
    return {
        "steps": 4,
        "valid_perplexity": ppl,
        "valid_bleu": bleu,
        "valid_chrf": bleu + 30.0,
        "valid_chrfpp": bleu + 28.0,
        "valid_ter": 80.0 - bleu,
        "tokens_per_s": 100.0,
        "wall_s": 2.0,
        "finished": finished,
    }


def _variant(name, runs, **refs):
    return {"variant": name, "overrides": "(none)", "parameters": 10, "runs": runs, **refs}


# base: perplexity 8, 9, 10 (mean 9, std 1); v: 7, 8, and a third seed that did not finish (its partial metrics
# must not count); w: 6, 7, 8 (mean 7, std 1).
SYNTHETIC = [
    _variant("base", [_run(8.0, 20.0), _run(9.0, 21.0), _run(10.0, 22.0)]),
    _variant("v", [_run(7.0, 22.0), _run(8.0, 23.0), _run(50.0, 1.0, finished=False)]),
    _variant("w", [_run(6.0, 24.0), _run(7.0, 25.0), _run(8.0, 26.0)]),
]
T_975_DOF4 = 2.7764451051977987  # scipy.stats.t.ppf(0.975, 4)


def test_aggregation_gives_mean_std_seed_counts_and_welch_intervals():
    base, v, w = results.aggregate_seeds(SYNTHETIC, 3, VALID)
    assert (base["valid_perplexity"], base["valid_perplexity_std"], base["n_seeds"], base["seeds"]) == (9.0, 1.0, 3, 3)
    assert (base["valid_bleu"], base["valid_bleu_std"], base["missing_seeds"]) == (21.0, 1.0, "")
    assert (v["valid_perplexity"], v["valid_perplexity_std"], v["n_seeds"], v["missing_seeds"]) == (7.5, 0.7071, 2, "2")
    assert (w["delta_valid_perplexity"], w["delta_valid_bleu"]) == (-2.0, 4.0)
    # Equal variances and n: Welch's dof is 2(n-1) = 4 and the half-width t * sqrt(1/3 + 1/3).
    half = T_975_DOF4 * (2 / 3) ** 0.5
    assert w["delta_valid_perplexity_ci95_low"] == pytest.approx(-2 - half, abs=1e-4)
    assert w["delta_valid_perplexity_ci95_high"] == pytest.approx(-2 + half, abs=1e-4)
    assert base["delta_valid_perplexity"] == 0.0 and base["delta_valid_perplexity_ci95_low"] == ""
    low, high = results.welch_interval([7.0, 8.0], [8.0, 9.0, 10.0])
    assert low < -1.5 < high and (low + high) / 2 == pytest.approx(-1.5)
    assert results.welch_interval([1.0, 1.0], [2.0, 2.0]) == (-1.0, -1.0)
    with pytest.raises(ValueError, match="two values per sample"):
        results.welch_interval([1.0], [2.0, 3.0])


def test_results_table_marks_a_missing_seed_and_gives_intervals(tmp_path):
    results.write_results(results.aggregate_seeds(SYNTHETIC, 3, VALID), tmp_path, VALID)
    table = (tmp_path / "results.md").read_text()
    assert (
        "| seeds | valid_perplexity | valid_bleu | valid_chrf | valid_chrfpp | valid_ter | tokens_per_s | wall_s "
        "| Δ valid_perplexity [95% CI] |" in table
    )
    assert (
        "| base | (none) | 10 | 3 of 3 | 9.00 ± 1.00 | 21.00 ± 1.00 | 51.00 ± 1.00 | 49.00 ± 1.00 | 59.00 ± 1.00 "
        "| 100.00 ± 0.00 | 2.00 ± 0.00 "
        "| (base) |" in table
    )
    assert "| v | (none) | 10 | 2 of 3 * | 7.50 ± 0.71 |" in table
    assert "| -2.00 [-4.27, +0.27] | +4.00 [+1.73, +6.27] | +4.00 [+1.73, +6.27] |" in table  # w
    assert "* v: seed2 not finished (trained and decoded); its means are over 2 seeds" in table
    assert "Welch's t 95% CI" in table
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert [(r["variant"], r["n_seeds"], r["seeds"]) for r in rows] == [
        ("base", "3", "3"),
        ("v", "2", "3"),
        ("w", "3", "3"),
    ]
    assert "ref_valid_bleu" not in rows[0]
    assert (tmp_path / "results.png").read_bytes()[:8] == PNG


def test_the_chart_has_error_bars_with_and_without_references(tmp_path, monkeypatch):
    figures = []
    savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), savefig(fig, *a, **k)))
    results.write_results(results.aggregate_seeds(SYNTHETIC, 3, VALID), tmp_path, VALID)
    with_refs = [dict(v, ref_valid_perplexity=5.0, ref_valid_bleu=25.0) for v in SYNTHETIC]
    results.write_results(results.aggregate_seeds(with_refs, 3, VALID), tmp_path, VALID, reference_label="paper")
    assert "| 5.0 | 25.0 |" in (tmp_path / "results.md").read_text()
    for fig in figures:
        assert all(
            ax.containers and any(c.has_xerr for c in ax.containers if hasattr(c, "has_xerr")) for ax in fig.axes
        )


def test_finished_seeds_are_skipped_an_unfinished_one_resumes_and_is_reported(corpus, tmp_path, monkeypatch, capsys):
    """Seed 1 of pre_ln has no result file: only it trains; it stops early, so the results say 1 of 2."""
    workdir = tmp_path / "sw"
    refs = (corpus / "valid.de").read_text(encoding="utf-8").splitlines()
    for name, seed in (("base", 0), ("base", 1), ("pre_ln", 0)):
        write_run(workdir / name / f"seed{seed}", refs, refs, perplexity=5.0 + seed + (name == "pre_ln"))
    started = []

    def interrupted(config, workdir, bleu) -> dict:  # a SIGTERM before any step: no checkpoint, no early stop
        started.append(workdir)
        return {}

    monkeypatch.setattr(loop, "train_and_evaluate", interrupted)
    assert sweep.main(["--config", CONFIG, "--workdir", str(workdir), "--seeds", "2"]) == 1
    assert started == [workdir / "pre_ln" / "seed1"]
    assert "variant pre_ln/seed1 stopped at step 0 of 2" in capsys.readouterr().err
    table = (workdir / "results.md").read_text()
    assert "| base | (none) |" in table and "| 2 of 2 | 5.50 ± 0.71 |" in table
    assert "| 1 of 2 * | 6.00 |" in table and "* pre_ln: seed1 not finished" in table
