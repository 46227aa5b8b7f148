"""The figures the page states, each measured on the captured tensors of one sentence (never a constant); the page,
one self-contained HTML file (images inlined as base64 PNG, no script, no network); and a short text summary.

Where a figure needs a step the model does not store (QKᵀ before the 1/√d_k scaling), it is computed from the
model's own Q and K and then checked against what the model went on to compute (its attention weights), and the
page shows that check. Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
from collections.abc import Sequence

import numpy as np

from transformer_jax.explain.capture import Explanation
from transformer_jax.explain.text import TEXT
from transformer_jax.ops.attention import attention_mask
from transformer_jax.visualize.figures import DPI, new_figure, sinusoid_table

TOP_K = 5  # next-token candidates listed per target step
SHOWN_FEATURES = 6  # leading features of each vector in the tables
WEIGHTS = {"cmap": "viridis", "vmin": 0.0, "vmax": 1.0}  # heatmaps of attention weights
STYLE = """
body { font-family: sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
td, th { border: 1px solid #ddd; padding: 2px 6px; text-align: left; }
code, .num { font-family: monospace; } .check { background: #eef7ee; padding: 4px 8px; }
.note { background: #fff4e0; padding: 4px 8px; } img { max-width: 100%; }
"""
e = html.escape  # every text the page shows passes through it


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


def position_check(length: int, d_model: int) -> PositionCheck:
    """Max |PE(pos + k) - M_k PE(pos)| over every pos, k >= 1 with pos + k < length (float32 PE values)."""
    pe_PD = sinusoid_table(length, d_model).astype(np.float64)
    errors = [
        np.abs(pe_PD[k:] - pe_PD[: length - k] @ rotation(pe_PD[k]).T).max() for k in range(1, length)
    ]  # row pos of pe_PD[:length-k] @ M_k^T is M_k PE(pos)
    return PositionCheck(pairs=length * (length - 1) // 2, max_error=float(max(errors, default=0.0)))


def softmax(a: np.ndarray) -> np.ndarray:
    """Over the last axis, in float64: the page's recomputation, never the model's own."""
    p = np.exp(a - a.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


@dataclasses.dataclass
class HeadFigures:
    """One encoder head: its Q, K, V, the scores before and after scaling, and the checks."""

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
    softmax_error: float  # max |softmax(scaled) - the model's weights|
    weighted_v_error: float  # max |weights · V - the model's head output|


def encoder_head(x: Explanation) -> HeadFigures:
    """The chosen head of the chosen encoder layer's self-attention."""
    kv_head = x.head // (x.spec.num_heads // x.spec.heads_kv)  # grouped heads: query head n reads K/V head n // G
    q_TH = x.attention("encoder_layers", "self_attn", "q")[:, x.head]
    k_SH = x.attention("encoder_layers", "self_attn", "k")[:, kv_head]
    v_SE = x.attention("encoder_layers", "self_attn", "v")[:, kv_head]
    weights_TS = x.attention("encoder_layers", "self_attn", "attention_weights")[x.head]
    heads_out_TE = x.attention("encoder_layers", "self_attn", "heads")[:, x.head]
    scores_TS = q_TH.astype(np.float64) @ k_SH.astype(np.float64).T
    scaled_TS = scores_TS / np.sqrt(q_TH.shape[-1])
    return HeadFigures(
        q_TH, k_SH, v_SE, scores_TS, scaled_TS, weights_TS, heads_out_TE,
        var_q=float(q_TH.var()),
        var_k=float(k_SH.var()),
        var_scores=float(scores_TS.var()),
        var_scaled=float(scaled_TS.var()),
        softmax_error=float(np.abs(softmax(scaled_TS) - weights_TS).max()),
        weighted_v_error=float(np.abs(weights_TS @ v_SE - heads_out_TE).max()),
    )  # fmt: skip


def norm_figures(x: Explanation, stack: str, residual: str) -> dict[str, float]:
    """Mean and variance over the features, averaged over positions, before (_in) and after (_out) the norm."""
    before, after = (x.sown[stack][x.layer][residual][name] for name in ("norm_input", "norm_output"))
    return {
        "mean_in": float(before.mean(-1).mean()), "var_in": float(before.var(-1).mean()),
        "mean_out": float(after.mean(-1).mean()), "var_out": float(after.var(-1).mean()),
    }  # fmt: skip


@dataclasses.dataclass
class StepFigures:
    """One target step: the token fed, the token to predict, its probability, and the top candidates."""

    fed: str
    expected: str
    expected_prob: float
    top: list[tuple[str, float]]  # (piece, probability), most probable first


def step_figures(x: Explanation) -> list[StepFigures]:
    probs_TV = softmax(x.logits_TV.astype(np.float64))
    out = []
    for t, fed in enumerate(x.tgt_in_pieces):
        expected_id = x.tgt_in_ids[t + 1] if t + 1 < len(x.tgt_in_ids) else x.spec.eos_id  # the last: </s>
        top = [(x.vocab[i], float(probs_TV[t, i])) for i in np.argsort(-probs_TV[t])[:TOP_K]]
        out.append(StepFigures(fed, x.vocab[expected_id], float(probs_TV[t, expected_id]), top))
    return out


@dataclasses.dataclass
class Figures:
    """Every figure the page states, computed once for the page and the summary."""

    position: PositionCheck | None
    encoder: HeadFigures
    mask_TT: np.ndarray  # the decoder's causal mask (True = may attend)
    above_diagonal: float  # the largest decoder self-attention weight where the mask hides the key
    norms: dict[str, dict[str, float]]  # residual -> norm_figures
    zeros: tuple[float, float] | None  # (encoder, decoder) ReLU zero fractions; None for another activation
    steps: list[StepFigures]


def figures(x: Explanation) -> Figures:
    t_len = len(x.tgt_in_ids)
    mask_TT = np.asarray(attention_mask(1, t_len, t_len, causal=True)[0, 0])  # ops.attention's own mask builder
    decoder_self_TT = x.attention("decoder_layers", "self_attn", "attention_weights")[x.head]
    norms = {
        "encoder self-attention": norm_figures(x, "encoder_layers", "self_attn_residual"),
        "encoder FFN": norm_figures(x, "encoder_layers", "ffn_residual"),
        "decoder self-attention": norm_figures(x, "decoder_layers", "self_attn_residual"),
        "decoder cross-attention": norm_figures(x, "decoder_layers", "cross_attn_residual"),
    }
    # The fraction of the FFN's hidden activations that are exactly 0 (ReLU's max(0, ·)).
    zeros = tuple(
        float((x.sown[s][x.layer]["ffn"]["hidden"] == 0).mean()) for s in ("encoder_layers", "decoder_layers")
    )
    return Figures(
        position=position_check(len(x.src_ids), x.spec.d_model) if x.spec.positional == "sinusoidal" else None,
        encoder=encoder_head(x),
        mask_TT=mask_TT,
        above_diagonal=float(np.where(mask_TT, 0.0, decoder_self_TT).max()),
        norms=norms,
        zeros=zeros if x.spec.activation == "relu" else None,
        steps=step_figures(x),
    )


def fmt(value: float) -> str:
    return f"{value:.4g}"


def err(value: float) -> str:
    return f"{value:.1e}"


def num(v: np.ndarray) -> str:
    shown = ", ".join(f"{a:+.3f}" for a in v[:SHOWN_FEATURES])
    return f'<span class="num">[{shown}{", …" if v.shape[0] > SHOWN_FEATURES else ""}]</span>'


def _heatmaps(panels: Sequence[tuple[str, np.ndarray, list[str] | None, list[str] | None]], alt: str, **imshow) -> str:
    """A row of heatmaps (title, matrix, row labels, column labels), each with its colour bar, as an <img>."""
    rows = max(p[1].shape[0] for p in panels)
    cols = max(p[1].shape[1] for p in panels)
    width = min(max(3.2, 1.2 + 0.25 * min(cols, 48)), 7.5)
    fig = new_figure((len(panels) * width, min(max(2.6, 1.2 + 0.25 * rows), 9.0)))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, m, row_labels, col_labels) in zip(axes, panels, strict=True):
        image = ax.imshow(m, aspect="auto", interpolation="nearest", **imshow)
        ax.set_title(title, fontsize=10)
        if row_labels is not None:
            ax.set_yticks(range(len(row_labels)), row_labels, fontsize=7)
        if col_labels is not None:
            ax.set_xticks(range(len(col_labels)), col_labels, rotation=90, fontsize=7)
        fig.colorbar(image, ax=ax, shrink=0.8)
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format="png")
    return f'<img alt="{e(alt)}" src="data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode("ascii")}">'


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _section(t: dict[str, str], name: str, **values: object) -> str:
    """A section's heading h_NAME and its explanation p_NAME, `values` filled in."""
    return f"<h2>{e(t['h_' + name])}</h2><p>{e(t['p_' + name].format(**values))}</p>"


def _box(kind: str, text: str) -> str:
    """A paragraph set apart: 'check' (a figure measured against its equation) or 'note'."""
    return f'<p class="{kind}">{e(text)}</p>'


def header(x: Explanation, t: dict[str, str]) -> list[str]:
    """The page's top: the sentence, its translation, the model and settings, and a note if the source was cut."""
    spec, s = x.spec, x.settings
    model = (
        f"d_model={spec.d_model}, h={spec.num_heads}, d_k={spec.d_qk}, d_ff={spec.d_ff}, "
        f"{spec.num_encoder_layers}+{spec.num_decoder_layers} layers, {spec.norm_position}-LN"
    )
    decoding = f"beam_size={s['beam_size']}, alpha={s['alpha']}, max_extra_len={s['max_extra_len']}"
    rows = [
        [e(t["sentence"]), e(x.sentence)],
        [e(t["translation"]), f"<b>{e(x.translation)}</b>"],
        [e(t["model"]), e(model)],
        [e(t["checkpoint"]), e(", ".join(map(str, x.steps)))],
        [e(t["decoding"]), e(decoding)],
    ]
    parts = [
        f"<h1>{e(t['title'])}</h1><p>{e(t['intro'])}</p>",
        _table(["", ""], rows),
        f"<p>{e(t['shown'].format(layer=x.layer, head=x.head))}. "
        f"{e(t['target_given'] if x.target_given else t['target_own'])}</p>",
    ]
    if x.truncated:
        parts.append(_box("note", t["truncated"].format(before=x.truncated[0], after=x.truncated[1])))
    return parts


def sections(x: Explanation, f: Figures, t: dict[str, str]) -> list[str]:
    """Sections 1-13, in the order of the model's computation."""
    spec, s, h = x.spec, x.settings, f.encoder
    src, tgt = x.src_pieces, x.tgt_in_pieces
    scaled_SD = x.sown["src_scaled_embedding"]
    summed_SD = x.sown["src_embedding_plus_positions"]
    pe_SD = summed_SD - scaled_SD
    self_TT = x.attention("decoder_layers", "self_attn", "attention_weights")[x.head]
    cross_TS = x.attention("decoder_layers", "cross_attn", "attention_weights")[x.head]
    if f.position is not None:
        pe_check = _box("check", t["pe_check"].format(pairs=f.position.pairs, error=err(f.position.max_error)))
    else:
        pe_check = _box("note", t["pe_learned"])
    variance = t["variance"].format(
        var_q=fmt(h.var_q), var_k=fmt(h.var_k), d_k=spec.d_qk, var_scores=fmt(h.var_scores),
        var_scaled=fmt(h.var_scaled),
    )  # fmt: skip
    if f.zeros is not None:
        zeros = t["ffn_zero"].format(fraction=fmt(f.zeros[0]), fraction_dec=fmt(f.zeros[1]), layer=x.layer)
        ffn = _box("check", zeros)
    else:
        ffn = _box("note", t["ffn_other"].format(activation=spec.activation))
    norm = "p_norm_pre" if spec.norm_position == "pre" else "p_norm"
    return [
        # 1-3: tokens, embeddings × √d_model, + positional encoding
        _section(t, "tokens"),
        _table(
            [t["position"], t["piece"], t["id"]],
            [[str(i), e(p), str(n)] for i, (p, n) in enumerate(zip(src, x.src_ids, strict=True))],
        ),
        f"<h2>{e(t['h_embed'])}</h2><p>{e(t['p_embed'])} √{spec.d_model} = {fmt(np.sqrt(spec.d_model))}.</p>",
        _table(
            [t["piece"], f"E[id] · √d_model ({t['features']} 0..{SHOWN_FEATURES - 1})", "‖·‖"],
            [[e(p), num(v), fmt(np.linalg.norm(v))] for p, v in zip(src, scaled_SD, strict=True)],
        ),
        _heatmaps([("E[id] · √d_model", scaled_SD, src, None)], t["alt_embed"], cmap="RdBu_r"),
        _section(t, "pe"),
        pe_check,
        _table(
            [t["piece"], f"PE(pos) ({t['features']} 0..{SHOWN_FEATURES - 1})", "E·√d + PE"],
            [[e(p), num(a), num(b)] for p, a, b in zip(src, pe_SD, summed_SD, strict=True)],
        ),
        _heatmaps([("PE(pos)", pe_SD, src, None), ("E·√d + PE", summed_SD, src, None)], t["alt_pe"], cmap="RdBu_r"),
        # 4-7: Q, K, V, the scaled scores, the softmax and the heads of one encoder head
        _section(t, "qkv", layer=x.layer, head=x.head),
        _table(
            [t["piece"], "q", "k", "v"],
            [[e(p), *(num(m[i]) for m in (h.q_TH, h.k_SH, h.v_SE))] for i, p in enumerate(src)],
        ),
        _section(t, "scores"),
        _box("check", variance),
        _heatmaps(
            [("QKᵀ", h.scores_TS, src, src), ("QKᵀ / √d_k", h.scaled_TS, src, src)], t["alt_scores"], cmap="RdBu_r"
        ),
        _section(t, "softmax", error=err(h.softmax_error)),
        _heatmaps([("softmax(QKᵀ/√d_k)", h.weights_TS, src, src)], t["alt_softmax"], **WEIGHTS),
        _section(
            t,
            "heads",
            error=err(h.weighted_v_error),
            heads=spec.num_heads,
            concat=spec.num_heads * spec.d_v,
            d_model=spec.d_model,
        ),
        _table(
            [t["piece"], f"head_{x.head} = weights · V", "MultiHead(…) = Concat(heads) W^O"],
            [
                [e(p), num(a), num(b)]
                for p, a, b in zip(
                    src, h.heads_out_TE, x.attention("encoder_layers", "self_attn", "output"), strict=True
                )
            ],
        ),
        # 8-9: residual + norm statistics, the FFN's zeros
        f"<h2>{e(t['h_norm'])}</h2><p>{e(t[norm])}</p>",
        _table(
            ["", ""],
            [[e(name), e(t["norm_row"].format(**{k: fmt(v) for k, v in n.items()}))] for name, n in f.norms.items()],
        ),
        _section(t, "ffn"),
        ffn,
        # 10-11: the decoder's causal mask and cross-attention
        _section(t, "causal", above=err(f.above_diagonal)),
        _heatmaps(
            [
                ("mask: i sees j ≤ i", f.mask_TT.astype(np.float32), tgt, tgt),
                (f"decoder self-attention, head {x.head}", self_TT, tgt, tgt),
            ],
            t["alt_causal"],
            **WEIGHTS,
        ),
        _section(t, "cross", layer=x.layer, head=x.head),
        _heatmaps([("cross-attention", cross_TS, tgt, src)], t["alt_cross"], **WEIGHTS),
        # 12-13: next-token probabilities and the beam search, step by step
        _section(t, "logits"),
        _table(
            [t["step"], t["fed"], t["next"], t["p_next"], t["top"]],
            [
                [
                    str(i),
                    e(st.fed),
                    e(st.expected),
                    fmt(st.expected_prob),
                    ", ".join(f"{e(p)} ({fmt(q)})" for p, q in st.top),
                ]
                for i, st in enumerate(f.steps)
            ],
        ),
        _section(t, "beam", beam=s["beam_size"], alpha=s["alpha"]),
        _table(
            [t["step"], t["hypothesis"], t["log_prob"], t["score"], t["ended"]],
            [
                [str(i + 1), e(" ".join(hyp.pieces)), fmt(hyp.log_prob), fmt(hyp.score), "✓" if hyp.ended else ""]
                for i, beams in enumerate(x.beam_steps)
                for hyp in beams
            ],
        ),
    ]


def render(x: Explanation, f: Figures, lang: str) -> str:
    """The page, in `lang` (headings and explanations; numbers and formulas are the same in every language)."""
    t = TEXT[lang]
    body = "\n".join(header(x, t) + sections(x, f, t))
    return (
        f'<!DOCTYPE html>\n<html lang="{lang}"><head><meta charset="utf-8"><title>{e(t["title"])}</title>'
        f"<style>{STYLE}</style></head><body>\n{body}\n</body></html>\n"
    )


def summary(x: Explanation, f: Figures) -> str:
    """A few lines for the terminal: the translation and the page's checks."""
    lines = [
        f"sentence: {x.sentence}",
        f"translation: {x.translation}",
        f"source pieces ({len(x.src_pieces)}): {' '.join(x.src_pieces)}",
        f"checkpoint steps averaged: {', '.join(map(str, x.steps))}",
    ]
    if x.truncated:
        lines.append(f"note: the sentence was cut from {x.truncated[0]} to {x.truncated[1]} tokens (the model's limit)")
    if f.position is not None:
        lines.append(f"PE(pos+k) = M_k PE(pos): max error {err(f.position.max_error)} over {f.position.pairs} pairs")
    h = f.encoder
    lines += [
        f"encoder layer {x.layer} head {x.head}: var(QK^T) = {fmt(h.var_scores)}, var(QK^T/sqrt(d_k)) = "
        f"{fmt(h.var_scaled)} (d_k = {x.spec.d_qk}); softmax vs the model's weights: {err(h.softmax_error)}",
        f"causal mask: largest weight on a future position {err(f.above_diagonal)}",
    ]
    if f.zeros is not None:
        lines.append(f"FFN ReLU zeros: encoder {fmt(f.zeros[0])}, decoder {fmt(f.zeros[1])}")
    return "\n".join(lines)
