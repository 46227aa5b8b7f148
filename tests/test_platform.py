"""The target platform: choices that depend on the accelerator follow compiling_for(...), not the host; and
importing the package configures nothing."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from tests.helpers import REPO
from transformer_jax import runtime
from transformer_jax.model.layers import fused_backward_enabled
from transformer_jax.ops import choose_impl
from transformer_jax.ops.attention import AttentionMask


def test_target_backend_is_the_host_outside_compiling_for():
    assert runtime.target_backend() == jax.default_backend()


def test_compiling_for_sets_and_restores_the_target():
    host = runtime.target_backend()
    with runtime.compiling_for("cuda") as target:
        assert target == "gpu" == runtime.target_backend()
        with runtime.compiling_for("tpu"):
            assert runtime.target_backend() == "tpu"
        assert runtime.target_backend() == "gpu"
    assert runtime.target_backend() == host


def test_accelerator_choices_follow_the_target():
    q = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
    mask = AttentionMask.create(1, 16, 16, causal=True)
    assert fused_backward_enabled("auto") is (jax.default_backend() == "cpu")
    with runtime.compiling_for("gpu"):
        assert not fused_backward_enabled("auto")
        assert choose_impl(q, q, q, mask) == "cudnn"


def test_an_unknown_platform_is_refused():
    with pytest.raises(ValueError, match="unknown platform 'metal'"):
        runtime.backend_of("metal")


IMPORT_CHECK = """
import json, os, sys
import jax
before_config, before_env = dict(jax.config.values), dict(os.environ)
import transformer_jax, transformer_jax.cli, transformer_jax.training.loop, transformer_jax.evaluation.run
import transformer_jax.decoding, transformer_jax.plan.accelerators
config = {k: repr(v) for k, v in jax.config.values.items() if repr(v) != repr(before_config.get(k))}
env = {k: v for k, v in os.environ.items() if before_env.get(k) != v}
print(json.dumps({"config": config, "env": env}))
"""


def test_importing_the_package_changes_no_jax_setting_and_no_environment_variable():
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "ALLOW_MULTIPLE_LIBTPU_LOAD")}
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_CHECK], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    changed = json.loads(out.stdout.strip().splitlines()[-1])
    assert changed["config"] == {} and changed["env"] == {}, changed


def test_accelerator_device_files_are_found_by_their_names(tmp_path):
    assert runtime.accelerator_device_files(tmp_path) == []
    (tmp_path / "vfio").mkdir()
    for name in ("vfio/vfio", "nvidia-uvm", "accel", "kvm"):  # present on hosts without any accelerator
        (tmp_path / name).touch()
    assert runtime.accelerator_device_files(tmp_path) == []
    for name in ("nvidia0", "vfio/12", "accel1", "kfd"):
        (tmp_path / name).touch()
    assert runtime.accelerator_device_files(tmp_path) == ["accel1", "kfd", "nvidia0", "vfio/12"]


@pytest.fixture
def platforms_setting():
    """jax_platforms as the test sets it, restored after (this process's backend has started already, so the
    setting changes nothing else here)."""
    before = jax.config.jax_platforms
    yield lambda value: jax.config.update("jax_platforms", value)
    jax.config.update("jax_platforms", before)


@pytest.mark.parametrize(
    ("user", "devices", "expected"),
    [
        (None, [], (True, "cpu")),  # no accelerator, no choice: the CPU
        (None, ["nvidia0"], (False, None)),  # a GPU host: jax picks, as without the command line
        ("cpu", ["nvidia0"], (False, "cpu")),  # the user's JAX_PLATFORMS (read into jax_platforms) wins...
        ("tpu,cpu", [], (False, "tpu,cpu")),  # ...over the device files and over their absence
    ],
)
def test_the_cpu_is_chosen_only_without_accelerators_and_without_the_users_choice(
    tmp_path, platforms_setting, user, devices, expected
):
    for name in devices:
        (tmp_path / name).touch()
    platforms_setting(user)
    assert (runtime.use_cpu_without_accelerators(tmp_path), jax.config.jax_platforms) == expected


NOISE = re.compile(r"Traceback|cuInit|TPU_ACCELERATOR_TYPE|TPU_WORKER_HOSTNAMES")
PLUGINS = [name for name in ("libtpu", "jax_plugins.xla_cuda12") if importlib.util.find_spec(name) is not None]


def _quiet_env() -> dict[str, str]:
    """This process's environment as a user's: JAX_PLATFORMS unset (the tests' conftest sets it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "ALLOW_MULTIPLE_LIBTPU_LOAD")}
    return env | {"PYTHONPATH": str(REPO)}


def _run_quietly(command: list) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, *map(str, command)], cwd=REPO, env=_quiet_env(), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert not NOISE.search(out.stdout + out.stderr), (command[0], out.stderr[-4000:])
    return out


needs_plugins = pytest.mark.skipif(
    not PLUGINS or bool(runtime.accelerator_device_files()),
    reason="needs libtpu or the CUDA plugin installed (requirements-aot.txt) on a host without accelerators",
)


@needs_plugins
def test_a_dry_run_starts_quietly_on_a_cpu_host_with_the_accelerator_compilers_installed():
    """The fast representative of the test below: the backend starts (the dry run prints the mesh) on the CPU."""
    out = _run_quietly(["train.py", "--config", "configs/quickstart.py", "--dry_run"])
    assert json.loads(out.stdout)["mesh"]["devices"] == ["cpu:0"]


@pytest.mark.slow
@needs_plugins
def test_the_command_lines_start_quietly_on_a_cpu_host_with_the_accelerator_compilers_installed(tmp_path, corpus):
    """Fresh processes with the TPU compiler and the CUDA plugin installed and JAX_PLATFORMS unset, as a user runs
    them: a 2-step quickstart training, an evaluation of it and an export print nothing about chips this host lacks."""
    workdir = tmp_path / "run"
    overrides = {
        "data.source": "text",
        "data.text_dir": corpus,
        "data.tokenizer_sample_sentences": 800,
        "model.vocab_size": 320,  # byte fallback reserves 256 ids, plus the corpus' characters
        "train.num_steps": 2,
        "train.eval_every": 0,
        "ckpt.every_steps": 1,  # two checkpoints, which the quickstart config averages
    }
    train = ["train.py", "--config", "configs/quickstart.py", "--workdir", workdir]
    _run_quietly(train + [f"--config.{k}={v}" for k, v in overrides.items()])
    _run_quietly(["evaluate.py", "--workdir", workdir, "--split", "test", "--beam_size", "2"])
    _run_quietly(["-m", "transformer_jax.export", "--workdir", workdir, "--output", tmp_path / "exported"])
