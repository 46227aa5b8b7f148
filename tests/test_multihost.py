"""A real multi-process launch on one machine: train.py as 2 JAX processes (one CPU device each, gloo collectives)
joined through JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, exactly as the README launches hosts.

It must train on exactly the batches of one process with 2 devices (bucketed shapes vary per batch, so the hosts
must agree on every shape), write each checkpoint as 2 processes and resume from it, and write metrics once.
"""

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.training_helpers import tiny_train_config, write_corpus
from transformer_jax.training import checkpoints
from transformer_jax.training.metrics import read_metrics

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = REPO / "tests" / "tiny_train_config.py"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _command(corpus: pathlib.Path, workdir: pathlib.Path, num_steps: int) -> list[str]:
    overrides = {
        "data.text_dir": corpus,
        "data.batching": "bucket",  # shapes vary from batch to batch: the hard case for several hosts
        "data.tokens_per_batch": 256,
        "model.dropout_rate": 0.0,  # dropout masks depend on the device layout, not on the host count
        "train.num_steps": num_steps,
        "train.eval_every": 3,
        "ckpt.every_steps": 3,
        "data.tokenizer_model": corpus.parent / "spm.model",
    }
    args = [f"--config.{k}={v}" for k, v in overrides.items()]
    return [sys.executable, str(REPO / "train.py"), "--config", str(CONFIG), "--workdir", str(workdir), *args]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def _run(commands_envs: list[tuple[list[str], dict[str, str]]], timeout: float = 400) -> None:
    procs = [
        subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd, env in commands_envs
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            proc.kill()
    for i, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"process {i} of {len(procs)} failed:\n{out[-4000:]}"


def _two_processes(corpus: pathlib.Path, workdir: pathlib.Path, num_steps: int) -> None:
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    launches = []
    for process_id in range(2):
        env = _env(
            JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(process_id),
            XLA_FLAGS=os.environ.get("XLA_FLAGS", ""),
        )
        launches.append((_command(corpus, workdir, num_steps), env))
    _run(launches)


def _losses(workdir: pathlib.Path) -> tuple[list[int], list[float], list[float]]:
    records = read_metrics(workdir / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    valid = [r["valid_loss"] for r in records if "valid_loss" in r]
    return [r["step"] for r in train], [r["loss"] for r in train], valid


def test_two_processes_train_and_resume_exactly_like_one_process_with_two_devices(corpus, tmp_path):
    from transformer_jax import data
    from transformer_jax.training.checkpoints import load_config

    # One tokenizer for every run, trained once beforehand as the README says for multi-host runs.
    config = tiny_train_config(corpus)
    data.get_tokenizer(config.data, corpus.parent, vocab_size=config.model.vocab_size)

    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    _run([(_command(corpus, tmp_path / "one", 9), _env(XLA_FLAGS=flags))])
    _two_processes(corpus, tmp_path / "two", 6)
    assert checkpoints.list_steps(tmp_path / "two") == [3, 6]
    _two_processes(corpus, tmp_path / "two", 9)  # resumes from step 6 on both processes

    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert two[0] == one[0] == list(range(1, 10)), "each step is logged once, by process 0 only"
    np.testing.assert_allclose(two[1], one[1], rtol=1e-5)  # train losses, steps 1-9
    np.testing.assert_allclose(two[2], one[2], rtol=1e-5)  # validation losses at 3, 6, 9
    assert checkpoints.list_steps(tmp_path / "two") == [3, 6, 9]
    assert load_config(tmp_path / "two").train.num_steps == 9
