"""A config file that does not parse, fails on import, or whose get_config raises (issue #30): one line with the
file, the line and the error, from the one loader (config_files) that train.py, evaluate.py --config, the sweep
and every other command use."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from tests.helpers import REPO
from transformer_jax import cli
from transformer_jax.errors import ConfigError
from transformer_jax.evaluation import command
from transformer_jax.sweep import runner as sweep

BROKEN = {
    # name: (file text, the message's expected text after the file name)
    "syntax": ("def get_config(arg=None)\n    return {}\n", ":1: SyntaxError: expected ':'"),
    "import": ("import json\nimport no_such_module_here\n", ":2: while importing it: ModuleNotFoundError: No module"),
    "raises": (
        "def get_config(arg=None):\n    x = 1\n    raise ValueError(f'size {arg} is\\nnot known')\n",
        ":3: get_config('size=huge') raised ValueError: size size=huge is not known",
    ),
    "deeper": (
        "from configs import common\n\n\ndef get_config(arg=None):\n    return common.model_config(arg)\n",
        ":5 (raised at transformer_jax/config/schema.py:",
    ),
}


def _write(tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    path = tmp_path / f"{name}.py"
    path.write_text(BROKEN[name][0])
    return path


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_the_loader_names_the_file_the_line_and_the_error(tmp_path, name, monkeypatch):
    monkeypatch.chdir(REPO)  # configs/ importable, as from the repository root
    monkeypatch.syspath_prepend(str(REPO))
    path = _write(tmp_path, name)
    with pytest.raises(ConfigError) as raised:
        cli.get_config(f"{path}:size=huge")
    message = str(raised.value)
    assert message.startswith(f"{path}{BROKEN[name][1]}"), message
    assert "\n" not in message and "Traceback" not in message


def test_a_missing_file_and_a_file_without_get_config(tmp_path):
    with pytest.raises(ConfigError, match="no such file nope.py"):
        cli.get_config("nope.py")
    (tmp_path / "empty.py").write_text("X = 1\n")
    with pytest.raises(ConfigError, match=r"empty.py: defines no get_config\(arg\)"):
        cli.get_config(str(tmp_path / "empty.py"))


@pytest.mark.parametrize("define", ["train", "evaluate"])
def test_every_config_file_flag_uses_the_loader_and_fails_in_one_line(tmp_path, capsys, define):
    """cli.parse_flags under train.py's --config and under evaluate.py's (command.define_checkpoint_flags, shared
    with export)."""
    path = _write(tmp_path, "raises")
    fv = flags.FlagValues()
    if define == "train":
        config_flags.DEFINE_config_file("config", None, "a config file", flag_values=fv)
    else:
        command.define_checkpoint_flags(fv)
    with pytest.raises(SystemExit) as exited:
        cli.parse_flags("prog", ["prog", "--config", f"{path}:size=huge"], fv)
    assert exited.value.code == cli.USAGE_STATUS
    assert capsys.readouterr().err == f"prog: error: --config: {path}{BROKEN['raises'][1]}\n"


def test_the_sweep_loads_its_config_files_with_the_same_loader(tmp_path):
    with pytest.raises(ConfigError, match=r"syntax.py:1: SyntaxError"):
        sweep.variants(str(_write(tmp_path, "syntax")))
    (tmp_path / "sweep_raises.py").write_text(
        "from tests.tiny_train_config import get_config\n\n\ndef get_sweep(arg):\n    return [{'name': 1 / 0}]\n"
    )
    with pytest.raises(ConfigError, match=r"sweep_raises.py:5: get_sweep\(None\) raised ZeroDivisionError: division"):
        sweep.variants(str(tmp_path / "sweep_raises.py"))


# In-process: test_the_loader_names_the_file_the_line_and_the_error[syntax] and
# test_every_config_file_flag_uses_the_loader_and_fails_in_one_line[train] (cli.parse_flags under train.py's --config);
# a train.py process's --config parse error as its one line: tests/test_cli_errors.py's train.py-1.
@pytest.mark.slow
def test_train_py_prints_one_line_for_a_syntax_error(tmp_path):
    program, name = "train.py", "syntax"
    path = _write(tmp_path, name)
    args = ["--config", f"{path}:size=huge", "--workdir", str(tmp_path / "w")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(REPO / program), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == cli.USAGE_STATUS, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{program}: error: --config: {path}{BROKEN[name][1]}"), lines
