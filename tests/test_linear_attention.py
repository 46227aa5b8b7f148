"""Linear attention against a naive O(N^2) evaluation of the same formula, causal and not, with masks."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests.helpers import jitted
from tests.helpers.model import random_tokens, tiny_model
from tests.helpers.reference import naive_linear_attention
from transformer_jax import ops


def linear_attention(q, k, v, **masking):
    return jitted(ops.attention, q, k, v, impl="linear", **masking)


def _qkv(seed, t, s, n=4, kv_heads=4, h=8):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], (2, t, n, h)),
        jax.random.normal(keys[1], (2, s, kv_heads, h)),
        jax.random.normal(keys[2], (2, s, kv_heads, h)),
    )


@pytest.mark.parametrize("causal", [False, True])
def test_matches_naive_on_packed_padded_rows(causal):
    q, k, v = _qkv(0, 7, 7)
    seg = jnp.array([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    masking = dict(q_segment_ids=seg, kv_segment_ids=seg, causal=causal)
    got = linear_attention(q, k, v, **masking)
    np.testing.assert_allclose(got, naive_linear_attention(q, k, v, **masking), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[0, 5:], 0.0)


def test_cross_attention_with_grouped_heads_matches_naive():
    q, k, v = _qkv(1, 5, 9, n=4, kv_heads=2)
    q_seg = jnp.array([[1, 1, 2, 2, 0], [1, 1, 1, 1, 1]])
    kv_seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0, 0], [1] * 9])
    masking = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    np.testing.assert_allclose(
        linear_attention(q, k, v, **masking), naive_linear_attention(q, k, v, **masking), rtol=1e-5, atol=1e-6
    )


def test_decoding_with_a_cache_matches_naive():
    q, k, v = _qkv(2, 1, 6)
    positions = jnp.array([[3], [5]])
    masking = dict(causal=True, q_positions=positions, kv_positions=jnp.broadcast_to(jnp.arange(6), (2, 6)))
    np.testing.assert_allclose(
        linear_attention(q, k, v, **masking), naive_linear_attention(q, k, v, **masking), rtol=1e-5, atol=1e-6
    )


def test_gradients_are_finite_and_match_naive():
    q, k, v = _qkv(3, 6, 6)
    seg = jnp.array([[1, 1, 1, 0, 0, 0], [1, 1, 2, 2, 2, 2]])
    masking = dict(q_segment_ids=seg, kv_segment_ids=seg, causal=True)
    g_lin = jax.grad(lambda q, k, v: linear_attention(q, k, v, **masking).sum(), argnums=(0, 1, 2))(q, k, v)
    g_ref = jax.grad(lambda q, k, v: naive_linear_attention(q, k, v, **masking).sum(), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_lin, g_ref, strict=True):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_window_is_a_clear_error():
    q, k, v = _qkv(0, 4, 4)
    with pytest.raises(ValueError, match="does not support a sliding window"):
        ops.attention(q, k, v, impl="linear", window=2)


def test_training_only_the_projections_into_linear_attention_lowers_the_loss():
    """Real learning through linear attention's gradients: with every parameter frozen except the q/k/v
    projections, which reach the loss only through linear attention, 30 Adam steps on one fixed batch bring the
    loss well below its start. Zero gradients leave it at the start; gradients of the wrong sign raise it."""
    model = tiny_model(impl="linear", num_encoder_layers=1, num_decoder_layers=1)
    src, tgt = random_tokens(0, (8, 8)), random_tokens(1, (8, 8))
    tgt_in = jnp.concatenate([jnp.full((8, 1), 2, jnp.int32), tgt[:, :-1]], axis=1)

    def feeds_attention(path: tuple, x: object) -> bool:
        return isinstance(x, nnx.Param) and any(str(p) in ("q_proj", "k_proj", "v_proj") for p in path)

    graph, params, rest = nnx.split(model, feeds_attention, ...)
    tx = optax.adam(3e-2)

    def loss(params: nnx.State) -> jax.Array:
        logits = nnx.merge(graph, params, rest)(src, tgt_in)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tgt).mean()

    def step(carry: tuple, _: None) -> tuple[tuple, jax.Array]:
        params, opt_state = carry
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    _, losses = jax.jit(lambda p: jax.lax.scan(step, (p, tx.init(p)), length=30))(params)
    losses = np.asarray(losses)
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.6 * losses[0], losses


@nnx.jit
def _decode(model: nnx.Module, memory: jax.Array | None, tgt: jax.Array, **kwargs) -> jax.Array | tuple:
    return model.decode(memory, tgt, **kwargs)


def test_decoding_with_a_cache_step_by_step_matches_the_whole_target():
    model = tiny_model(impl="linear")
    src, tgt = random_tokens(0, (2, 5)), random_tokens(1, (2, 4))
    memory = model.encode(src)
    full = _decode(model, memory, tgt, src_tokens=src)
    cache = model.init_cache(memory, None, max_len=4, src_tokens=src)
    steps = []
    for t in range(4):
        logits, cache = _decode(model, None, tgt[:, t : t + 1], cache=cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, rtol=1e-5, atol=1e-5)
