"""One self-contained HTML page (images inlined as base64 PNG, no script, no network) and a short text summary.

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
from collections.abc import Sequence

import numpy as np

from transformer_jax.explain import numbers
from transformer_jax.explain.capture import Explanation
from transformer_jax.explain.text import TEXT
from transformer_jax.visualize.figures import DPI, new_figure

SHOWN_FEATURES = 6  # leading features of each vector in the tables
STYLE = """
body { font-family: sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
td, th { border: 1px solid #ddd; padding: 2px 6px; text-align: left; }
code, .num { font-family: monospace; } .check { background: #eef7ee; padding: 4px 8px; }
.note { background: #fff4e0; padding: 4px 8px; } img { max-width: 100%; }
"""


@dataclasses.dataclass
class Figures:
    """Every figure the page states (numbers.py), computed once for the page and the summary."""

    position: numbers.PositionCheck | None
    encoder: numbers.HeadFigures
    decoder_self: numbers.HeadFigures
    cross: numbers.HeadFigures
    mask_TT: np.ndarray
    above_diagonal: float  # the largest decoder self-attention weight where the mask hides the key
    norms: dict[str, numbers.NormFigures]
    zeros: tuple[float, float] | None  # (encoder, decoder) ReLU zero fractions; None for another activation
    steps: list[numbers.StepFigures]


def figures(x: Explanation) -> Figures:
    s_len, t_len = len(x.src_ids), len(x.tgt_in_ids)
    mask_TT = numbers.causal_mask(t_len)
    decoder_self = numbers.head_figures(x, "decoder_layers", "self_attn", mask_TT)
    norms = {
        "encoder self-attention": numbers.norm_figures(x, "encoder_layers", "self_attn_residual"),
        "encoder FFN": numbers.norm_figures(x, "encoder_layers", "ffn_residual"),
        "decoder self-attention": numbers.norm_figures(x, "decoder_layers", "self_attn_residual"),
        "decoder cross-attention": numbers.norm_figures(x, "decoder_layers", "cross_attn_residual"),
    }
    relu = x.spec.activation == "relu"
    zeros = (numbers.zero_fraction(x, "encoder_layers"), numbers.zero_fraction(x, "decoder_layers"))
    return Figures(
        position=numbers.position_check(s_len, x.spec.d_model) if x.spec.positional == "sinusoidal" else None,
        encoder=numbers.head_figures(x, "encoder_layers", "self_attn"),
        decoder_self=decoder_self,
        cross=numbers.head_figures(x, "decoder_layers", "cross_attn"),
        mask_TT=mask_TT,
        above_diagonal=float(np.where(mask_TT, 0.0, decoder_self.weights_TS).max()),
        norms=norms,
        zeros=zeros if relu else None,
        steps=numbers.step_figures(x),
    )


def fmt(value: float) -> str:
    return f"{value:.4g}"


def err(value: float) -> str:
    return f"{value:.1e}"


def vector(v: np.ndarray) -> str:
    shown = ", ".join(f"{a:+.3f}" for a in v[:SHOWN_FEATURES])
    return f"[{shown}{', …' if v.shape[0] > SHOWN_FEATURES else ''}]"


def num(v: np.ndarray) -> str:
    return f'<span class="num">{vector(v)}</span>'


def _png(fig, alt: str) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format="png")
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


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
    return _png(fig, alt)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def header(x: Explanation, t: dict[str, str]) -> list[str]:
    """The page's top: the sentence, its translation, the model and settings, and a note if the source was cut."""
    e = html.escape
    spec, s = x.spec, x.settings
    model = (
        f"d_model={spec.d_model}, h={spec.num_heads}, d_k={spec.d_qk}, d_ff={spec.d_ff}, "
        f"{spec.num_encoder_layers}+{spec.num_decoder_layers} layers, {spec.norm_position}-LN"
    )
    decoding = f"beam_size={s['beam_size']}, alpha={s['alpha']}, max_extra_len={s['max_extra_len']}"
    parts = [
        f"<h1>{e(t['title'])}</h1><p>{e(t['intro'])}</p>",
        _table(
            ["", ""],
            [
                [e(t["sentence"]), e(x.sentence)],
                [e(t["translation"]), f"<b>{e(x.translation)}</b>"],
                [e(t["model"]), e(model)],
                [e(t["checkpoint"]), e(", ".join(map(str, x.steps)))],
                [e(t["decoding"]), e(decoding)],
            ],
        ),
        f"<p>{e(t['shown'].format(layer=x.layer, head=x.head))}. "
        f"{e(t['target_given'] if x.target_given else t['target_own'])}</p>",
    ]
    if x.truncated:
        parts.append(f'<p class="note">{e(t["truncated"].format(before=x.truncated[0], after=x.truncated[1]))}</p>')
    return parts


def _inputs(x: Explanation, f: Figures, t: dict[str, str]) -> list[str]:
    """Sections 1-3: tokens, embeddings × √d_model, + positional encoding."""
    e = html.escape
    spec = x.spec
    src = [e(p) for p in x.src_pieces]
    parts: list[str] = []
    scaled_SD = x.sown["src_scaled_embedding"]
    summed_SD = x.sown["src_embedding_plus_positions"]
    pe_SD = summed_SD - scaled_SD
    parts += [
        f"<h2>{e(t['h_tokens'])}</h2><p>{e(t['p_tokens'])}</p>",
        _table(
            [t["position"], t["piece"], t["id"]],
            [[str(i), p, str(n)] for i, (p, n) in enumerate(zip(src, x.src_ids, strict=True))],
        ),
        f"<h2>{e(t['h_embed'])}</h2><p>{e(t['p_embed'])} √{spec.d_model} = {fmt(np.sqrt(spec.d_model))}.</p>",
        _table(
            [t["piece"], f"E[id] · √d_model ({t['features']} 0..{SHOWN_FEATURES - 1})", "‖·‖"],
            [[p, num(v), fmt(np.linalg.norm(v))] for p, v in zip(src, scaled_SD, strict=True)],
        ),
        _heatmaps([("E[id] · √d_model", scaled_SD, x.src_pieces, None)], t["alt_embed"], cmap="RdBu_r"),
        f"<h2>{e(t['h_pe'])}</h2><p>{e(t['p_pe'])}</p>",
    ]
    if f.position is not None:
        parts.append(
            f'<p class="check">{e(t["pe_check"].format(pairs=f.position.pairs, error=err(f.position.max_error)))}</p>'
        )
    else:
        parts.append(f'<p class="note">{e(t["pe_learned"])}</p>')
    parts += [
        _table(
            [t["piece"], f"PE(pos) ({t['features']} 0..{SHOWN_FEATURES - 1})", "E·√d + PE"],
            [[p, num(a), num(b)] for p, a, b in zip(src, pe_SD, summed_SD, strict=True)],
        ),
        _heatmaps(
            [("PE(pos)", pe_SD, x.src_pieces, None), ("E·√d + PE", summed_SD, x.src_pieces, None)],
            t["alt_pe"],
            cmap="RdBu_r",
        ),
    ]
    return parts


def _encoder_head(x: Explanation, f: Figures, t: dict[str, str]) -> list[str]:
    """Sections 4-7: Q, K, V, the scaled scores, the softmax and the heads of one encoder head."""
    e = html.escape
    spec = x.spec
    src = [e(p) for p in x.src_pieces]
    parts: list[str] = []
    h = f.encoder
    variance = t["variance"].format(
        var_q=fmt(h.var_q),
        var_k=fmt(h.var_k),
        d_k=spec.d_qk,
        var_scores=fmt(h.var_scores),
        var_scaled=fmt(h.var_scaled),
    )
    heads = t["p_heads"].format(
        error=err(h.weighted_v_error), heads=spec.num_heads, concat=spec.num_heads * spec.d_v, d_model=spec.d_model
    )
    parts += [
        f"<h2>{e(t['h_qkv'])}</h2><p>{e(t['p_qkv'].format(layer=x.layer, head=x.head))}</p>",
        _table(
            [t["piece"], "q", "k", "v"],
            [[p, *(num(m[i]) for m in (h.q_TH, h.k_SH, h.v_SE))] for i, p in enumerate(src)],
        ),
        f"<h2>{e(t['h_scores'])}</h2><p>{e(t['p_scores'])}</p>",
        f'<p class="check">{e(variance)}</p>',
        _heatmaps(
            [("QKᵀ", h.scores_TS, x.src_pieces, x.src_pieces), ("QKᵀ / √d_k", h.scaled_TS, x.src_pieces, x.src_pieces)],
            t["alt_scores"],
            cmap="RdBu_r",
        ),
        f"<h2>{e(t['h_softmax'])}</h2><p>{e(t['p_softmax'].format(error=err(h.softmax_error)))}</p>",
        _heatmaps(
            [("softmax(QKᵀ/√d_k)", h.weights_TS, x.src_pieces, x.src_pieces)],
            t["alt_softmax"],
            cmap="viridis",
            vmin=0.0,
            vmax=1.0,
        ),
        f"<h2>{e(t['h_heads'])}</h2><p>{e(heads)}</p>",
        _table(
            [t["piece"], f"head_{x.head} = weights · V", "MultiHead(…) = Concat(heads) W^O"],
            [
                [p, num(a), num(b)]
                for p, a, b in zip(
                    src, h.heads_out_TE, x.attention("encoder_layers", "self_attn", "output"), strict=True
                )
            ],
        ),
    ]
    return parts


def _norm_and_ffn(x: Explanation, f: Figures, t: dict[str, str]) -> list[str]:
    """Sections 8-9: residual + norm statistics, the FFN's zeros."""
    e = html.escape
    spec = x.spec
    parts: list[str] = []
    parts += [
        f"<h2>{e(t['h_norm'])}</h2><p>{e(t['p_norm_pre' if spec.norm_position == 'pre' else 'p_norm'])}</p>",
        _table(
            ["", ""],
            [
                [
                    e(name),
                    e(
                        t["norm_row"].format(
                            mean_in=fmt(n.mean_in),
                            mean_out=fmt(n.mean_out),
                            var_in=fmt(n.var_in),
                            var_out=fmt(n.var_out),
                        )
                    ),
                ]
                for name, n in f.norms.items()
            ],
        ),
        f"<h2>{e(t['h_ffn'])}</h2><p>{e(t['p_ffn'])}</p>",
    ]
    if f.zeros is not None:
        zeros = t["ffn_zero"].format(fraction=fmt(f.zeros[0]), fraction_dec=fmt(f.zeros[1]), layer=x.layer)
        parts.append(f'<p class="check">{e(zeros)}</p>')
    else:
        parts.append(f'<p class="note">{e(t["ffn_other"].format(activation=spec.activation))}</p>')
    return parts


def _decoder(x: Explanation, f: Figures, t: dict[str, str]) -> list[str]:
    """Sections 10-11: the decoder's causal mask and cross-attention."""
    e = html.escape
    parts: list[str] = []
    parts += [
        f"<h2>{e(t['h_causal'])}</h2><p>{e(t['p_causal'].format(above=err(f.above_diagonal)))}</p>",
        _heatmaps(
            [
                ("mask: i sees j ≤ i", f.mask_TT.astype(np.float32), x.tgt_in_pieces, x.tgt_in_pieces),
                (f"decoder self-attention, head {x.head}", f.decoder_self.weights_TS, x.tgt_in_pieces, x.tgt_in_pieces),
            ],
            t["alt_causal"],
            cmap="viridis",
            vmin=0.0,
            vmax=1.0,
        ),
        f"<h2>{e(t['h_cross'])}</h2><p>{e(t['p_cross'].format(layer=x.layer, head=x.head))}</p>",
        _heatmaps(
            [("cross-attention", f.cross.weights_TS, x.tgt_in_pieces, x.src_pieces)],
            t["alt_cross"],
            cmap="viridis",
            vmin=0.0,
            vmax=1.0,
        ),
    ]
    return parts


def _outputs(x: Explanation, f: Figures, t: dict[str, str]) -> list[str]:
    """Sections 12-13: next-token probabilities and the beam search, step by step."""
    e = html.escape
    s = x.settings
    parts: list[str] = []
    parts += [
        f"<h2>{e(t['h_logits'])}</h2><p>{e(t['p_logits'])}</p>",
        _table(
            [t["step"], t["fed"], t["next"], t["p_next"], t["top"]],
            [
                [
                    str(i),
                    e(st.fed),
                    e(st.expected),
                    fmt(st.expected_prob),
                    ", ".join(f"{e(p)} ({fmt(q)})" for p, _, q in st.top),
                ]
                for i, st in enumerate(f.steps)
            ],
        ),
        f"<h2>{e(t['h_beam'])}</h2><p>{e(t['p_beam'].format(beam=s['beam_size'], alpha=s['alpha']))}</p>",
        _table(
            [t["step"], t["hypothesis"], t["log_prob"], t["score"], t["ended"]],
            [
                [str(i + 1), e(" ".join(hyp.pieces)), fmt(hyp.log_prob), fmt(hyp.score), "✓" if hyp.ended else ""]
                for i, beams in enumerate(x.beam_steps)
                for hyp in beams
            ],
        ),
    ]
    return parts


def render(x: Explanation, f: Figures, lang: str) -> str:
    """The page, in `lang` (headings and explanations; numbers and formulas are the same in every language)."""
    t = TEXT[lang]
    e = html.escape
    parts = header(x, t)
    for section in (_inputs, _encoder_head, _norm_and_ffn, _decoder, _outputs):
        parts += section(x, f, t)
    body = "\n".join(parts)
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
