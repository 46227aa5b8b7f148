"""Sweeps: variants validated up front, run one after another, finished ones skipped, results aggregated."""

import csv
import json
import pathlib

import pytest
from matplotlib.figure import Figure

from tests.helpers.sweeps import fails
from transformer_jax.evaluation import run
from transformer_jax.evaluation.restore import CheckpointChoice
from transformer_jax.evaluation.run import Model, Translate, split_pairs
from transformer_jax.evaluation.translate import score_all
from transformer_jax.sweep import __main__ as sweep
from transformer_jax.sweep import results, runner
from transformer_jax.sweep.results import TEST, VALID
from transformer_jax.training import loop

CONFIG = str(pathlib.Path(__file__).resolve().parent / "tiny_sweep_config.py")


pytestmark = pytest.mark.usefixtures("tiny_corpus_env")  # the conftest corpus, where the sweep's config reads it


def test_dry_run_and_commands_list_every_variant(corpus, tmp_path, capsys):
    assert sweep.main(["--config", CONFIG, "--workdir", str(tmp_path / "sw"), "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "base: {}" in out and 'pre_ln: {"model.norm_position": "pre"}' in out
    assert sweep.main(["--config", CONFIG, "--workdir", str(tmp_path / "sw"), "--print_commands"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "--config.model.norm_position=pre" in lines[1] and "pre_ln" in lines[1]
    assert not (tmp_path / "sw").exists()  # nothing ran


def test_misspelt_override_fails_before_anything_runs(corpus, tmp_path, capsys):
    err = fails(["--config", CONFIG + ":misspelt", "--workdir", str(tmp_path / "sw")], capsys)
    assert "unknown key 'model.d_modle'" in err
    assert not (tmp_path / "sw").exists()


def test_unknown_reference_metric_fails_before_anything_runs(corpus, tmp_path, capsys):
    err = fails(["--config", CONFIG + ":bad_reference", "--workdir", str(tmp_path / "sw")], capsys)
    assert "reference keys ['valid_ppl']" in err
    assert not (tmp_path / "sw").exists()


def _sweep_file(tmp_path: pathlib.Path, entries: str) -> str:
    """A config file in tmp_path: the tiny sweep config's get_config, with these sweep entries."""
    path = tmp_path / "sweep_config.py"
    path.write_text(
        f"from tests.tiny_sweep_config import get_config\n\n\ndef get_sweep(arg=None):\n    return {entries}\n"
    )
    return str(path)


@pytest.mark.parametrize("name", ["..", ".", "../escaped", "a/b", "/abs", "x\n", ""])
def test_a_variant_name_cannot_leave_the_sweep_directory(corpus, tmp_path, capsys, name):
    config = _sweep_file(tmp_path, repr([{"name": name}]))
    err = fails(["--config", config, "--workdir", str(tmp_path / "sw"), "--print_commands"], capsys)
    assert "sweep entry 0" in err and "'name'" in err  # which entry, and which field of it
    assert not (tmp_path / "sw").exists() and not (tmp_path / "escaped").exists()
    assert runner.NAME_PATTERN.fullmatch("...")  # only '.' and '..' are special


def test_a_bad_value_in_any_variant_fails_before_anything_runs(corpus, tmp_path, capsys):
    config = _sweep_file(tmp_path, repr([{"name": "ok"}, {"name": "ascent", "opt.learning_rate": -0.5}]))
    err = fails(["--config", config, "--workdir", str(tmp_path / "sw")], capsys)
    assert "sweep variant 'ascent'" in err and "opt.learning_rate" in err  # the variant and the key
    assert not (tmp_path / "sw").exists()


def test_a_sweep_workdir_that_is_a_file_is_one_line(corpus, tmp_path, capsys):
    (tmp_path / "sw").write_text("")
    assert "is a file, not a directory" in fails(["--config", CONFIG, "--workdir", str(tmp_path / "sw")], capsys)


def test_unknown_only_name_lists_the_variants(corpus, tmp_path, capsys):
    assert "['base', 'pre_ln']" in fails(
        ["--config", CONFIG, "--workdir", str(tmp_path / "sw"), "--only", "nope"], capsys
    )


def test_missing_config_file_or_flag_is_one_line(corpus, tmp_path, capsys):
    assert "--config nope.py: no such file nope.py" in fails(
        ["--config", "nope.py", "--workdir", str(tmp_path)], capsys
    )
    assert "--workdir" in fails(["--config", CONFIG], capsys)
    assert "'d_modle' Did you mean \"d_model\"" in fails(["--config", CONFIG, "--config.model.d_modle=8"], capsys)


@pytest.fixture(scope="module")
def trained_sweep(corpus, tmp_path_factory) -> pathlib.Path:
    """The tiny sweep trained and decoded on the validation split, once for the tests of this file that use it."""
    workdir = tmp_path_factory.mktemp("trained") / "sw"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TINY_CORPUS", str(corpus))
        assert sweep.main(["--config", CONFIG, "--workdir", str(workdir)]) == 0
    return workdir


def test_sweep_runs_skips_finished_variants_and_aggregates(trained_sweep):
    workdir = trained_sweep
    for name in ("base", "pre_ln"):
        assert (workdir / name / "config.json").exists()
        assert (workdir / name / results.RESULT_FILE).exists()
        # The whole validation split (24 lines) decoded with the last checkpoint, hypotheses and scores kept.
        assert len((workdir / name / VALID.hypotheses_file).read_text().splitlines()) == 24
        report = json.loads((workdir / name / VALID.scores_file).read_text())
        assert report["checkpoint_steps"] == [2] and report["lines"] == 24
    rows = list(csv.DictReader(open(workdir / "results.csv")))
    assert float(rows[1]["valid_bleu"]) == round(report["scores"]["bleu"]["score"], 2)
    assert float(rows[1]["valid_ter"]) == round(report["scores"]["ter"]["score"], 2)
    assert float(rows[1]["valid_chrfpp"]) == round(report["scores"]["chrfpp"]["score"], 2)
    assert rows[1]["paired_seeds"] == "1" and 0 < float(rows[1]["bleu_p"]) <= 1
    assert [r["variant"] for r in rows] == ["base", "pre_ln"]
    assert rows[1]["overrides"] == "model.norm_position=pre"
    assert int(rows[1]["parameters"]) > int(rows[0]["parameters"])  # pre-LN adds two final norms
    assert all(r["steps"] == "2" and float(r["valid_perplexity"]) > 1 for r in rows)
    # Published numbers ride along in ref_* columns; a metric a variant has none for stays empty.
    assert [(r["ref_valid_perplexity"], r["ref_valid_bleu"]) for r in rows] == [("5.0", "25.0"), ("4.5", "")]
    assert (workdir / "results.md").read_text().startswith("| variant |")
    assert (workdir / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A second run finds both finished and trains nothing.
    stamp = (workdir / "base" / "metrics.jsonl").stat().st_mtime
    assert sweep.main(["--config", CONFIG, "--workdir", str(workdir)]) == 0
    assert (workdir / "base" / "metrics.jsonl").stat().st_mtime == stamp


def _files(workdir: pathlib.Path) -> dict[pathlib.Path, tuple[bytes, int]]:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(workdir.rglob("*")) if p.is_file()}


def test_split_test_decodes_a_trained_sweep_on_the_test_split_only(trained_sweep, corpus, monkeypatch):
    """A sweep trained and decoded on validation: --split test decodes each run's last checkpoint on the test split
    as evaluate.py's library does, trains nothing, changes no file, and reports the test scores in results_test.*."""
    workdir = trained_sweep
    before = _files(workdir)
    monkeypatch.setattr(loop, "train_and_evaluate", lambda *a, **k: pytest.fail("trained a finished run"))
    splits, translate = [], runner.translate
    monkeypatch.setattr(runner, "translate", lambda mode: (splits.append(mode.split), translate(mode))[1])
    assert sweep.main(["--config", CONFIG, "--workdir", str(workdir), "--split", "test"]) == 0
    assert splits == ["test", "test"]  # base and pre_ln, the test split only
    after = _files(workdir)
    # Metrics, checkpoints, valid.hyp, valid_scores.json and results.* as they were (bytes and times).
    assert {p: after[p] for p in before} == before
    base = workdir / "base"
    mode = Translate(Model(str(base), choice=CheckpointChoice(average_last=1)), split="test")
    expected = run.translate(mode, run.load(mode))  # what evaluate.py --split test writes
    assert (base / TEST.hypotheses_file).read_text(encoding="utf-8").splitlines() == expected.hypotheses
    config = runner.variants(CONFIG)[0].config
    refs = split_pairs(config, "test")[1]
    assert refs != split_pairs(config, "valid")[1]
    report = json.loads((base / TEST.scores_file).read_text())
    assert report["checkpoint_steps"] == [2] and report["lines"] == len(refs)
    assert report["scores"]["chrf"]["score"] == score_all(expected.hypotheses, refs)["chrf"]["score"]
    rows = list(csv.DictReader(open(workdir / "results_test.csv")))
    valid_rows = list(csv.DictReader(open(workdir / "results.csv")))
    assert float(rows[0]["test_bleu"]) == round(report["scores"]["bleu"]["score"], 2)
    assert float(rows[0]["test_chrf"]) == round(report["scores"]["chrf"]["score"], 2)
    assert [r["valid_perplexity"] for r in rows] == [r["valid_perplexity"] for r in valid_rows]
    assert rows[1]["paired_seeds"] == "1" and 0 < float(rows[1]["bleu_p"]) <= 1
    assert not any(c.startswith(("valid_bleu", "ref_", "paper_direction")) for c in rows[0])  # validation's only
    table = (workdir / "results_test.md").read_text()
    assert table.startswith("| variant |") and "| test_bleu |" in table
    assert "the last validation perplexity of training" in table and "over all test sentences" in table
    assert (workdir / "results_test.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Decoded on both splits: a third invocation decodes nothing.
    assert sweep.main(["--config", CONFIG, "--workdir", str(workdir), "--split", "test"]) == 0
    assert splits == ["test", "test"]


def _row(variant, ppl, bleu, ref_ppl="", ref_bleu=""):
    return {
        "variant": variant,
        "overrides": "(none)",
        "parameters": 10,
        "steps": 4,
        "valid_perplexity": ppl,
        "valid_bleu": bleu,
        "tokens_per_s": 1.0,
        "wall_s": 1.0,
        "ref_valid_perplexity": ref_ppl,
        "ref_valid_bleu": ref_bleu,
    }


def test_results_without_references_have_no_reference_columns(tmp_path):
    results.write_results([_row("base", 9.0, 10.0), _row("v", "", "")], tmp_path, VALID)  # "v" has not run yet
    header = (tmp_path / "results.csv").read_text().splitlines()[0]
    assert "ref_" not in header and header.startswith("variant,")
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_results_with_references_chart_changes_from_the_first_variant(tmp_path):
    rows = [_row("base", 9.0, 10.0, 4.92, 25.8), _row("v", 8.0, 11.5, 5.29, 24.9), _row("w", "", "", 5.0, "")]
    results.write_results(rows, tmp_path, VALID, reference_label="paper")
    table = (tmp_path / "results.md").read_text()
    assert "ref_valid_perplexity | ref_valid_bleu |" in table and "| 5.29 | 24.9 |" in table
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("outlier,scale", [(11.0, "linear"), (45.0, "symlog")])
def test_a_variant_that_failed_to_learn_does_not_flatten_the_other_bars(tmp_path, monkeypatch, outlier, scale):
    figures = []
    savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), savefig(fig, *a, **k)))
    rows = [_row("base", 9.0, 10.0, 4.92, 25.8), _row("v", 8.0, 11.5, 5.29, 24.9), _row("x", outlier, 1.0, 4.9, 25.5)]
    results.write_results(rows, tmp_path, VALID, reference_label="paper")
    assert figures[0].axes[0].get_xscale() == scale  # +400% perplexity: logarithmic beyond +-50%
    assert figures[0].axes[1].get_xscale() == "linear"


def test_config_override_applies_to_every_variant_and_to_printed_commands(corpus, tmp_path, capsys):
    assert all(v.config.train.log_every == 7 for v in runner.variants(CONFIG, {"train.log_every": 7}))
    args = ["--config", CONFIG, "--workdir", str(tmp_path), "--config.train.log_every=7"]
    args += ["--config.data.tokenizer_model=/tmp/spm.model"]
    assert sweep.main([*args, "--print_commands"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    assert all("--config.train.log_every=7" in line and "tokenizer_model=/tmp/spm.model" in line for line in lines)
    assert sweep.main([*args, "--dry_run", "--only", "pre_ln"]) == 0
    assert capsys.readouterr().out.strip() == 'pre_ln: {"model.norm_position": "pre"}'


@pytest.mark.parametrize(
    "setting,message",
    [
        ("--config.train.log_evry=7", "'log_evry' Did you mean \"log_every\""),
        ("--config.train.log_every=often", "invalid literal for int() with base 10: 'often'"),
    ],
)
def test_bad_config_override_is_a_clear_error(corpus, tmp_path, capsys, setting, message):
    assert message in fails(["--config", CONFIG, "--workdir", str(tmp_path / "sw"), setting], capsys)
    assert not (tmp_path / "sw").exists()


def test_a_variant_stopped_early_is_not_marked_finished_and_stops_the_sweep(corpus, tmp_path, monkeypatch, capsys):
    """train_and_evaluate returns early on SIGTERM; the sweep must neither skip that variant later nor go on."""
    started = []

    def interrupted(config, workdir, bleu) -> dict:  # a SIGTERM before any step: no checkpoint, no early stop
        started.append(workdir)
        return {}

    monkeypatch.setattr(loop, "train_and_evaluate", interrupted)
    assert sweep.main(["--config", CONFIG, "--workdir", str(tmp_path / "sw")]) == 1
    assert "variant base stopped at step 0 of 2; run the same command to resume it" in capsys.readouterr().err
    assert [p.name for p in started] == ["base"]  # pre_ln never started
    assert not (tmp_path / "sw" / "base" / results.RESULT_FILE).exists()
    assert (tmp_path / "sw" / "results.csv").exists()
