"""Losses, schedules, the pure train step: label smoothing, exact gradient accumulation, non-finite skipping."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tests.helpers.training import one_layer_config, synthetic_batch
from transformer_jax.model import TransformerSpec, build_model
from transformer_jax.sharding import make_mesh
from transformer_jax.training.metrics import forward_flops
from transformer_jax.training.step import compile_steps, create_train_state, cross_entropy_sums, model_params


def test_label_smoothed_cross_entropy_matches_hand_computation():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
    targets = np.array([[1, 2, 0], [4, 4, 3]])
    weights = np.array([[1, 1, 0], [1, 1, 1]])
    eps = 0.1
    sums = cross_entropy_sums(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights), eps, fused_backward=True)
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    q = np.full((2, 3, 5), eps / 5) + (1 - eps) * np.eye(5)[targets]  # (1 - eps) one-hot + eps / V
    loss = -(q * log_p).sum(-1)
    nll = -np.take_along_axis(log_p, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(sums["loss_sum"], (loss * weights).sum(), rtol=1e-5)
    np.testing.assert_allclose(sums["nll_sum"], (nll * weights).sum(), rtol=1e-5)
    assert float(sums["tokens"]) == 5
    assert float(sums["correct"]) == ((logits.argmax(-1) == targets) * weights).sum()
    # The hand-written backward: d/d logits of (a * loss_sum + b * nll_sum), from the formula in numpy.
    a, b = 1.7, -0.4
    grad = jax.grad(
        lambda z: (lambda s: a * s["loss_sum"] + b * s["nll_sum"])(
            cross_entropy_sums(z, targets, weights, eps, fused_backward=True)
        )
    )
    p = np.exp(log_p)
    expected = weights[..., None] * (a * (p - q) + b * (p - np.eye(5)[targets]))
    np.testing.assert_allclose(grad(jnp.asarray(logits)), expected, rtol=1e-5, atol=1e-6)


def _params(state):
    return jax.tree.leaves(nnx.to_pure_dict(model_params(state)))


def step_config(**model):
    """One config for the train steps of this file, so that they share one compiled program (the tests' cache).

    No dropout: its draws would differ between the two ways of batching of the accumulation test. Adam with eps
    1e-9 turns float rounding in near-zero gradients into +-lr steps; eps 1 keeps the update proportional to the
    gradient, so parameters compare the accumulated gradients themselves.
    """
    config = one_layer_config(dropout_rate=0.0, **model)
    config.opt.eps = 1.0
    return config


def test_gradient_accumulation_equals_one_big_batch():
    config = step_config()
    batch = synthetic_batch(0, rows=8)
    mesh = make_mesh()
    results = []
    for accum in (1, 4):
        graphs, state = create_train_state(config)
        step, _, _ = compile_steps(graphs, state, mesh, "data", label_smoothing=0.1, accum_steps=accum)
        state, metrics = step(state, batch)
        state, metrics = step(state, batch)
        results.append((_params(state), metrics))
    (p1, m1), (p4, m4) = results
    np.testing.assert_allclose(m1["loss_sum"], m4["loss_sum"], rtol=1e-5)
    np.testing.assert_allclose(m1["grad_norm"], m4["grad_norm"], rtol=1e-5)
    for a, b in zip(p1, p4, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The micro-batches have different token counts, so a plain mean of per-micro-batch means would differ.
    tokens = np.asarray(batch["tgt_segment_ids"]).reshape(4, -1).sum(1)
    assert len(set(tokens.tolist())) > 1


def test_non_finite_update_is_skipped_and_counted():
    config = step_config()
    graphs, state = create_train_state(config)
    step, _, _ = compile_steps(graphs, state, make_mesh(), "data", label_smoothing=0.1, accum_steps=1)
    model_state = nnx.to_pure_dict(state)
    # Poison one parameter: every loss and gradient becomes NaN.
    table = model_state["model"]["src_embed"]["table_VD"]
    model_state["model"]["src_embed"]["table_VD"] = table.at[5].set(jnp.nan)
    nnx.replace_by_pure_dict(state, model_state)
    before = [np.array(x) for x in _params(state)]  # copies: the step donates the state's buffers
    state, metrics = step(state, synthetic_batch(1))
    assert float(metrics["finite"]) == 0.0
    state, metrics = step(state, synthetic_batch(2))
    assert int(metrics["nonfinite_in_a_row"]) == 2
    assert int(state["counters"]["nonfinite_total"].get_value()) == 2
    for a, b in zip(before, _params(state), strict=True):
        np.testing.assert_array_equal(a, b)  # NaN == NaN here: unchanged, including the poisoned row
    assert int(state["optimizer"]["step"].get_value()) == 0


def test_bfloat16_train_step_keeps_float32_params_and_matches_float32():
    """model.dtype=bfloat16 computes in bf16 but keeps parameters, gradients and the update in float32.

    Tolerance: bf16 keeps 8 bits of mantissa (relative rounding ~4e-3 per op); over the tiny model's few layers the
    loss and the gradient norm of the first step stay within 2% of the float32 step.
    """
    batch = synthetic_batch(0, rows=8)
    results = {}
    for dtype in ("float32", "bfloat16"):
        config = step_config(dtype=dtype)
        graphs, state = create_train_state(config)
        step, _, _ = compile_steps(graphs, state, make_mesh(), "data", label_smoothing=0.1, accum_steps=1)
        state, metrics = step(state, batch)
        params = jax.tree.leaves(nnx.to_pure_dict(model_params(state)))
        assert {p.dtype for p in params} == {jnp.dtype(jnp.float32)}, dtype
        results[dtype] = {k: float(metrics[k]) for k in ("loss_sum", "grad_norm", "finite")}
    assert results["bfloat16"]["finite"] == 1.0
    assert np.isfinite(results["bfloat16"]["loss_sum"]) and np.isfinite(results["bfloat16"]["grad_norm"])
    for key in ("loss_sum", "grad_norm"):
        np.testing.assert_allclose(results["bfloat16"][key], results["float32"][key], rtol=2e-2)
    assert results["bfloat16"]["loss_sum"] != results["float32"]["loss_sum"]  # bf16 really computed


def test_flop_formula_matches_the_compiled_program():
    config = one_layer_config()
    spec = TransformerSpec.from_config(config)
    model = build_model(config, rngs=nnx.Rngs(0))
    model.eval()
    batch = synthetic_batch(0, rows=4, length=16)
    graph, state = nnx.split(model)

    def forward(state, src, tgt):
        return nnx.merge(graph, state)(src, tgt)

    compiled = jax.jit(forward).lower(state, batch["src_tokens"], batch["tgt_in"]).compile()
    xla_flops = compiled.cost_analysis()["flops"]
    ours = forward_flops(spec, 4, 16, 16)
    # XLA also counts softmax, norms and elementwise work, which the matmul count leaves out.
    assert 0.8 < ours / xla_flops <= 1.0, (ours, xla_flops)
