"""The local launcher end to end (slow: separate job processes through submitit's local executor): the same
results as the sequential launcher, a failed job named by --status, a preempted job requeued and resumed exactly."""

import csv
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from transformer_jax.sweep import __main__ as sweep
from transformer_jax.sweep import launch, runner
from transformer_jax.sweep.results import TEST, VALID
from transformer_jax.training.metrics import read_metrics

CONFIG = str(pathlib.Path(__file__).resolve().parent / "tiny_sweep_config.py")
ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMING = ("tokens_per_s", "wall_s")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_corpus_env")]


def _rows(workdir: pathlib.Path, name: str = "results.csv") -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(open(workdir / name))]


def _metrics(run_dir: pathlib.Path) -> list[dict]:
    timing = ("tokens_per_s", "steps_per_s", "mfu")
    return [{k: v for k, v in r.items() if k not in timing} for r in read_metrics(run_dir / "metrics.jsonl")]


def test_two_variants_with_parallel_2_give_the_sequential_results(corpus, tmp_path, capsys):
    sequential, local = tmp_path / "sequential", tmp_path / "local"
    assert sweep.main(["--config", CONFIG, "--workdir", str(sequential)]) == 0
    assert sweep.main(["--config", CONFIG, "--workdir", str(local), "--launcher", "local", "--parallel", "2"]) == 0
    assert _rows(local) == _rows(sequential) and len(_rows(local)) == 2
    for name in ("base", "pre_ln"):
        assert _metrics(local / name) == _metrics(sequential / name)
        assert (local / name / "valid.hyp").read_text() == (sequential / name / "valid.hyp").read_text()
        [version] = json.loads((local / name / runner.VERSION_FILE).read_text())
        assert version["snapshot"].startswith(str(local / "code"))  # the job imported the snapshot
    jobs = launch.load_jobs(local)
    assert sorted(jobs) == ["base", "pre_ln"]
    capsys.readouterr()
    assert sweep.main(["--config", CONFIG, "--workdir", str(local), "--status"]) == 0
    assert capsys.readouterr().out.split() == ["base", "finished", "pre_ln", "finished"]
    # Run again: nothing is submitted, the results are rebuilt.
    assert sweep.main(["--config", CONFIG, "--workdir", str(local), "--launcher", "local"]) == 0
    assert launch.load_jobs(local) == jobs
    # --split test: new jobs only decode the trained runs' test split, as the sequential launcher does.
    metrics = {name: _metrics(local / name) for name in ("base", "pre_ln")}
    assert sweep.main(["--config", CONFIG, "--workdir", str(sequential), "--split", "test"]) == 0
    args = ["--config", CONFIG, "--workdir", str(local), "--launcher", "local", "--parallel", "2", "--split", "test"]
    assert sweep.main(args) == 0
    assert _rows(local, "results_test.csv") == _rows(sequential, "results_test.csv")
    assert {label: r["split"] for label, r in launch.load_jobs(local).items()} == {"base": "test", "pre_ln": "test"}
    for name in ("base", "pre_ln"):
        assert _metrics(local / name) == metrics[name]
        hyps = TEST.hypotheses_file
        assert (local / name / hyps).read_text() == (sequential / name / hyps).read_text()


def test_a_failed_job_is_named_by_status_with_its_last_log_line(corpus, tmp_path, capsys):
    workdir = tmp_path / "sw"
    args = ["--config", CONFIG, "--workdir", str(workdir), "--only", "base", "--config.data.text_dir=/nonexistent"]
    assert sweep.main([*args, "--launcher", "local"]) == 1
    assert "runs ['base'] failed" in capsys.readouterr().err
    assert sweep.main([*args, "--status"]) == 0
    [line] = capsys.readouterr().out.strip().splitlines()
    label, state, last = line.split("\t")
    assert (label, state) == ("base", "failed")
    assert last.startswith("python -m transformer_jax.sweep: error: ") and "/nonexistent" in last


def _children(pid: int) -> list[int]:
    path = pathlib.Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_a_job_preempted_mid_training_is_requeued_and_resumes_exactly(corpus, tmp_path):
    config = tmp_path / "long.py"
    config.write_text(
        "from tests.tiny_sweep_config import get_config as tiny\n\n\n"
        "def get_config(arg=None):\n    config = tiny().unlock()\n    config.train.num_steps = 400\n"
        "    config.train.eval_every = 400\n    config.ckpt.every_steps = 400\n    return config.lock()\n\n\n"
        "def get_sweep(arg=None):\n    return [{'name': 'base'}]\n"
    )
    whole = tmp_path / "whole"
    assert sweep.main(["--config", str(config), "--workdir", str(whole)]) == 0
    workdir = tmp_path / "sw"
    command = [sys.executable, "-m", "transformer_jax.sweep", "--config", str(config), "--workdir", str(workdir)]
    sweep_process = subprocess.Popen([*command, "--launcher", "local"], cwd=ROOT)
    try:
        task, deadline = None, time.time() + 300
        while task is None and time.time() < deadline and sweep_process.poll() is None:
            metrics = workdir / "base" / "metrics.jsonl"
            jobs = launch.load_jobs(workdir) if (workdir / launch.JOBS_FILE).exists() else {}
            if "base" in jobs and metrics.exists() and any("loss" in r for r in read_metrics(metrics)):
                [task] = _children(int(jobs["base"]["job_id"]))
            time.sleep(0.05)
        assert task is not None, "training never started"
        os.kill(task, signal.SIGUSR2)
        assert sweep_process.wait(timeout=600) == 0
    finally:
        if sweep_process.poll() is None:
            sweep_process.kill()
    log = (workdir / "jobs" / f"{launch.load_jobs(workdir)['base']['job_id']}_0_log.err").read_text()
    assert "SIGUSR2 received; its checkpoint is saved, requeueing" in log and "Requeued job" in log
    assert "resumed from the checkpoint at step" in log
    assert _metrics(workdir / "base")[-1] == _metrics(whole / "base")[-1]
    hyps = VALID.hypotheses_file
    assert (workdir / "base" / hyps).read_text() == (whole / "base" / hyps).read_text()
