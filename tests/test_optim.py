"""Learning-rate schedules (equal to their formulas at every step) and the optimizer's config checks."""

import numpy as np
import pytest

from configs import common
from transformer_jax.errors import ConfigError
from transformer_jax.training.optim import learning_rate_schedule, make_optimizer


def reference(name: str, peak: float, warmup_steps: int, num_steps: int, step: int) -> float:
    """The schedules' formulas in float64 numpy, step_num = step + 1 (as they read before optax built them)."""
    warmup = max(warmup_steps, 1)
    step_num = step + 1.0
    if name == "paper":
        return peak * min(step_num**-0.5, step_num * warmup**-1.5)
    factor = min(1.0, step_num / warmup)
    if name == "rsqrt":
        return peak * factor * np.sqrt(warmup / max(step_num, warmup))
    if name == "cosine":
        progress = np.clip((step_num - warmup) / max(num_steps - warmup, 1), 0.0, 1.0)
        return peak * factor * 0.5 * (1.0 + np.cos(np.pi * progress))
    return peak * factor


@pytest.mark.parametrize("name", ["paper", "rsqrt", "cosine", "constant"])
@pytest.mark.parametrize("warmup_steps,num_steps", [(4000, 100_000), (10, 100), (1, 50), (0, 50), (30, 30)])
def test_schedules_equal_their_formulas_at_every_step(name, warmup_steps, num_steps):
    opt = common.opt_config(512)
    opt.schedule, opt.warmup_steps = name, warmup_steps
    if name != "paper":
        opt.learning_rate = 1e-3
    schedule = learning_rate_schedule(opt, num_steps)
    steps = sorted({*range(0, min(num_steps, 300)), *range(0, num_steps + 20, max(num_steps // 997, 1))})
    got = np.array([float(schedule(s)) for s in steps])
    expected = np.array([reference(name, opt.learning_rate, warmup_steps, num_steps, s) for s in steps])
    # float32: near the end of the cosine, 1 + cos(pi p) cancels; errors are relative to the peak there.
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-6 * opt.learning_rate)


def test_paper_learning_rate_schedule():
    opt = common.opt_config(512)
    schedule = learning_rate_schedule(opt, 100_000)
    for step_num in (1, 100, 4000, 4001, 50_000):
        expected = 512**-0.5 * min(step_num**-0.5, step_num * 4000**-1.5)  # paper equation (3), section 5.3
        np.testing.assert_allclose(schedule(step_num - 1), expected, rtol=1e-5)
    peak = max(float(schedule(s)) for s in range(0, 8000, 50))
    np.testing.assert_allclose(peak, 512**-0.5 * 4000**-0.5, rtol=1e-3)


@pytest.mark.parametrize("name", ["rsqrt", "cosine", "constant"])
def test_other_schedules_warm_up_to_the_peak(name):
    opt = common.opt_config(512)
    opt.schedule, opt.learning_rate, opt.warmup_steps = name, 1e-3, 10
    schedule = learning_rate_schedule(opt, 100)
    np.testing.assert_allclose(schedule(4), 5e-4, rtol=1e-5)
    np.testing.assert_allclose(schedule(9), 1e-3, rtol=1e-5)
    if name == "cosine":
        assert float(schedule(99)) < 1e-6


def test_bad_optimizer_settings_name_the_key():
    opt = common.opt_config(512)
    opt.schedule = "linear"
    with pytest.raises(ConfigError, match="opt.schedule"):
        make_optimizer(opt, 10)
    opt = common.opt_config(512)
    opt.weight_decay = 0.1
    with pytest.raises(ConfigError, match="opt.weight_decay.*adamw"):
        make_optimizer(opt, 10)
