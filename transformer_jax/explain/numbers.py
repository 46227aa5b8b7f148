"""The figures the page states, each measured on the captured tensors of one sentence (never a constant).

Where a figure needs a step the model does not store (QKᵀ before the 1/√d_k scaling), it is computed from the
model's own Q and K and then checked against what the model went on to compute (its attention weights), and the
page shows that check. Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from transformer_jax.explain.capture import Explanation
from transformer_jax.model.layers import sinusoidal_encoding
from transformer_jax.ops.attention import attention_mask

TOP_K = 5  # next-token candidates listed per target step


@dataclasses.dataclass
class PositionCheck:
    """PE(pos + k) = M_k PE(pos) on this sentence's positions: the largest error over all pairs checked."""

    pairs: int
    max_error: float


def rotation(pe_k_D: np.ndarray) -> np.ndarray:
    """M_k [D, D]: block-diagonal 2×2 rotations [[cos kω_i, sin kω_i], [-sin kω_i, cos kω_i]].

    Built from PE(k) itself, whose features (2i, 2i+1) are (sin kω_i, cos kω_i), so no frequency is restated
    here: sin(a + b) = sin a cos b + cos a sin b and cos(a + b) = cos a cos b - sin a sin b.
    """
    d = pe_k_D.shape[0]
    m_DD = np.zeros((d, d), np.float64)
    sin, cos = pe_k_D[0::2], pe_k_D[1::2]
    i = np.arange(0, d, 2)
    m_DD[i, i], m_DD[i, i + 1] = cos, sin
    m_DD[i + 1, i], m_DD[i + 1, i + 1] = -sin, cos
    return m_DD


def positional_table(length: int, d_model: int) -> np.ndarray:
    """PE [P, D] for positions 0..length-1, from the model's own sinusoidal_encoding, in the paper's interleaved
    layout that `rotation` reads (model.sinusoid_layout=concatenated permutes the same columns: the check holds)."""
    return np.asarray(sinusoidal_encoding(jnp.arange(length)[None], d_model, "interleaved")[0], np.float64)


def position_check(length: int, d_model: int) -> PositionCheck:
    """Max |PE(pos + k) - M_k PE(pos)| over every pos, k >= 1 with pos + k < length (float32 PE values)."""
    pe_PD = positional_table(length, d_model)
    errors = [
        np.abs(pe_PD[k:] - pe_PD[: length - k] @ rotation(pe_PD[k]).T).max() for k in range(1, length)
    ]  # row pos of pe_PD[:length-k] @ M_k^T is M_k PE(pos)
    return PositionCheck(pairs=length * (length - 1) // 2, max_error=float(max(errors, default=0.0)))


@dataclasses.dataclass
class HeadFigures:
    """One head of one attention module: its Q, K, V, the scores before and after scaling, and the checks."""

    q_TH: np.ndarray
    k_SH: np.ndarray
    v_SE: np.ndarray
    scores_TS: np.ndarray  # Q Kᵀ
    scaled_TS: np.ndarray  # Q Kᵀ / √d_k
    weights_TS: np.ndarray  # the model's softmax weights
    heads_out_TE: np.ndarray  # the model's weights · V for this head
    var_q: float
    var_k: float
    var_scores: float
    var_scaled: float
    softmax_error: float  # max |softmax(scaled, masked) - the model's weights|
    weighted_v_error: float  # max |weights · V - the model's head output|


def head_figures(x: Explanation, stack: str, module: str, mask_TS: np.ndarray | None = None) -> HeadFigures:
    """The chosen head of the chosen layer's `module` in `stack`; mask_TS (True = visible) for the softmax check."""
    spec = x.spec
    kv_head = x.head // (spec.num_heads // spec.heads_kv)  # grouped heads: query head n reads K/V head n // G
    q_TH = x.attention(stack, module, "q")[:, x.head]
    k_SH = x.attention(stack, module, "k")[:, kv_head]
    v_SE = x.attention(stack, module, "v")[:, kv_head]
    weights_TS = x.attention(stack, module, "attention_weights")[x.head]
    heads_out_TE = x.attention(stack, module, "heads")[:, x.head]
    scores_TS = q_TH.astype(np.float64) @ k_SH.astype(np.float64).T
    scaled_TS = scores_TS / np.sqrt(q_TH.shape[-1])
    masked = scaled_TS if mask_TS is None else np.where(mask_TS, scaled_TS, -np.inf)
    softmax_TS = np.exp(masked - masked.max(-1, keepdims=True))
    softmax_TS /= softmax_TS.sum(-1, keepdims=True)
    visible = np.ones_like(scores_TS, bool) if mask_TS is None else mask_TS
    return HeadFigures(
        q_TH=q_TH,
        k_SH=k_SH,
        v_SE=v_SE,
        scores_TS=scores_TS,
        scaled_TS=scaled_TS,
        weights_TS=weights_TS,
        heads_out_TE=heads_out_TE,
        var_q=float(q_TH.var()),
        var_k=float(k_SH.var()),
        var_scores=float(scores_TS[visible].var()),
        var_scaled=float(scaled_TS[visible].var()),
        softmax_error=float(np.abs(softmax_TS - weights_TS).max()),
        weighted_v_error=float(np.abs(weights_TS @ v_SE - heads_out_TE).max()),
    )


@dataclasses.dataclass
class NormFigures:
    """Mean and variance over the features, averaged over positions, before and after the norm."""

    mean_in: float
    var_in: float
    mean_out: float
    var_out: float


def norm_figures(x: Explanation, stack: str, residual: str) -> NormFigures:
    n = x.sown[stack][x.layer][residual]
    before, after = n["norm_input"], n["norm_output"]
    return NormFigures(
        float(before.mean(-1).mean()), float(before.var(-1).mean()), float(after.mean(-1).mean()),
        float(after.var(-1).mean()),
    )  # fmt: skip


def zero_fraction(x: Explanation, stack: str) -> float:
    """The fraction of the FFN's hidden activations that are exactly 0 (ReLU's max(0, ·))."""
    hidden = x.sown[stack][x.layer]["ffn"]["hidden"]
    return float((hidden == 0).mean())


def causal_mask(length: int) -> np.ndarray:
    """The decoder's mask [T, T] (True = may attend), from ops.attention's own mask builder."""
    return np.asarray(attention_mask(1, length, length, causal=True)[0, 0])


@dataclasses.dataclass
class StepFigures:
    """One target step: the token fed, the token to predict, its probability, and the top candidates."""

    fed: str
    expected: str
    expected_prob: float
    top: list[tuple[str, float, float]]  # (piece, logit, probability), most probable first


def step_figures(x: Explanation) -> list[StepFigures]:
    logits_TV = x.logits_TV.astype(np.float64)
    probs_TV = np.exp(logits_TV - logits_TV.max(-1, keepdims=True))
    probs_TV /= probs_TV.sum(-1, keepdims=True)
    out = []
    for t, fed in enumerate(x.tgt_in_pieces):
        order = np.argsort(-probs_TV[t])[:TOP_K]
        expected_id = x.tgt_in_ids[t + 1] if t + 1 < len(x.tgt_in_ids) else x.spec.eos_id  # the last: </s>
        expected_prob = probs_TV[t, expected_id]
        out.append(
            StepFigures(
                fed=fed,
                expected=x.tgt_out_pieces[t],
                expected_prob=float(expected_prob),
                top=[(x.piece(int(i)), float(logits_TV[t, i]), float(probs_TV[t, i])) for i in order],
            )
        )
    return out
