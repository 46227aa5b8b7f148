"""The target platform: choices that depend on the accelerator follow compiling_for(...), not the host; and
importing the package configures nothing."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from transformer_jax.model.spec import fused_backward_enabled
from transformer_jax.ops.dispatch import choose_impl
from transformer_jax.ops.masks import AttentionMask
from transformer_jax.runtime import platform


def test_target_backend_is_the_host_outside_compiling_for():
    assert platform.target_backend() == jax.default_backend()


def test_compiling_for_sets_and_restores_the_target():
    host = platform.target_backend()
    with platform.compiling_for("cuda") as target:
        assert target == "gpu" == platform.target_backend()
        with platform.compiling_for("tpu"):
            assert platform.target_backend() == "tpu"
        assert platform.target_backend() == "gpu"
    assert platform.target_backend() == host


def test_accelerator_choices_follow_the_target():
    q = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
    mask = AttentionMask.create(1, 16, 16, causal=True)
    assert fused_backward_enabled("auto") is (jax.default_backend() == "cpu")
    with platform.compiling_for("gpu"):
        assert not fused_backward_enabled("auto")
        assert choose_impl(q, q, q, mask) == "cudnn"


def test_an_unknown_platform_is_refused():
    with pytest.raises(ValueError, match="unknown platform 'metal'"):
        platform.backend_of("metal")


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
