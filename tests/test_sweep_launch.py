"""Sweep launchers: a job's run and its preemption in this process, --status, the SLURM submission through
submitit's real code with stand-in sbatch/srun/sacct, and the launchers' bad input. The local executor's end-to-end
runs are in tests/test_sweep_launch_local.py (slow)."""

import contextlib
import dataclasses
import json
import os
import pathlib
import pickle
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.helpers.sweeps import fails, write_run
from transformer_jax.errors import VariantInterrupted
from transformer_jax.sweep import __main__ as sweep
from transformer_jax.sweep import launch, results, runner
from transformer_jax.sweep.launch import submitit
from transformer_jax.sweep.results import TEST, VALID
from transformer_jax.training import loop
from transformer_jax.training.metrics import read_metrics

# Through sweep.launch: importing submitit directly would reconfigure this process's logging (launch.py says why).
job_environment, utils = submitit.core.job_environment, submitit.core.utils

CONFIG = str(pathlib.Path(__file__).resolve().parent / "tiny_sweep_config.py")

pytestmark = pytest.mark.usefixtures("tiny_corpus_env")


def _base_config():
    return runner.variants(CONFIG)[0].config


def _train_records(run_dir: pathlib.Path) -> list[dict]:
    return [
        {k: v for k, v in r.items() if "per_s" not in k and "time" not in k}
        for r in read_metrics(run_dir / "metrics.jsonl")
    ]


@contextlib.contextmanager
def _as_submitit_job(job_object: launch.RunJob, folder: pathlib.Path, monkeypatch) -> Iterator[utils.JobPaths]:
    """In this process, the signal handlers submitit's local job process installs around `job_object` (its real
    SignalHandler: checkpoint(), dump the submission, requeue with exit status 144). Yields the job's paths; the
    submission to run is utils.DelayedSubmission.load(paths.submitted_pickle)."""
    folder.mkdir()
    for name, value in {
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_LOCAL_JOB_ID": "7",
        "SUBMITIT_FOLDER": str(folder),
    }.items():
        monkeypatch.setenv(name, value)
    paths = utils.JobPaths(folder, job_id="7", task_id=0)
    delayed = utils.DelayedSubmission(job_object)
    delayed.set_timeout(60, 3)
    delayed.dump(paths.submitted_pickle)
    handler = job_environment.SignalHandler(job_environment.JobEnvironment(), paths, delayed)
    usr = launch.preemption_signal()
    previous = signal.signal(usr, handler.checkpoint_and_try_requeue), signal.signal(signal.SIGTERM, handler.bypass)
    try:
        yield paths
    finally:
        signal.signal(usr, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


@pytest.mark.parametrize("where", ["training", "between"])
def test_the_preemption_signal_stops_the_phase_then_submitit_requeues(tmp_path, monkeypatch, where):
    """USR2 during training sets the loop's stop request (which saves at the next step) before submitit's handler
    runs; outside training and decoding it stops the job at once. Either way submitit requeues this same run."""
    seen = []

    def run(label, config, run_dir, split):
        if where == "training":
            with loop.StopRequest() as stop:
                os.kill(os.getpid(), launch.preemption_signal())
                seen.append(stop.requested.is_set())  # the loop would now save its checkpoint and return
            raise VariantInterrupted(f"variant {label} stopped at step 1 of 2")
        os.kill(os.getpid(), launch.preemption_signal())
        seen.append("not reached")

    monkeypatch.setattr(launch, "train_and_decode", run)
    the_job = launch.RunJob("base", None, tmp_path / "base", VALID, None)
    with _as_submitit_job(the_job, tmp_path / "jobs", monkeypatch) as paths:
        with pytest.raises(SystemExit) as exit_info:
            utils.DelayedSubmission.load(paths.submitted_pickle).result()
    assert exit_info.value.code == 144  # submitit's local requeue
    assert seen == ([True] if where == "training" else [])
    assert utils.DelayedSubmission.load(paths.submitted_pickle).function == the_job


@pytest.mark.slow
def test_a_preempted_job_saves_requeues_through_submitit_and_resumes_exactly(corpus, tmp_path, monkeypatch):
    """USR2 at step 1 of 2: the loop saves step 1, submitit's handler dumps checkpoint()'s submission and requeues;
    that submission resumes, and the run equals an uninterrupted one."""
    config = _base_config()
    whole = tmp_path / "whole"
    assert launch.RunJob("whole", config, whole, VALID, None)() == "whole"
    run_dir = tmp_path / "preempted"
    due = loop.StopRequest.due
    sent = []

    def signal_at_step_1(self, step):
        if step == 1 and not sent:
            sent.append(step)
            os.kill(os.getpid(), launch.preemption_signal())
        return due(self, step)

    monkeypatch.setattr(loop.StopRequest, "due", signal_at_step_1)
    the_job = launch.RunJob("preempted", config, run_dir, VALID, None)
    with _as_submitit_job(the_job, tmp_path / "jobs", monkeypatch) as paths:
        with pytest.raises(SystemExit) as exit_info:
            utils.DelayedSubmission.load(paths.submitted_pickle).result()
        assert exit_info.value.code == 144
        assert sent == [1] and not (run_dir / results.RESULT_FILE).exists()
        assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r] == [1]
        assert utils.DelayedSubmission.load(paths.submitted_pickle).result() == "preempted"  # the restarted job
    assert results.decoded(run_dir, VALID)
    assert _train_records(run_dir)[-1] == _train_records(whole)[-1]
    assert (run_dir / VALID.hypotheses_file).read_text() == (whole / VALID.hypotheses_file).read_text()
    version = json.loads((run_dir / runner.VERSION_FILE).read_text())
    assert len(version) == 1 and version[0]["source"] == str(runner.package_root().parent)


def test_a_plain_sigterm_ends_the_job_with_one_line(tmp_path, monkeypatch, capsys):
    """Without submitit's signal (scancel's SIGTERM) the loop saves and the job ends, its log's last line the
    error; nothing is requeued (the next sweep command resubmits the run)."""

    def run(label, config, run_dir, split):
        with loop.StopRequest():
            os.kill(os.getpid(), signal.SIGTERM)
        raise VariantInterrupted(f"variant {label} stopped at step 1 of 2")  # what run_variant raises then

    monkeypatch.setattr(launch, "train_and_decode", run)
    with pytest.raises(SystemExit) as exit_info:
        launch.RunJob("base", None, tmp_path / "base", VALID, None)()
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"{runner.PROG}: error: variant base stopped at step 1 of 2"
    )


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_status_names_each_state_and_a_failed_runs_last_log_line(corpus, tmp_path, capsys):
    workdir = tmp_path / "sw"
    folder = workdir / "jobs"
    folder.mkdir(parents=True)
    failed = _dead_pid()
    (folder / f"{failed}_0_log.err").write_text(
        "INFO:submitit:Starting\nsweep: error: data.text_dir /x: no such folder\n\n"
    )
    record = {"launcher": "local", "folder": str(folder), "host": socket.gethostname()}
    jobs = {"base": {**record, "job_id": str(failed)}, "pre_ln": {**record, "job_id": str(os.getpid())}}
    (workdir / launch.JOBS_FILE).write_text(json.dumps(jobs))
    assert sweep.main(["--config", CONFIG, "--workdir", str(workdir), "--status"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == [
        "base\tfailed\tsweep: error: data.text_dir /x: no such folder",
        f"pre_ln\trunning\tlocal job {os.getpid()}",
    ]
    assert not (workdir / launch.LOCK_NAME).exists()  # --status owns nothing


def test_a_job_for_split_test_decodes_the_validation_then_the_test_split(tmp_path, monkeypatch):
    """The job side of --split test (through pickling, as submitit hands it over): train (skipped when finished),
    then decode the validation split, then the test split."""
    calls = []
    monkeypatch.setattr(runner, "run_variant", lambda label, config, run_dir: calls.append(("train", label)))
    monkeypatch.setattr(runner, "decode_run", lambda label, run_dir, split: calls.append(("decode", split.name)))
    monkeypatch.setattr(runner, "record_code_version", lambda run_dir: None)
    the_job = pickle.loads(pickle.dumps(launch.RunJob("base", None, tmp_path / "base", TEST, None)))
    assert the_job() == "base"
    assert calls == [("train", "base"), ("decode", "valid"), ("decode", "test")]


def test_split_test_submits_runs_decoded_on_validation_only_and_status_tells_why(corpus, tmp_path, monkeypatch, capsys):
    """Runs whose jobs finished them for --split valid are 'not decoded' for --split test (a job of --split test
    that ended without the test split failed), and --split test submits jobs that decode the test split."""
    workdir = tmp_path / "sw"
    refs = (corpus / "valid.de").read_text(encoding="utf-8").splitlines()
    for name in ("base", "pre_ln"):
        write_run(workdir / name, refs, refs, perplexity=5.0)
    folder = workdir / "jobs"
    folder.mkdir()
    ended = _dead_pid()
    (folder / f"{ended}_0_log.err").write_text("sweep: error: split 'test' of data.source=text has no lines\n")
    record = {"launcher": "local", "folder": str(folder), "host": socket.gethostname(), "job_id": str(ended)}
    jobs = {"base": {**record, "split": "valid"}, "pre_ln": {**record, "split": "test"}}
    (workdir / launch.JOBS_FILE).write_text(json.dumps(jobs))
    args = ["--config", CONFIG, "--workdir", str(workdir)]
    assert sweep.main([*args, "--status"]) == 0
    assert capsys.readouterr().out.split() == ["base", "finished", "pre_ln", "finished"]
    assert sweep.main([*args, "--status", "--split", "test"]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [
        "base\tnot decoded\tthe test split is not decoded yet; run the sweep with --split test",
        "pre_ln\tfailed\tsweep: error: split 'test' of data.source=text has no lines",
    ]
    states = tmp_path / "states"
    states.write_text("1234_0|PENDING|\n1234_1|PENDING|\n")
    _stand_ins(tmp_path / "bin", states)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert sweep.main([*args, "--split", "test", "--launcher", "slurm"]) == 0
    jobs = launch.load_jobs(workdir)
    assert {label: (r["job_id"], r["split"]) for label, r in jobs.items()} == {
        "base": ("1234_0", "test"),
        "pre_ln": ("1234_1", "test"),
    }
    for i in range(2):
        assert utils.DelayedSubmission.load(folder / f"1234_{i}_submitted.pkl").function.split == TEST


def _stand_ins(bin_dir: pathlib.Path, state_file: pathlib.Path) -> pathlib.Path:
    """sbatch (keeps each script it gets, answers job 1234, 1235, ...), srun (only found), sacct (the states of
    state_file's lines), all on a PATH of their own."""
    bin_dir.mkdir()
    scripts = bin_dir / "scripts"
    scripts.mkdir()
    tools = {
        "sbatch": f'n=$(ls {scripts} | wc -l); cp "$1" {scripts}/$n.sh; echo "Submitted batch job $((1234 + n))"',
        "srun": "exit 0",
        "sacct": f'echo "JobID|State|NodeList"; cat {state_file}',
    }
    for name, body in tools.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return scripts


@pytest.mark.parametrize("nodes", [1, 4])
def test_slurm_submits_one_array_with_the_flags_sbatch_lines_and_never_a_second_copy(
    corpus, tmp_path, monkeypatch, capsys, nodes
):
    states = tmp_path / "states"
    states.write_text("1234_[0-1%1]|PENDING|\n")
    scripts = _stand_ins(tmp_path / "bin", states)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    workdir = tmp_path / "sw"
    args = ["--config", CONFIG, "--workdir", str(workdir), "--launcher", "slurm", "--parallel", "1"]
    args += [f"--slurm_nodes={nodes}", "--gpus_per_node=8", "--slurm_partition=gpu", "--slurm_cpus_per_task=12"]
    args += ["--slurm_mem=200G", "--time_min=120", "--slurm_account=nlp", "--slurm_qos=high"]
    args += ["--slurm_extra=constraint=h100", "--slurm_extra=exclusive"]
    assert sweep.main(args) == 0
    assert "2 runs pending or running" in capsys.readouterr().err
    [script] = scripts.iterdir()
    text = script.read_text()
    sbatch = sorted(line for line in text.splitlines() if line.startswith("#SBATCH"))
    folder = workdir / "jobs"
    assert sbatch == sorted(
        [
            "#SBATCH --account=nlp",
            "#SBATCH --array=0-1%1",
            "#SBATCH --constraint=h100",
            "#SBATCH --cpus-per-task=12",
            f"#SBATCH --error={folder}/%A_%a_0_log.err",
            "#SBATCH --exclusive",
            "#SBATCH --gpus-per-node=8",
            f"#SBATCH --job-name=sweep-{workdir.name}",
            "#SBATCH --mem=200G",
            f"#SBATCH --nodes={nodes}",
            "#SBATCH --ntasks-per-node=1",
            "#SBATCH --open-mode=append",
            f"#SBATCH --output={folder}/%A_%a_0_log.out",
            "#SBATCH --partition=gpu",
            "#SBATCH --qos=high",
            "#SBATCH --signal=USR2@90",
            "#SBATCH --time=120",
            "#SBATCH --wckey=submitit",
        ]
    )
    [snapshot] = (workdir / "code").iterdir()
    command = text.strip().splitlines()[-1]
    assert command.startswith("srun --unbuffered --output ")
    env = f"PYTHONPATH={snapshot}" + (" TRANSFORMER_JAX_DISTRIBUTED=1" if nodes > 1 else "")
    assert f"env {env}" in command and f" -P -u -m submitit.core._submit {folder}" in command
    snapshot_launch = snapshot / "transformer_jax" / "sweep" / "launch.py"
    assert snapshot_launch.read_text() == pathlib.Path(launch.__file__).read_text()
    jobs = launch.load_jobs(workdir)
    assert {label: r["job_id"] for label, r in jobs.items()} == {"base": "1234_0", "pre_ln": "1234_1"}
    pickled = utils.DelayedSubmission.load(folder / "1234_1_submitted.pkl").function
    assert isinstance(pickled, launch.RunJob) and pickled.label == "pre_ln"
    assert pickled.run_dir == workdir / "pre_ln"

    # Pending and running runs are not submitted again; a run whose job ended without finishing it is.
    states.write_text("1234_0|RUNNING|node1\n1234_1|PENDING|\n")
    assert sweep.main(args) == 0
    assert len(list(scripts.iterdir())) == 1
    assert sweep.main(["--config", CONFIG, "--workdir", str(workdir), "--status"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-2:] == [
        "base\trunning\tslurm job 1234_0",
        "pre_ln\tpending\tslurm job 1234_1",
    ]
    states.write_text("1234_0|RUNNING|node1\n1234_1|CANCELLED by 5|\n")
    monkeypatch.setattr(launch.submitit.SlurmJob.watcher, "_finished", set())  # a new command: nothing cached
    assert sweep.main(args) == 0
    assert len(list(scripts.iterdir())) == 2 and "--array" not in (scripts / "1.sh").read_text()
    assert launch.load_jobs(workdir)["pre_ln"]["job_id"] == "1235"


def test_parallel_zero_and_flags_of_another_launcher_are_one_line(corpus, tmp_path, capsys):
    base = ["--config", CONFIG, "--workdir", str(tmp_path / "sw")]
    assert "--parallel" in fails([*base, "--launcher", "local", "--parallel", "0"], capsys)
    assert "--slurm_partition is for --launcher slurm" in fails(
        [*base, "--launcher", "local", "--slurm_partition=x"], capsys
    )
    assert "--slurm_extra '=1'" in fails([*base, "--launcher", "slurm", "--slurm_extra==1"], capsys)
    assert "--parallel is for --launcher local or slurm" in fails([*base, "--parallel", "2"], capsys)
    assert not (tmp_path / "sw").exists()


def test_a_sweep_directory_owned_by_another_running_command_is_one_line(corpus, tmp_path, capsys):
    workdir = tmp_path / "sw"
    workdir.mkdir()
    other = subprocess.Popen(["sleep", "60"])
    try:
        lock = {"pid": other.pid, "host": socket.gethostname(), "started": "2026-01-01T00:00:00Z"}
        (workdir / launch.LOCK_NAME).write_text(json.dumps(lock))
        err = fails(["--config", CONFIG, "--workdir", str(workdir), "--launcher", "local"], capsys)
        assert f"in use by another sweep command: {workdir / launch.LOCK_NAME} is held by process {other.pid}" in err, (
            err
        )
        assert not (workdir / launch.JOBS_FILE).exists()
    finally:
        other.kill()
        other.wait()


def test_the_local_launcher_never_runs_more_than_parallel_jobs_at_once(tmp_path, monkeypatch):
    """submitit's local executor starts every job it gets; the launcher hands it the next run as one ends, and
    counts a run still running from an earlier command."""
    running: list[str] = []
    most = []

    class Job:
        def __init__(self, label):
            self.job_id, self.label, self.polls = str(1000 + len(most)), label, 0

        def done(self):
            self.polls += 1
            if self.polls == 3:
                running.remove(self.label)
            return self.polls >= 3

    class Executor:
        def submit(self, run_job):
            running.append(run_job.label)
            most.append(len(running))
            return Job(run_job.label)

    earlier = {"launcher": "local", "job_id": str(os.getpid()), "host": socket.gethostname(), "folder": "f"}
    alive = iter([True, True, True, False])
    monkeypatch.setattr(launch, "_local_alive", lambda record: next(alive, False))
    monkeypatch.setattr(launch, "POLL_S", 0.0)
    tasks = [launch.RunJob(f"r{i}", None, tmp_path / f"r{i}", VALID, None) for i in range(5)]
    launcher = launch.Launcher(name="local", parallel=2)
    launch._run_local(
        launcher, Executor(), tasks, [dataclasses.replace(tasks[0], label="old")], tmp_path, {"old": earlier}
    )
    assert running == [] and len(most) == 5
    assert most[:2] == [1, 1]  # r1 waited for "old" (still running from an earlier command) to end
    assert max(most) == 2
    assert sorted(launch.load_jobs(tmp_path)) == ["old", "r0", "r1", "r2", "r3", "r4"]


def test_what_sbatch_refuses_is_its_message_in_one_line(corpus, tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {
        "sbatch": "echo 'sbatch: error: invalid partition specified: nope' >&2; exit 1",
        "srun": "",
    }.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    args = ["--config", CONFIG, "--workdir", str(tmp_path / "sw"), "--launcher", "slurm", "--slurm_partition=nope"]
    with pytest.raises(SystemExit) as exit_info:
        sweep.main(args)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # submitit prints sbatch's stderr first
    assert last == (
        f"{runner.PROG}: error: sbatch refused the sweep's jobs (sbatch: error: invalid partition specified: nope); "
        "check the --slurm_* flags"
    )
    assert not (tmp_path / "sw" / launch.JOBS_FILE).exists()


def test_a_local_job_gets_the_time_limit_and_gpus(tmp_path):
    """In minutes, fractions kept (submitit's local executor signals signal_delay_s before it)."""
    launcher = launch.Launcher(name="local", time_min=0.5, gpus_per_node=2)
    ex = launch.executor(launcher, tmp_path / "sw" / "jobs", tmp_path / "snapshot", 2)
    assert ex.parameters == {"name": "sweep-sw", "tasks_per_node": 1, "gpus_per_node": 2, "timeout_min": 0.5}


def test_importing_the_sweep_keeps_the_processs_logging_handlers(tmp_path):
    """submitit configures logging when first imported, closing every handler the process has (pytest's capture,
    absl's, a log file); through sweep/launch.py it does not, and SUBMITIT_LOG_LEVEL is left as it was."""
    script = (
        "import logging, os, sys\n"
        f"handler = logging.FileHandler({str(tmp_path / 'log.txt')!r})\n"
        "logging.getLogger().addHandler(handler)\n"
        "import transformer_jax.sweep.__main__\n"
        "assert 'submitit' in sys.modules\n"
        "assert handler.stream is not None and not handler.stream.closed, 'the handler was closed'\n"
        "assert 'SUBMITIT_LOG_LEVEL' not in os.environ\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "SUBMITIT_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
