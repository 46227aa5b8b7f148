"""model.fused_backward: the hand-written backward passes change how gradients are computed, never their values.

The linear layers, the tied logits projection and the loss each have a custom VJP arranged for XLA:CPU. With the
switch on and off, the same model and batch must give the same loss and the same gradients: equal to rounding in
float32, and within bfloat16's rounding when the model computes in bfloat16 (the "bf16 gradient test").
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers.model import random_tokens, tiny_model, tiny_spec
from transformer_jax.model.layers import fused_backward_enabled, fused_dot_general, logits_from_table, tied_logits
from transformer_jax.training.step import cross_entropy_sums

# One encoder and one decoder layer: the two backward passes are per layer, so depth adds only compile time.
ONE_LAYER = dict(num_encoder_layers=1, num_decoder_layers=1)


@pytest.mark.parametrize(
    "setting, backend, expected",
    [
        ("auto", "cpu", True),
        ("auto", "gpu", False),
        ("auto", "tpu", False),
        ("on", "gpu", True),
        ("on", "cpu", True),
        ("off", "cpu", False),
    ],
)
def test_auto_means_on_for_the_cpu_backend_only(setting, backend, expected):
    assert fused_backward_enabled(setting, backend) is expected


def test_the_model_follows_the_backend_this_process_runs_on(monkeypatch):
    """One resolution (spec.fused_backward_on) decides for the linear layers and the tied projection alike."""
    cpu = tiny_model()
    assert cpu.spec.fused_backward_on
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    gpu = tiny_model()
    assert not gpu.spec.fused_backward_on
    for model, on in ((cpu, True), (gpu, False)):  # the modules chose when they were built
        assert model.src_embed.fused_backward is on
        linear = model.encoder_layers[0].ffn.w1
        assert linear.dot_general is (fused_dot_general if on else jax.lax.dot_general)


def test_an_unknown_setting_names_the_key():
    with pytest.raises(ValueError, match="model.fused_backward: unknown value 'sometimes'"):
        tiny_spec(fused_backward="sometimes")


def _loss_and_grads(model, fused_backward: bool):
    src, tgt = random_tokens(0, (3, 7)), random_tokens(1, (3, 6))
    tgt_in = jnp.concatenate([jnp.full((3, 1), 2), tgt[:, :-1]], 1)
    weights = (jnp.arange(6) < jnp.array([[6], [4], [2]])).astype(jnp.int32)  # some padding in the target

    def loss(m):
        sums = cross_entropy_sums(m(src, tgt_in), tgt, weights, 0.1, fused_backward=fused_backward)
        return sums["loss_sum"] + 0.5 * sums["nll_sum"], sums

    (value, sums), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
    return value, sums, nnx.to_pure_dict(grads)


def _relative_errors(a: dict, b: dict) -> list[float]:
    """||a - b|| / ||b|| per parameter. A gradient that is zero but for rounding (the key biases: softmax ignores a
    constant added to every score) is measured against a thousandth of the largest gradient instead."""
    pairs = list(zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    floor = 1e-3 * max(float(jnp.linalg.norm(y)) for _, y in pairs)
    return [float(jnp.linalg.norm(x - y)) / max(float(jnp.linalg.norm(y)), floor) for x, y in pairs]


@pytest.mark.parametrize("untied", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_on_and_off_give_the_same_loss_and_gradients_in_float32(untied):
    extra = dict(share_embeddings=False, tie_output=False) if untied else {}
    on = tiny_model(seed=4, **ONE_LAYER, fused_backward="on", **extra)
    off = tiny_model(seed=4, **ONE_LAYER, fused_backward="off", **extra)
    value_on, sums_on, grads_on = _loss_and_grads(on, True)
    value_off, sums_off, grads_off = _loss_and_grads(off, False)
    np.testing.assert_allclose(value_on, value_off, rtol=1e-6)
    for key in sums_on:
        np.testing.assert_allclose(sums_on[key], sums_off[key], rtol=1e-6)
    assert max(_relative_errors(grads_on, grads_off)) < 1e-5


def _global_relative_error(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over all gradients together."""
    flat = lambda tree: jnp.concatenate([x.ravel() for x in jax.tree.leaves(tree)])
    return float(jnp.linalg.norm(flat(a) - flat(b)) / jnp.linalg.norm(flat(b)))


@pytest.mark.slow  # trimmed from the default run: the file keeps a fast representative
def test_on_and_off_agree_in_bfloat16_within_its_rounding():
    """bfloat16 keeps 8 bits of mantissa (relative rounding 2^-8 = 4e-3 per op), and the two backward passes round
    different intermediate products. Stated tolerance: all gradients together differ by < 2e-2 relative (measured
    0.7%), each parameter's by < 5e-2 (measured <= 1.7%), and on and off differ from each other by less than
    bfloat16 itself makes either differ from the float32 gradient (measured 2%): the hand-written backward adds
    no error of its own beyond bfloat16 rounding."""
    value_on, _, grads_on = _loss_and_grads(
        tiny_model(seed=4, **ONE_LAYER, dtype="bfloat16", fused_backward="on"), True
    )
    value_off, _, grads_off = _loss_and_grads(
        tiny_model(seed=4, **ONE_LAYER, dtype="bfloat16", fused_backward="off"), False
    )
    _, _, grads_f32 = _loss_and_grads(tiny_model(seed=4, **ONE_LAYER, fused_backward="off"), False)
    np.testing.assert_allclose(value_on, value_off, rtol=1e-6)  # the forward pass is the same computation
    between = _global_relative_error(grads_on, grads_off)
    assert between < 2e-2
    assert between < min(_global_relative_error(grads_on, grads_f32), _global_relative_error(grads_off, grads_f32))
    # Key biases are left out per parameter: their true gradient is zero (softmax ignores a constant added to every
    # score), so what either pass returns for them is bfloat16 rounding alone.
    per_parameter = {
        jax.tree_util.keystr(path): error
        for (path, _), error in zip(
            jax.tree_util.tree_flatten_with_path(grads_on)[0], _relative_errors(grads_on, grads_off), strict=True
        )
    }
    assert max(e for path, e in per_parameter.items() if "k_proj']['bias" not in path) < 5e-2


@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_tied_logits_backward_equals_autodiff(dtype, tolerance):
    """Compiled, at a shape where XLA:CPU once refused the backward's bfloat16 x bfloat16 = float32 products."""
    kx, kt, kg = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(kx, (3, 6, 32)).astype(dtype)
    table = jax.random.normal(kt, (50, 32)).astype(dtype)
    g = jax.random.normal(kg, (3, 6, 50))
    vjp = jax.jit(lambda f, x, table, g: (lambda out, pull: (out, pull(g)))(*jax.vjp(f, x, table)), static_argnums=0)
    out, ours = vjp(tied_logits, x, table, g)
    ref_out, ref = vjp(logits_from_table, x, table, g)
    np.testing.assert_array_equal(out, ref_out)
    for a, b in zip(ours, ref, strict=True):
        assert a.dtype == b.dtype == dtype
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < tolerance


def test_loss_backward_equals_autodiff():
    logits = jax.random.normal(jax.random.key(3), (2, 5, 11)) * 3
    targets = jax.random.randint(jax.random.key(4), (2, 5), 0, 11)
    weights = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])

    def objective(fused_backward):
        def f(z):
            sums = cross_entropy_sums(z, targets, weights, 0.1, fused_backward=fused_backward)
            return 0.7 * sums["loss_sum"] + 1.3 * sums["nll_sum"]

        return f

    fused, autodiff = (jax.jit(jax.value_and_grad(objective(fused))) for fused in (True, False))
    (loss_fused, grad_fused), (loss_autodiff, grad_autodiff) = fused(logits), autodiff(logits)
    np.testing.assert_allclose(loss_fused, loss_autodiff, rtol=1e-6)
    np.testing.assert_allclose(grad_fused, grad_autodiff, rtol=1e-5, atol=1e-7)
