"""Experiment trackers (train.trackers): W&B offline and MLflow on a local SQLite store get the resolved config,
every metric of metrics.jsonl at its step and the final scores; a resumed run continues the same tracker runs
without logging a step twice or out of order; a bad tracker name or a missing package is one line before any work.

W&B runs offline (WANDB_MODE) with WANDB_BASE_URL and the HTTP(S) proxies pointed at a local listener that counts
connections: any attempt to reach a server would reach it. Its offline run files (run-ID.wandb: W&B's record log,
LevelDB-log blocks of protobuf Records) are read back with W&B's own protobuf classes.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import socket
import struct
import subprocess
import sys
import threading

import pytest

from tests.helpers import REPO
from tests.helpers.training import tiny_train_config
from transformer_jax import cli
from transformer_jax.config.schema import TRACKERS
from transformer_jax.errors import ConfigError
from transformer_jax.training import metrics
from transformer_jax.training.loop import train_and_evaluate
from transformer_jax.training.metrics import MetricWriter, read_metrics


class Listener:
    """A TCP socket on 127.0.0.1 that counts the connections made to it."""

    def __init__(self):
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.port, self.connections = self.socket.getsockname()[1], 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.socket.accept()
            except OSError:
                return
            self.connections += 1
            connection.close()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Offline W&B and a SQLite MLflow store in one directory for the module (the store's tables are made once)."""
    root = tmp_path_factory.mktemp("trackers")
    (root / "wandb").mkdir()
    listener = Listener()
    url = f"http://127.0.0.1:{listener.port}"
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {
            "WANDB_MODE": "offline",
            "WANDB_DIR": str(root / "wandb"),
            "WANDB_SILENT": "true",
            "WANDB_BASE_URL": url,
            "HTTP_PROXY": url,
            "HTTPS_PROXY": url,
            "NO_PROXY": "",
            "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
        }.items():
            patch.setenv(name, value)
        yield root, listener
    listener.socket.close()


def wandb_runs(wandb_dir: pathlib.Path, run_id: str) -> list[dict]:
    """Each offline W&B run of `run_id` (one per start of the training run), in the order they started: its group,
    config, history ({step: {key: value}}) and summary."""
    from wandb.proto import wandb_internal_pb2

    runs = []
    for path in wandb_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"):
        run = {"config": {}, "history": {}, "summary": {}}
        for record in _records(path.read_bytes(), wandb_internal_pb2.Record):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["group"], run["start"] = record.run.run_group, record.run.start_time.ToMicroseconds()
                run["config"].update(_items(record.run.config.update))
            elif kind == "config":
                run["config"].update(_items(record.config.update))
            elif kind == "history":
                run["history"].setdefault(record.history.step.num, {}).update(_items(record.history.item))
            elif kind == "summary":
                run["summary"].update(_items(record.summary.update))
        runs.append(run)
    return sorted(runs, key=lambda run: run["start"])


def as_json(params: dict) -> dict:
    """The config parameters as W&B keeps them: JSON, so a list-valued key's tuple is a list."""
    return json.loads(json.dumps(params))


def _items(items) -> dict:
    out = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in items}
    return {key: value for key, value in out.items() if not key.startswith("_")}  # W&B's own (_step, _runtime)


def _records(raw: bytes, record_class):
    """The records of a W&B run file: a 7-byte header (':W&B', magic, version), then LevelDB-log blocks of 32 KiB,
    each chunk a 7-byte header (CRC32, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes."""
    assert raw[:4] == b":W&B"
    position, pieces = 7, b""
    while position + 7 <= len(raw):
        left = 32768 - position % 32768
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[position : position + 7])
        if kind == 0:
            break
        pieces = (b"" if kind in (1, 2) else pieces) + raw[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = record_class()
            record.ParseFromString(pieces)
            yield record


def jsonl_by_step(path: pathlib.Path) -> dict[int, dict]:
    """metrics.jsonl's records merged by step (a step has a train record and a validation record)."""
    steps: dict[int, dict] = {}
    for record in read_metrics(path):
        steps.setdefault(record["step"], {}).update({k: v for k, v in record.items() if k != "step"})
    return steps


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def assert_same_steps(got: dict[int, dict], want: dict[int, dict]) -> None:
    assert sorted(got) == sorted(want)
    for step, values in want.items():
        assert got[step].keys() == values.keys(), step
        assert all(same(got[step][k], v) for k, v in values.items()), (step, got[step], values)


def mlflow_run(experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]


def mlflow_history(client, run) -> dict[int, dict]:
    """{step: {metric: value}} of an MLflow run's metric histories (final/* aside); each (metric, step) once."""
    steps: dict[int, dict] = {}
    for key in run.data.metrics:
        if key.startswith("final/"):
            continue
        history = client.get_metric_history(run.info.run_id, key)
        points = [m.step for m in sorted(history, key=lambda m: m.timestamp)]
        assert points == sorted(set(points)), (key, points)  # strictly increasing: no step twice, none out of order
        for m in history:
            steps.setdefault(m.step, {})[key] = m.value
    return steps


@pytest.mark.slow  # ~25 s: a training run, W&B's start (~5 s of its imports) and MLflow's store (~5 s)
def test_a_run_logs_config_metrics_and_final_scores_to_offline_wandb_and_mlflow(env, corpus, tmp_path):
    """End to end through the training loop (the fast representative is the resumed writer's test below)."""
    pytest.importorskip("wandb", reason="wandb is optional: pip install -r requirements-dev.txt")
    pytest.importorskip("mlflow", reason="mlflow is optional: pip install -r requirements-dev.txt")
    root, listener = env
    config = tiny_train_config(corpus, trackers=("tensorboard", "wandb", "mlflow"), tracker_group="grp")
    workdir = tmp_path / "run"
    train_and_evaluate(config, workdir)
    want = jsonl_by_step(workdir / "metrics.jsonl")
    assert {1, 3, 6} <= set(want) and "valid_loss" in want[6]
    params = dict(cli.leaves(config))
    last = {k: v for step in sorted(want) for k, v in want[step].items()}
    ids = json.loads((workdir / metrics.STATE_FILE).read_text())
    assert ids["wandb"]["last_step"] == ids["mlflow"]["last_step"] == 6

    (wandb_run,) = wandb_runs(root / "wandb", ids["wandb"]["id"])
    assert wandb_run["group"] == "grp" and wandb_run["config"] == as_json(params)
    assert_same_steps(wandb_run["history"], want)
    assert wandb_run["summary"]["final_step"] == 6
    assert all(same(wandb_run["summary"][k], v) for k, v in last.items())
    assert listener.connections == 0  # offline: W&B reached for no server
    assert not (workdir / "wandb").exists()  # WANDB_DIR holds its files

    client, run = mlflow_run("grp")
    assert run.info.run_id == ids["mlflow"]["id"] and run.info.status == "FINISHED"
    assert run.data.params == {k: str(v) for k, v in params.items()}
    assert_same_steps(mlflow_history(client, run), want)
    assert run.data.metrics["final/final_step"] == 6
    assert all(same(run.data.metrics[f"final/{k}"], v) for k, v in last.items())
    assert list((workdir / "tensorboard" / "hparams").iterdir())  # TensorBoard's config and final scores


def _write(writer: MetricWriter, steps: range, offset: float) -> None:
    for step in steps:
        writer.write(step, {"loss": step + offset, "learning_rate": 0.1})
        if step % 3 == 0:
            writer.write(step, {"loss": step + offset}, prefix="valid_")


def test_a_resumed_writer_continues_the_tracker_runs_and_skips_the_steps_they_had(env, corpus, tmp_path):
    """The interrupted start logged steps 0..5 with its checkpoint at 3; the restart logs 3 (its data record), 4..8.
    W&B and MLflow continue the same runs, each step once and in order: 4 and 5 keep the first start's values
    (metrics.superseded.jsonl's), the steps after it get the restart's, which metrics.jsonl holds."""
    pytest.importorskip("wandb", reason="wandb is optional: pip install -r requirements-dev.txt")
    pytest.importorskip("mlflow", reason="mlflow is optional: pip install -r requirements-dev.txt")
    root, _ = env
    config = tiny_train_config(corpus, trackers=("wandb", "mlflow"), tracker_group="resumed")
    params = dict(cli.leaves(config))
    writer = MetricWriter(tmp_path, config=config)
    _write(writer, range(0, 6), offset=0.0)
    writer.close()  # no finish: the first start was interrupted
    first = json.loads((tmp_path / metrics.STATE_FILE).read_text())
    client, run = mlflow_run("resumed")
    assert run.info.status == "FAILED" and run.data.params == {k: str(v) for k, v in params.items()}
    config.train.num_steps = 8  # a key that may change on resume: W&B's config and an MLflow tag follow it
    writer = MetricWriter(tmp_path, resume_step=3, config=config)
    writer.write(3, {"data_examples": 400})  # as the loop's restart logs at its checkpoint's step
    _write(writer, range(4, 9), offset=0.5)
    writer.finish({"stopped_early_at": 8})
    writer.close()
    second = json.loads((tmp_path / metrics.STATE_FILE).read_text())
    assert {k: v["id"] for k, v in second.items()} == {k: v["id"] for k, v in first.items()}
    assert first["mlflow"]["last_step"] == 5 and second["mlflow"]["last_step"] == 8

    want = {s: {"loss": s + (0.5 if s > 5 else 0.0), "learning_rate": 0.1} for s in range(9)}
    for s in (0, 3, 6):
        want[s]["valid_loss"] = s + (0.5 if s > 5 else 0.0)
    jsonl = jsonl_by_step(tmp_path / "metrics.jsonl")
    assert all(jsonl[s] == want[s] for s in (6, 7, 8))
    runs = wandb_runs(root / "wandb", first["wandb"]["id"])
    assert len(runs) == 2 and runs[0]["config"] == as_json(params) and runs[0]["group"] == "resumed"
    assert runs[1]["config"] == as_json({**params, "train.num_steps": 8})
    final = {"loss": 8.5, "learning_rate": 0.1, "valid_loss": 6.5, "data_examples": 400, "stopped_early_at": 8}
    assert runs[1]["summary"] == {**final, "final_step": 8}
    assert sorted(runs[0]["history"]) == [0, 1, 2, 3, 4, 5] and sorted(runs[1]["history"]) == [6, 7, 8]
    assert_same_steps({**runs[0]["history"], **runs[1]["history"]}, want)
    client, run = mlflow_run("resumed")
    assert_same_steps(mlflow_history(client, run), want)
    assert run.data.params["train.num_steps"] == "6" and run.data.tags["resumed_with.train.num_steps"] == "8"
    assert run.info.status == "FINISHED"
    assert {k: v for k, v in run.data.metrics.items() if k.startswith("final/")} == {
        f"final/{k}": v for k, v in {**final, "final_step": 8}.items()
    }


@pytest.mark.slow
def test_an_interrupted_training_run_resumes_the_same_tracker_runs(env, corpus, tmp_path):
    """End to end: a run of 6 steps loses its last checkpoint (6) and is resumed to 8 steps from 3; the trackers
    keep one run each whose steps strictly increase, and its steps 7 and 8 are metrics.jsonl's."""
    pytest.importorskip("wandb", reason="wandb is optional: pip install -r requirements-dev.txt")
    pytest.importorskip("mlflow", reason="mlflow is optional: pip install -r requirements-dev.txt")
    root, _ = env
    config = tiny_train_config(corpus, trackers=("wandb", "mlflow"), tracker_group="interrupted")
    train_and_evaluate(config, tmp_path)
    first = json.loads((tmp_path / metrics.STATE_FILE).read_text())
    shutil.rmtree(tmp_path / "checkpoints" / "6")
    train_and_evaluate(
        tiny_train_config(corpus, trackers=("wandb", "mlflow"), tracker_group="interrupted", num_steps=8), tmp_path
    )
    second = json.loads((tmp_path / metrics.STATE_FILE).read_text())
    assert {k: v["id"] for k, v in second.items()} == {k: v["id"] for k, v in first.items()}
    jsonl = jsonl_by_step(tmp_path / "metrics.jsonl")
    client, run = mlflow_run("interrupted")
    history = mlflow_history(client, run)  # asserts each metric's steps strictly increase
    assert sorted(history) == sorted(jsonl)
    assert_same_steps({s: history[s] for s in (7, 8)}, {s: jsonl[s] for s in (7, 8)})
    runs = wandb_runs(root / "wandb", first["wandb"]["id"])
    steps = [step for r in runs for step in sorted(r["history"])]
    assert len(runs) == 2 and steps == sorted(set(steps)) == sorted(jsonl)


def test_an_unknown_tracker_is_one_line_naming_the_key_and_the_known_ones(corpus):
    config = tiny_train_config(corpus, trackers=("tensorboard", "comet"))
    with pytest.raises(ConfigError) as error:
        cli.validate(config)
    message = str(error.value)
    assert "\n" not in message and "config key train.trackers" in message and "'comet'" in message
    assert all(name in message for name in TRACKERS)
    config = tiny_train_config(corpus, trackers=(" wandb,tensorboard,,wandb ",))  # --config.train.trackers=...
    cli.validate(config)
    assert config.train.trackers == ("wandb", "tensorboard")  # split by the key's rule: each once, in order


def test_a_missing_tracker_package_is_one_line_saying_what_to_install(corpus, monkeypatch):
    """Training needs the package; a config naming the tracker is still valid (evaluate.py --config, a fine-tuning
    source that logged to MLflow), so only the validation of a config to train (train.py, the sweep) refuses it."""
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what `import mlflow` finds when it is not installed
    config = tiny_train_config(corpus, trackers=("tensorboard", "mlflow"))
    cli.validate(config)
    with pytest.raises(ConfigError) as error:
        cli.validate(config, training=True)
    message = str(error.value)
    assert "\n" not in message and "config key train.trackers: mlflow needs its package" in message
    assert f"pip install {TRACKERS['mlflow']}" in message


@pytest.mark.slow  # ~5 s: a train.py process
def test_a_missing_tracker_package_stops_train_py_before_any_work_with_what_to_install(corpus, tmp_path):
    """wandb made unimportable (sys.modules['wandb'] = None, as for a package not installed) in a train.py process."""
    script = (
        "import runpy, sys\n"
        "sys.modules['wandb'] = None\n"
        f"sys.argv = ['train.py', '--config=tests/tiny_train_config.py', '--workdir={tmp_path / 'run'}',"
        f" '--config.data.text_dir={corpus}', '--config.train.trackers=tensorboard,wandb']\n"
        "runpy.run_path('train.py', run_name='__main__')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "config key train.trackers" in lines[0], result.stderr
    assert f"pip install {TRACKERS['wandb']}" in lines[0]
    assert not (tmp_path / "run").exists()


def test_requirements_dev_pins_the_tracker_packages_the_error_names():
    pins = (REPO / "requirements-dev.txt").read_text().split()
    assert all(requirement in pins for requirement in TRACKERS.values() if requirement)
    assert "wandb" not in (REPO / "requirements.txt").read_text()


def test_the_sweep_groups_its_runs_by_its_directory(tmp_path, tiny_corpus_env, capsys):
    from transformer_jax.sweep import __main__ as sweep

    config, workdir = str(REPO / "tests" / "tiny_sweep_config.py"), tmp_path / "ablation"
    assert sweep.main(["--config", config, "--workdir", str(workdir), "--print_commands"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all("--config.train.tracker_group=ablation" in line for line in lines)
    args = ["--config", config, "--workdir", str(workdir), "--print_commands", "--config.train.tracker_group=mine"]
    assert sweep.main(args) == 0
    assert all("--config.train.tracker_group=mine" in line for line in capsys.readouterr().out.splitlines())
    assert not os.path.exists(workdir)


def test_only_process_0_logs_to_trackers(env, corpus, tmp_path, monkeypatch):
    """Another host's writer (as its metrics.jsonl) opens no tracker: no W&B or MLflow run, no trackers.json."""
    monkeypatch.setattr(metrics.jax, "process_index", lambda: 1)
    writer = MetricWriter(tmp_path, config=tiny_train_config(corpus, trackers=("tensorboard", "wandb", "mlflow")))
    writer.write(1, {"loss": 1.0})
    writer.finish({})
    writer.close()
    assert list(tmp_path.iterdir()) == []
