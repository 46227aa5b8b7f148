"""Every command line turns a user's mistake into one line `prog: error: message` and a non-zero exit, no traceback.

Each entry point runs as a subprocess, once with a mistake absl or config_flags finds while parsing (a missing
config file, a malformed flag) and, where main can raise one cheaply, once with a UserError raised inside main.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

TINY = "tests/tiny_train_config.py"


def slow(*case):
    """A case whose path another default case already takes (the same parser, or the same check in main): each
    subprocess costs ~2 s of imports, so these run with -m slow."""
    return pytest.param(*case, marks=pytest.mark.slow)


CASES = [
    # (program, arguments, words the error line contains)
    # A missing config file: the parse that train.py-1 takes (config_flags), the message visualize-11's and
    # data.prepare-13's.
    slow("train.py", ["--config", "nope.py", "--workdir", "w"], "--config nope.py: no such file nope.py"),
    ("train.py", ["--config", TINY, "--config.model.d_modle=8"], "'d_modle' Did you mean"),
    slow("train.py", ["--config", TINY], "--workdir is required"),  # ConfigError raised in main, as train.py-3's
    # cli.validate, before any work (--dry_run too): this exited 0 having done nothing
    ("train.py", ["--config", TINY, "--config.train.num_steps=-1", "--dry_run"], "train.num_steps: must be positive"),
    slow("train.py", ["--config", TINY, "--workdir", "train.py"], "--workdir train.py is a file, not a directory"),
    slow("train.py", ["--config", TINY, "--workdir", "train.py/w"], "--workdir train.py/w: cannot write there"),
    ("evaluate.py", ["--beam_size", "four"], "--beam_size"),
    ("evaluate.py", ["--hypotheses_file", "h.txt"], "--hypotheses_file needs --references_file"),  # in main
    slow("evaluate.py", ["--hypotheses_file", "no.txt", "--references_file", "no.txt"], "cannot read no.txt"),
    slow("transformer_jax.sweep", ["--config", "nope.py", "--workdir", "w"], "--config nope.py: no such file"),
    ("transformer_jax.sweep", ["--config", TINY, "--workdir", "w"], "defines no get_sweep"),  # in main
    ("transformer_jax.visualize", ["schedule", "--config", "nope.py", "--output_dir", "o"], "no such file nope.py"),
    slow("transformer_jax.visualize", ["curves", "--metrics", "no.jsonl", "--output_dir", "o"], "--metrics: no such"),
    ("transformer_jax.data.prepare", ["--config", "nope.py", "--workdir", "w"], "--config nope.py: no such file"),
    slow("transformer_jax.data.prepare", ["--config", TINY, "--config.data.text_dir=/none", "--workdir", "w"], "/none"),
    ("benchmarks.attention", ["--seq_lens", "1k"], "--seq_lens: expected integers"),  # ConfigError in main
    slow("benchmarks.decode", ["--config", "nope.py"], "--config nope.py: no such file"),
    slow("benchmarks.data_pipeline", ["--epochs", "many"], "--epochs"),
    slow("benchmarks.train_step", ["--config", "nope.py"], "--config nope.py: no such file"),
    ("benchmarks.train_step", ["--config", TINY, "stray"], "unexpected arguments: ['stray']"),
    # The benchmarks check their config as train.py does (a comma-joined list override is split, then checked).
    ("benchmarks.train_step", ["--config", TINY, "--config.opt.lora_targets=q,nope"], "opt.lora_targets"),
    slow("benchmarks.decode", ["--config", TINY, "--config.opt.lora_targets=q,nope"], "opt.lora_targets"),
]


def prog_of(program: str) -> str:
    """The name an error line starts with."""
    return program if program.endswith(".py") else f"python -m {program}"


IDS = [f"{getattr(case, 'values', case)[0]}-{i}" for i, case in enumerate(CASES)]


@pytest.mark.parametrize("program, args, message", CASES, ids=IDS)
def test_a_mistake_is_one_line_and_a_nonzero_exit(program, args, message, tmp_path):
    command = [sys.executable, str(REPO / program)] if program.endswith(".py") else [sys.executable, "-m", program]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), "TINY_CORPUS": str(tmp_path)}
    result = subprocess.run([*command, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(prog_of(program)), result.stderr  # visualize: + command
    assert message in errors[0].split(": error: ", 1)[1]
    assert result.stderr.strip().splitlines()[-1] == errors[0]  # nothing after it (no help hint, no usage)
