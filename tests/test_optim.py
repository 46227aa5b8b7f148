"""Learning-rate schedules (equal to their formulas at every step, and the one the run applies is the one it logs),
the optimizer's config checks, and freezing parameters by path (opt.freeze)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import common
from tests.helpers.training import one_layer_config
from transformer_jax import cli
from transformer_jax.errors import ConfigError
from transformer_jax.model import build_model, model_rngs
from transformer_jax.training.step import learning_rate_schedule, make_optimizer, new_train_state, split_train_state


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
    """Checked with the whole config, before any work (cli.validate at every command line)."""
    for key, value, match in (
        ("opt.schedule", "linear", "opt.schedule"),
        ("opt.weight_decay", 0.1, "opt.weight_decay.*adamw"),
        ("opt.freeze", ("encoder([",), r"^config key opt.freeze: must be a regular expression .*got 'encoder\(\['"),
    ):
        config = common.base_config("tiny")
        config.update_from_flattened_dict({key: value})
        with pytest.raises(ConfigError, match=match):
            cli.validate(config)


def test_the_logged_learning_rate_is_the_one_the_optimizer_applies():
    """The schedule is built once, with the train state: its optimizer applies it and Graphs.learning_rate, which
    the metrics log, is it. Adam's first update by gradients of ones moves every parameter by -rate / (1 + eps)."""
    config = one_layer_config()
    config.opt.schedule, config.opt.warmup_steps, config.opt.learning_rate = "rsqrt", 4, 1e-2
    train_state = new_train_state(config)
    graphs, _ = split_train_state(train_state)
    rate = float(graphs.learning_rate(0))
    np.testing.assert_allclose(rate, float(learning_rate_schedule(config.opt, config.train.num_steps)(0)))
    before = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(train_state.model, nnx.Param)))
    train_state.optimizer.update(
        train_state.model, jax.tree.map(jnp.ones_like, nnx.state(train_state.model, nnx.Param))
    )
    after = nnx.to_pure_dict(nnx.state(train_state.model, nnx.Param))
    for moved in jax.tree.leaves(jax.tree.map(lambda a, b: np.asarray(a) - b, after, before)):
        np.testing.assert_allclose(moved, -rate / (1 + config.opt.eps), rtol=1e-4)


def _trained_with_freeze(freeze: tuple[str, ...], optimizer: str = "adamw", steps: int = 3):
    """A one-layer model's parameters before and after `steps` updates by gradients of ones, with opt.freeze."""
    config = one_layer_config()
    config.opt.freeze, config.opt.optimizer, config.opt.clip_grad_norm = freeze, optimizer, 1.0
    config.opt.weight_decay = 0.1 if optimizer == "adamw" else 0.0
    model = build_model(config, rngs=model_rngs(0))
    optimizer_ = nnx.Optimizer(model, make_optimizer(config.opt, learning_rate_schedule(config.opt, 10)), wrt=nnx.Param)
    before = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    for _ in range(steps):
        optimizer_.update(model, grads)
    return before, nnx.to_pure_dict(nnx.state(model, nnx.Param)), optimizer_


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_frozen_parameters_stay_bit_identical_and_the_others_train(optimizer):
    before, after, opt = _trained_with_freeze(("encoder_layers", "src_embed"), optimizer)
    for path in ("encoder_layers", "src_embed"):
        jax.tree.map(np.testing.assert_array_equal, after[path], before[path])
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), after, before))
    assert sum(changed) == len(jax.tree.leaves(after["decoder_layers"]))  # every decoder parameter trained
    # Frozen parameters have no Adam moments: the state holds the trained parameters' alone.
    _, _, plain = _trained_with_freeze((), optimizer, steps=0)
    sizes = [sum(x.size for x in jax.tree.leaves(nnx.state(o.opt_state))) for o in (opt, plain)]
    encoder_and_embedding = sum(x.size for x in jax.tree.leaves([before["encoder_layers"], before["src_embed"]]))
    assert sizes[1] - sizes[0] == 2 * encoder_and_embedding  # mu and nu


def test_a_freeze_pattern_that_matches_nothing_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"^config key opt.freeze: 'embed\$' matches no parameter path \(of 43: "):
        _trained_with_freeze(("encoder", "embed$"), steps=0)
