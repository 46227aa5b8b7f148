"""Analytic FLOP counts of the Transformer, for throughput, MFU and run-time estimates.

One multiply-add is 2 FLOPs. Counted: every matmul (projections, attention scores and weighted sums, FFN, output
logits) at the batch's padded shape, i.e. the work the hardware does. Not counted: softmax, norms, dropout and
elementwise ops (a few percent). A training step costs 3x the forward pass (backward = 2x forward).

MFU's denominator, when train.peak_flops is not set, is a measured matmul peak (`matmul_peak`): measured once per
kind of machine and kept beside the compilation cache, so that a restart neither waits for it nor reports an MFU
against a different (noisy) measurement.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from transformer_jax import runtime
from transformer_jax.model.spec import TransformerSpec

PEAK_FILE = "matmul_peak.json"  # in the compilation cache's per-host directory: {peak_key(): FLOP/s}


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


def peak_key() -> str:
    """What a measured peak depends on: the device's platform and kind, the host's CPU type, the cores this process
    may use (XLA:CPU's thread pool), jax's version and XLA_FLAGS."""
    device = jax.devices()[0]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{device.platform} {device.device_kind} | host {runtime.host_kind()} | {cores} cores | "
        f"jax {jax.__version__} | XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}"
    )


def _read_peaks(file: Path) -> dict[str, float]:
    """The peaks a file holds; a missing or damaged file holds none (they are measured again and rewritten)."""
    try:
        peaks = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(peaks, dict):
        return {}
    return {k: float(v) for k, v in peaks.items() if isinstance(v, int | float) and v > 0}


def matmul_peak(directory: Path | None) -> float:
    """measure_matmul_peak() of this kind of machine (`peak_key`), kept in directory/PEAK_FILE after its first
    measurement; measured every time when directory is None (the compilation cache is off).

    The file is replaced whole through a rename; a directory that cannot be written only means measuring again.
    """
    if directory is None:
        return measure_matmul_peak()
    file, key = Path(directory) / PEAK_FILE, peak_key()
    peaks = _read_peaks(file)
    if key in peaks:
        return peaks[key]
    peaks[key] = measure_matmul_peak()
    temporary = None
    try:
        with tempfile.NamedTemporaryFile("w", dir=directory, prefix=".tmp-peak-", delete=False) as out:
            temporary = out.name
            json.dump(peaks, out, indent=1)
        os.replace(temporary, file)
        temporary = None
        logging.info("measured a matmul peak of %.3g FLOP/s per device for MFU; kept in %s", peaks[key], file)
    except OSError as error:
        logging.info("the matmul peak is not kept (%s cannot be written: %s)", file, error.strerror or error)
    finally:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
    return peaks[key]
