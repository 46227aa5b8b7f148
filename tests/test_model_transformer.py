"""Whole-model behaviour: causality, padding, packing, permutation equivariance, caching, validation, size."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import common, wmt14_ende
from tests.helpers.model import call, forward, random_tokens, tiny_model, tiny_spec
from tests.helpers.reference import hand_count
from transformer_jax.model import Transformer, TransformerSpec, capture_attention_weights, parameter_count


def test_decoder_cannot_see_the_future():
    model = tiny_model()
    src = random_tokens(0, (2, 6))
    tgt = random_tokens(1, (2, 8))
    logits = forward(model, src, tgt)
    i = 4
    changed = tgt.at[:, i + 1 :].set(random_tokens(2, (2, 8 - i - 1)))
    logits_changed = forward(model, src, changed)
    np.testing.assert_allclose(logits_changed[:, : i + 1], logits[:, : i + 1], rtol=1e-6, atol=1e-6)
    assert np.abs(logits_changed[:, i + 1 :] - logits[:, i + 1 :]).max() > 1e-3


@pytest.mark.slow  # test_decoder_cannot_see_the_future checks causality in the default run
def test_gradient_of_decoder_output_with_respect_to_later_inputs_is_zero():
    model = tiny_model(num_decoder_layers=2)
    src = random_tokens(0, (1, 5))
    memory = model.encode(src)
    y = jax.random.normal(jax.random.key(0), (1, 6, model.spec.d_model))
    positions = jnp.arange(6)[None]
    cross = [layer.cross_attn.project_kv(memory) for layer in model.decoder_layers]

    def stack(y_BTD):
        for layer, kv in zip(model.decoder_layers, cross, strict=True):
            y_BTD, _ = layer(
                y_BTD,
                kv,
                tgt_segment_ids=None,
                tgt_positions=positions,
                src_segment_ids=None,
                self_cache=None,
                cache_index=None,
            )
        return y_BTD

    i = 2
    jac = jax.jacobian(lambda y: stack(y)[0, i])(y)  # [D, 1, T, D]
    assert np.abs(jac[:, :, i + 1 :]).max() == 0.0
    assert np.abs(jac[:, :, : i + 1]).max() > 0.0


def test_outputs_at_real_positions_ignore_pad_contents_and_amount():
    model = tiny_model()
    src, tgt = random_tokens(0, (1, 5)), random_tokens(1, (1, 4))
    ref = forward(model, src, tgt)
    for extra_src, extra_tgt, seed in ((3, 2, 5), (7, 1, 6)):
        # Pad positions carry arbitrary (non-pad) garbage ids: only the segment ids say they are padding.
        padded_src = jnp.concatenate([src, random_tokens(seed, (1, extra_src))], 1)
        padded_tgt = jnp.concatenate([tgt, random_tokens(seed + 1, (1, extra_tgt))], 1)
        src_seg = (jnp.arange(padded_src.shape[1]) < 5).astype(jnp.int32)[None]
        tgt_seg = (jnp.arange(padded_tgt.shape[1]) < 4).astype(jnp.int32)[None]
        got = forward(model, padded_src, padded_tgt, src_segment_ids=src_seg, tgt_segment_ids=tgt_seg)
        np.testing.assert_allclose(got[:, :4], ref, rtol=1e-5, atol=1e-5)


def test_default_segment_ids_treat_pad_tokens_as_padding():
    model = tiny_model()
    src, tgt = random_tokens(0, (1, 5)), random_tokens(1, (1, 4))
    padded = jnp.concatenate([src, jnp.zeros((1, 3), jnp.int32)], 1)
    np.testing.assert_allclose(forward(model, padded, tgt), forward(model, src, tgt), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_two_packed_sentences_equal_each_run_alone(positional):
    model = tiny_model(positional=positional)
    src_a, src_b = random_tokens(0, (1, 4)), random_tokens(1, (1, 3))
    tgt_a, tgt_b = random_tokens(2, (1, 5)), random_tokens(3, (1, 2))
    alone_a, alone_b = forward(model, src_a, tgt_a), forward(model, src_b, tgt_b)
    packed = forward(
        model,
        jnp.concatenate([src_a, src_b, jnp.zeros((1, 1), jnp.int32)], 1),
        jnp.concatenate([tgt_a, tgt_b, jnp.zeros((1, 1), jnp.int32)], 1),
        src_segment_ids=jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]]),
        tgt_segment_ids=jnp.array([[1, 1, 1, 1, 1, 2, 2, 0]]),
        src_positions=jnp.array([[0, 1, 2, 3, 0, 1, 2, 0]]),
        tgt_positions=jnp.array([[0, 1, 2, 3, 4, 0, 1, 0]]),
    )
    np.testing.assert_allclose(packed[:, :5], alone_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[:, 5:7], alone_b, rtol=1e-5, atol=1e-5)


def test_encoder_is_permutation_equivariant_only_without_positional_encoding():
    src = random_tokens(0, (1, 7))
    perm = np.random.default_rng(0).permutation(7)
    plain = tiny_model(positional="none")
    encode = call(plain, "encode", src)
    np.testing.assert_allclose(call(plain, "encode", src[:, perm]), encode[:, perm], rtol=1e-5, atol=1e-5)
    with_pe = tiny_model(positional="sinusoidal")
    assert np.abs(call(with_pe, "encode", src[:, perm]) - call(with_pe, "encode", src)[:, perm]).max() > 1e-2


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_cached_decoding_equals_full_recompute(norm_position):
    model = tiny_model(norm_position=norm_position)
    src = jnp.concatenate([random_tokens(0, (2, 5)), jnp.zeros((2, 2), jnp.int32)], 1).at[1, 3:].set(0)
    tgt = random_tokens(1, (2, 6))
    src_seg = (src != 0).astype(jnp.int32)
    memory = call(model, "encode", src)
    full = call(model, "decode", memory, tgt, src_segment_ids=src_seg)
    cache = call(model, "init_cache", memory, src_seg, max_len=8)
    steps = []
    for t in range(tgt.shape[1]):
        logits, cache = call(model, "decode", None, tgt[:, t : t + 1], cache=cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache["index"], [tgt.shape[1]] * 2)  # each row's next slot


def test_final_logits_bias_is_added_to_every_logit_the_model_makes():
    """model.final_logits_bias: a float32 [V] parameter final_logits_bias_V, zeros at init (the model starts as
    without it), added to the logits of teacher forcing and of cached decoding alike (both go through decode)."""
    plain, biased = tiny_model(seed=3), tiny_model(seed=3, final_logits_bias=True)
    assert plain.final_logits_bias_V is None
    bias = biased.final_logits_bias_V
    assert bias[...].shape == (biased.spec.vocab_size,) and bias[...].dtype == jnp.float32
    assert not np.asarray(bias[...]).any()
    src, tgt = random_tokens(0, (2, 5)), random_tokens(1, (2, 4))
    np.testing.assert_array_equal(forward(biased, src, tgt), forward(plain, src, tgt))
    bias[...] = jax.random.normal(jax.random.key(1), bias[...].shape)
    expected = forward(plain, src, tgt) + bias[...]
    np.testing.assert_allclose(forward(biased, src, tgt), expected, rtol=1e-6, atol=1e-6)
    memory = call(biased, "encode", src)
    cache = call(biased, "init_cache", memory, None, max_len=4, src_tokens=src)
    step, _ = call(biased, "decode", None, tgt[:, :1], cache=cache)
    np.testing.assert_allclose(step[:, 0], expected[:, 0], rtol=1e-5, atol=1e-5)
    assert isinstance(bias, nnx.Param)  # trained, saved and exported as every parameter is


def test_decode_masks_source_padding_without_explicit_segment_ids():
    """decode derives the source's segment ids from its tokens as encode does, instead of reading padding as real."""
    model = tiny_model()
    src, tgt = random_tokens(0, (1, 5)), random_tokens(1, (1, 4))
    padded = jnp.concatenate([src, jnp.zeros((1, 3), jnp.int32)], 1)
    alone = call(model, "decode", call(model, "encode", src), tgt, src_tokens=src)
    memory = call(model, "encode", padded)
    from_tokens = call(model, "decode", memory, tgt, src_tokens=padded)
    explicit = call(model, "decode", memory, tgt, src_segment_ids=(jnp.arange(8) < 5).astype(jnp.int32)[None])
    np.testing.assert_allclose(from_tokens, explicit, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(from_tokens, alone, rtol=1e-5, atol=1e-5)
    cache = call(model, "init_cache", memory, None, max_len=4, src_tokens=padded)
    np.testing.assert_array_equal(cache["src_segment_ids"], [[1, 1, 1, 1, 1, 0, 0, 0]])
    # Neither segment ids nor tokens: the padding cannot be known, so it is an error rather than "all real".
    with pytest.raises(ValueError, match="decode needs src_segment_ids or src_tokens"):
        model.decode(memory, tgt)
    with pytest.raises(ValueError, match="init_cache needs src_segment_ids or src_tokens"):
        model.init_cache(memory, None, max_len=4)


def test_captured_attention_weights_are_the_ones_the_model_uses():
    model = tiny_model()
    src, tgt = random_tokens(0, (1, 5)), random_tokens(1, (1, 4))
    capture_attention_weights(model)
    logits, weights = nnx.capture(forward, nnx.Intermediate)(model, src, tgt)
    capture_attention_weights(model, False)
    np.testing.assert_allclose(forward(model, src, tgt), logits, rtol=1e-6)  # capturing changes nothing
    enc0 = weights["encoder_layers"][0]["self_attn"]["attention_weights"][0]
    dec0_self = weights["decoder_layers"][0]["self_attn"]["attention_weights"][0]
    dec0_cross = weights["decoder_layers"][0]["cross_attn"]["attention_weights"][0]
    assert enc0.shape == (1, model.spec.num_heads, 5, 5)
    assert dec0_cross.shape == (1, model.spec.num_heads, 4, 5)
    np.testing.assert_array_equal(np.triu(np.asarray(dec0_self[0, 0]), 1), 0.0)  # masked: no future
    # Recompute layer 0's encoder self-attention by hand from its projections.
    layer = model.encoder_layers[0]
    x = model._embed(src, jnp.arange(5)[None], target=False)
    q = layer.self_attn.q_proj(x).reshape(1, 5, model.spec.num_heads, -1)
    k, _ = layer.self_attn.project_kv(x)
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    np.testing.assert_allclose(enc0, jax.nn.softmax(scores, -1), rtol=1e-5, atol=1e-6)


def test_dropout_only_in_train_mode():
    model = Transformer(tiny_spec(dropout_rate=0.3, attention_dropout_rate=0.2), rngs=nnx.Rngs(0))
    src, tgt = random_tokens(0, (2, 5)), random_tokens(1, (2, 4))
    model.train()
    assert np.abs(forward(model, src, tgt) - forward(model, src, tgt)).max() > 1e-3
    model.eval()
    np.testing.assert_array_equal(forward(model, src, tgt), forward(model, src, tgt))


def test_bfloat16_computation_keeps_float32_parameters_and_stays_close():
    f32 = tiny_model(seed=3)
    bf16 = tiny_model(seed=3, dtype="bfloat16")
    params = nnx.state(bf16, nnx.Param)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    src, tgt = random_tokens(0, (2, 5)), random_tokens(1, (2, 4))
    a, b = forward(f32, src, tgt), forward(bf16, src, tgt)
    assert b.dtype == jnp.float32
    # bfloat16 keeps 8 bits of mantissa: relative error per op ~4e-3, a few layers deep.
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 5e-2


# Which computation each vocabulary matrix feeds, for each (model.share_embeddings, model.tie_output).
VOCAB_MATRICES = {
    (True, True): {"src_embed": {"encoder input", "decoder input", "output projection"}},
    (True, False): {"src_embed": {"encoder input", "decoder input"}, "output_proj": {"output projection"}},
    (False, True): {"src_embed": {"encoder input"}, "tgt_embed": {"decoder input", "output projection"}},
    (False, False): {
        "src_embed": {"encoder input"},
        "tgt_embed": {"decoder input"},
        "output_proj": {"output projection"},
    },
}


@pytest.mark.parametrize("share, tie", list(VOCAB_MATRICES))
def test_tied_matrices_are_one_matrix_and_untied_ones_are_separate(share, tie):
    """Paper 3.4: changing a vocabulary matrix changes exactly the computations that share it, and no other."""
    model = tiny_model(share_embeddings=share, tie_output=tie)
    src, tgt = random_tokens(0, (1, 5)), random_tokens(1, (1, 4))
    y = jax.random.normal(jax.random.key(0), (1, 4, model.spec.d_model))
    probes = {
        "encoder input": lambda m: m.encode(src),
        "decoder input": lambda m: m._embed(tgt, jnp.arange(4)[None], target=True),
        "output projection": lambda m: m.logits(y),
    }
    before = {name: probe(model) for name, probe in probes.items()}
    present = {name for name in ("src_embed", "tgt_embed", "output_proj") if getattr(model, name) is not None}
    assert present == set(VOCAB_MATRICES[share, tie])
    for name, feeds in VOCAB_MATRICES[share, tie].items():
        changed_model = nnx.clone(model)
        module = getattr(changed_model, name)
        matrix = module.table_VD if name != "output_proj" else module.kernel
        matrix[...] = matrix[...] + 0.5 * jax.random.normal(jax.random.key(1), matrix.shape)
        changed = {n for n, probe in probes.items() if np.abs(probe(changed_model) - before[n]).max() > 1e-4}
        assert changed == feeds, name
    if tie:
        # The gradient of the logits reaches the (one) embedding matrix through the projection itself.
        embed = "src_embed" if share else "tgt_embed"
        grads = nnx.grad(lambda m: m.logits(y)[..., 7].sum())(model)
        table_grad = getattr(grads, embed).table_VD[...]
        np.testing.assert_allclose(table_grad[7], y[0].sum(0), rtol=1e-5)
        assert np.abs(np.delete(np.asarray(table_grad), 7, axis=0)).max() == 0.0
    spec = model.spec
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    shared_params = sum(x.size for x in jax.tree.leaves(nnx.state(tiny_model(), nnx.Param)))
    assert params - shared_params == (len(VOCAB_MATRICES[share, tie]) - 1) * spec.vocab_size * spec.d_model


@pytest.mark.parametrize("size,expected_millions", [("base", 63.1), ("big", 214.3)])  # the figures
def test_parameter_count_equals_hand_derivation(size, expected_millions):
    config = wmt14_ende.get_config(f"size={size}")
    assert config.model.vocab_size == 37000
    count = parameter_count(config)  # shapes only, no memory
    m = config.model
    assert count == hand_count(37000, m.d_model, m.d_ff, m.num_encoder_layers)
    assert abs(count / 1e6 - expected_millions) < 0.1  # exact: 63,082,496 (base), 214,245,376 (big)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("d_model", 30, "model.num_heads: d_model=30 is not divisible by num_heads=4"),
        ("activation", "tanh", "model.activation: unknown value 'tanh'"),
        ("norm", "batchnorm", "model.norm: unknown value"),
        ("norm_position", "middle", "model.norm_position"),
        ("positional", "rotary", "model.positional"),
        ("sinusoid_layout", "shuffled", "model.sinusoid_layout: unknown value 'shuffled'"),
        ("dropout_rate", -0.1, r"model.dropout_rate: must be in \[0, 1\)"),
        ("num_kv_heads", 3, "model.num_kv_heads"),
        ("dtype", "float8", "model.dtype"),
        ("vocab_size", 0, "model.vocab_size: must be positive"),
    ],
)
def test_invalid_configs_fail_at_construction_naming_the_key(key, value, message):
    with pytest.raises(ValueError, match=message):
        tiny_spec(**{key: value})


def test_invalid_attention_config_names_the_key():
    with pytest.raises(ValueError, match="attention.impl: unknown value 'magic'"):
        tiny_spec(impl="magic")
    config = common.base_config("tiny")
    config.model.attention_dropout_rate = 0.1
    config.attention.impl = "xla"
    TransformerSpec.from_config(config)  # fine with the materialising reference
