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


def forward_flops(spec: TransformerSpec, batch: int, src_len: int, tgt_len: int) -> float:
    """FLOPs of one forward pass over a [batch, src_len] source and [batch, tgt_len] target."""
    d, n, k = spec.d_model, spec.num_heads, spec.heads_kv
    hq, hv = spec.d_qk, spec.d_v
    ffn_mats = 3 if spec.activation == "swiglu" else 2

    def projections(q_tokens: int, kv_tokens: int) -> float:
        return 2 * (q_tokens * d * n * hq + kv_tokens * d * k * (hq + hv) + q_tokens * n * hv * d)

    def scores_and_mix(q_len: int, kv_len: int) -> float:
        return 2 * q_len * kv_len * n * (hq + hv)

    ffn = lambda tokens: 2 * ffn_mats * tokens * d * spec.d_ff
    s_tok, t_tok = batch * src_len, batch * tgt_len
    encoder = spec.num_encoder_layers * (
        projections(s_tok, s_tok) + batch * scores_and_mix(src_len, src_len) + ffn(s_tok)
    )
    decoder = spec.num_decoder_layers * (
        projections(t_tok, t_tok)
        + batch * scores_and_mix(tgt_len, tgt_len)
        + projections(t_tok, s_tok)
        + batch * scores_and_mix(tgt_len, src_len)
        + ffn(t_tok)
    )
    logits = 2 * t_tok * d * spec.vocab_size
    return float(encoder + decoder + logits)


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
