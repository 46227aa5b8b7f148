"""An independent implementation agrees: the same weights in torch.nn.Transformer give the same outputs.

The comparison runs in a pytest process of its own: once torch's kernels have run in a process, CTranslate2's
beam search there gives other hypotheses (tests/test_decoding_ctranslate2.py's set-aside n-best lists failed
whenever this test ran before it in the same xdist worker: `pytest -n 0 tests/test_torch_reference.py
tests/test_decoding_ctranslate2.py` reproduces it)."""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.model import call, random_tokens, tiny_model

OWN_PROCESS = "TRANSFORMER_JAX_TORCH_REFERENCE_PROCESS"  # set in the process that runs the comparison

torch = None  # imported by the fixture below: at collection, every xdist worker would pay ~2 s importing it


@pytest.fixture(autouse=True)
def _torch():
    global torch
    if os.environ.get(OWN_PROCESS):  # only the comparison's own process runs torch
        torch = pytest.importorskip("torch", reason="torch is not installed: `pip install torch==2.13.0` (CPU build)")


def _t(x) -> "torch.Tensor":
    return torch.from_numpy(np.array(x, dtype=np.float32))


def _copy_attention(ours, theirs) -> None:
    # torch keeps one in-projection [3D, D] stacked Q, K, V and stores Linear weights as [out, in].
    theirs.in_proj_weight.copy_(
        torch.cat([_t(ours.q_proj.kernel[...]).T, _t(ours.k_proj.kernel[...]).T, _t(ours.v_proj.kernel[...]).T])
    )
    theirs.in_proj_bias.copy_(
        torch.cat([_t(ours.q_proj.bias[...]), _t(ours.k_proj.bias[...]), _t(ours.v_proj.bias[...])])
    )
    theirs.out_proj.weight.copy_(_t(ours.o_proj.kernel[...]).T)
    theirs.out_proj.bias.copy_(_t(ours.o_proj.bias[...]))


def _copy_linear(ours, theirs) -> None:
    theirs.weight.copy_(_t(ours.kernel[...]).T)
    theirs.bias.copy_(_t(ours.bias[...]))


def _copy_norm(ours, theirs) -> None:
    theirs.weight.copy_(_t(ours.scale_D[...]))
    theirs.bias.copy_(_t(ours.bias_D[...]))


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# Slow: a pytest process of its own that imports torch (~8 s). The default run's representatives are
# tests/test_convert_marian.py::test_converted_logits_equal_transformers (Marian's variant: swish, concatenated
# positions, final_logits_bias) and tests/test_export_marian.py::test_our_default_model_exports_exactly[interleaved]
# (the paper's model): both compare our encoder-decoder's logits with transformers' torch MarianMTModel, an
# independent implementation, on padded batches.
@pytest.mark.slow
def test_the_comparison_passes_in_a_process_of_its_own():
    if os.environ.get(OWN_PROCESS):
        pytest.skip("this is the process of its own")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", f"{__file__}::{MATCHES}"],
        env={**os.environ, OWN_PROCESS: "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode == 0 and "1 skipped" in done.stdout:
        pytest.skip("torch is not installed: `pip install torch==2.13.0` (CPU build)")
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


MATCHES = "test_matches_torch_nn_transformer"


@pytest.mark.skipif(not os.environ.get(OWN_PROCESS), reason="runs in a process of its own (the test above)")
@pytest.mark.parametrize("marian", [False, True], ids=["paper", "marian"])
def test_matches_torch_nn_transformer(marian):
    """The paper's model, and Marian's variant: swish FFN and a (random) final_logits_bias added to the logits."""
    features = dict(activation="swish", final_logits_bias=True) if marian else {}
    model = tiny_model(seed=4, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2, num_decoder_layers=3, **features)
    spec = model.spec
    if marian:
        bias = model.final_logits_bias_V
        bias[...] = np.random.default_rng(5).normal(size=bias[...].shape).astype(np.float32)
    ref = torch.nn.Transformer(
        d_model=spec.d_model,
        nhead=spec.num_heads,
        num_encoder_layers=spec.num_encoder_layers,
        num_decoder_layers=spec.num_decoder_layers,
        dim_feedforward=spec.d_ff,
        dropout=0.0,
        activation=torch.nn.functional.silu if marian else "relu",
        layer_norm_eps=spec.norm_epsilon,
        batch_first=True,
        norm_first=False,
    )
    # torch.nn.Transformer always adds final encoder/decoder norms; the paper's post-LN stack has none.
    ref.encoder.norm = None
    ref.decoder.norm = None
    ref.eval()
    with torch.no_grad():
        for ours, theirs in zip(model.encoder_layers, ref.encoder.layers, strict=True):
            _copy_attention(ours.self_attn, theirs.self_attn)
            _copy_linear(ours.ffn.w1, theirs.linear1)
            _copy_linear(ours.ffn.w2, theirs.linear2)
            _copy_norm(ours.self_attn_residual.norm, theirs.norm1)
            _copy_norm(ours.ffn_residual.norm, theirs.norm2)
        for ours, theirs in zip(model.decoder_layers, ref.decoder.layers, strict=True):
            _copy_attention(ours.self_attn, theirs.self_attn)
            _copy_attention(ours.cross_attn, theirs.multihead_attn)
            _copy_linear(ours.ffn.w1, theirs.linear1)
            _copy_linear(ours.ffn.w2, theirs.linear2)
            _copy_norm(ours.self_attn_residual.norm, theirs.norm1)
            _copy_norm(ours.cross_attn_residual.norm, theirs.norm2)
            _copy_norm(ours.ffn_residual.norm, theirs.norm3)

    src = random_tokens(0, (2, 7)).at[1, 5:].set(0)  # second sentence padded
    tgt = random_tokens(1, (2, 6))
    src_real = np.asarray(src != 0)
    positions_s, positions_t = jnp.arange(7)[None], jnp.arange(6)[None]
    # Embedding * sqrt(d_model) + PE is ours on both sides: torch.nn.Transformer starts after the embeddings.
    x = _t(call(model, "_embed", src, positions_s, target=False))
    y = _t(call(model, "_embed", tgt, positions_t, target=True))
    with torch.no_grad():
        pad_mask = torch.from_numpy(~src_real)
        memory_ref = ref.encoder(x, src_key_padding_mask=pad_mask)
        causal = torch.nn.Transformer.generate_square_subsequent_mask(6)
        out_ref = ref.decoder(y, memory_ref, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=pad_mask)
        logits_ref = out_ref @ _t(model.src_embed.table_VD[...]).T
        if marian:
            logits_ref = logits_ref + _t(model.final_logits_bias_V[...])

    memory = call(model, "encode", src)
    logits = call(model, "decode", memory, tgt, src_segment_ids=jnp.asarray(src_real, jnp.int32))
    # Compare real positions only: torch leaves arbitrary values at padded encoder positions.
    assert _rel_err(np.asarray(memory)[src_real], memory_ref.numpy()[src_real]) < 1e-5
    assert _rel_err(logits, logits_ref.numpy()) < 1e-5
