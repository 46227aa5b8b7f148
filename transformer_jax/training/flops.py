"""Analytic FLOP counts of the Transformer, for throughput, MFU and run-time estimates.

One multiply-add is 2 FLOPs. Counted: every matmul (projections, attention scores and weighted sums, FFN, output
logits) at the batch's padded shape, i.e. the work the hardware does. Not counted: softmax, norms, dropout and
elementwise ops (a few percent). A training step costs 3x the forward pass (backward = 2x forward).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from transformer_jax.model.spec import TransformerSpec


def _projections(spec: TransformerSpec, q_tokens: int, kv_tokens: int) -> float:
    """Query, key/value and output projections of one attention layer."""
    d, n, k, hq, hv = spec.d_model, spec.num_heads, spec.heads_kv, spec.d_qk, spec.d_v
    return 2 * (q_tokens * d * n * hq + kv_tokens * d * k * (hq + hv) + q_tokens * n * hv * d)


def _scores_and_mix(spec: TransformerSpec, q_len: int, kv_len: int) -> float:
    """Attention scores and the weighted sum of the values, for one sequence."""
    return 2 * q_len * kv_len * spec.num_heads * (spec.d_qk + spec.d_v)


def _ffn(spec: TransformerSpec, tokens: int) -> float:
    return 2 * (3 if spec.activation == "swiglu" else 2) * tokens * spec.d_model * spec.d_ff


def forward_flops(spec: TransformerSpec, batch: int, src_len: int, tgt_len: int) -> float:
    """FLOPs of one forward pass over a [batch, src_len] source and [batch, tgt_len] target."""
    s_tok, t_tok = batch * src_len, batch * tgt_len
    encoder = spec.num_encoder_layers * (
        _projections(spec, s_tok, s_tok) + batch * _scores_and_mix(spec, src_len, src_len) + _ffn(spec, s_tok)
    )
    decoder = spec.num_decoder_layers * (
        _projections(spec, t_tok, t_tok)
        + batch * _scores_and_mix(spec, tgt_len, tgt_len)
        + _projections(spec, t_tok, s_tok)
        + batch * _scores_and_mix(spec, tgt_len, src_len)
        + _ffn(spec, t_tok)
    )
    logits = 2 * t_tok * spec.d_model * spec.vocab_size
    return float(encoder + decoder + logits)


def decode_step_flops(spec: TransformerSpec, rows: int, src_len: int, slots: int) -> float:
    """FLOPs of one cached decoding step of `rows` rows (sentences x beams): each row's new token through the
    decoder, its self-attention over all `slots` cache slots and its cross-attention over src_len positions (whose
    keys and values the cache holds), and the logits."""
    decoder = spec.num_decoder_layers * (
        _projections(spec, rows, rows)
        + rows * _scores_and_mix(spec, 1, slots)
        + _projections(spec, rows, 0)
        + rows * _scores_and_mix(spec, 1, src_len)
        + _ffn(spec, rows)
    )
    return float(decoder + 2 * rows * spec.d_model * spec.vocab_size)


def train_step_flops(spec: TransformerSpec, batch: int, src_len: int, tgt_len: int) -> float:
    """Forward + backward: 3x the forward FLOPs."""
    return 3.0 * forward_flops(spec, batch, src_len, tgt_len)


def measure_matmul_peak(size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of one device on a float32 size x size matmul: the denominator of MFU when no peak is configured."""
    a = jnp.ones((size, size), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best
