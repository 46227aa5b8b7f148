"""Attention weights of one sentence pair from a checkpoint: encoder self-attention, decoder masked self-attention
and cross-attention, one PNG per (kind, layer) with a grid of heads (or one head), pieces on the axes.

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax.errors import CheckpointError, EvalError, VisualizeError
from transformer_jax.evaluation.restore import CheckpointChoice, restore_model, workdir_tokenizer
from transformer_jax.model import capture_attention_weights
from transformer_jax.visualize.figures import new_figure, save

HEAD_COLUMNS = 4  # attention heads per row
# kind -> (layer stack, attention module, title, query axis, key axis)
ATTENTION_KINDS = {
    "encoder": ("encoder_layers", "self_attn", "encoder self-attention", "source", "source"),
    "decoder": ("decoder_layers", "self_attn", "decoder masked self-attention", "target input", "target input"),
    "cross": ("decoder_layers", "cross_attn", "decoder-encoder cross-attention", "target input", "source"),
}


@dataclasses.dataclass
class AttentionMaps:
    """The attention weights of one sentence pair: kind -> one [N, T, S] float32 array per layer."""

    src_pieces: list[str]  # source pieces then </s>
    tgt_pieces: list[str]  # decoder input: <s> then the target pieces
    weights: dict[str, list[np.ndarray]]


@dataclasses.dataclass
class AttentionResult:
    paths: list[Path]
    maps: AttentionMaps  # everything the model computed
    drawn: dict[Path, np.ndarray]  # per file, the [panels, T, S] arrays read back from its images
    step: int  # checkpoint step


@nnx.jit
def _capturing_forward(model: Any, src_1S: jax.Array, tgt_1T: jax.Array) -> tuple[jax.Array, nnx.State]:
    # Compiled, although for one sentence pair: op by op, every operation compiles a program of its own, several
    # times slower than compiling the pass once (docs/compilation.md).
    return nnx.capture(model, nnx.Intermediate)(src_1S, tgt_1T)


def sown_forward(
    model: Any, src_ids: Sequence[int], tgt_in_ids: Sequence[int], capture: Callable[..., None]
) -> tuple[np.ndarray, dict[str, Any]]:
    """(logits [T, V], what the model sowed) of one teacher-forced call model(src, tgt_in) with `capture(model)` on
    (model.capture_attention_weights or capture_intermediates), float32, batch row 0. The model is in eval mode."""
    capture(model)
    try:
        logits_1TV, sown = _capturing_forward(
            model, jnp.asarray([list(src_ids)], jnp.int32), jnp.asarray([list(tgt_in_ids)], jnp.int32)
        )
    finally:
        capture(model, False)
    first_row = lambda calls: np.asarray(calls[0][0], np.float32)  # a tuple of calls (one here), batch axis first
    sown = jax.tree.map(first_row, nnx.to_pure_dict(sown), is_leaf=lambda x: isinstance(x, tuple))
    return np.asarray(logits_1TV[0], np.float32), sown


def attention_weights(model: Any, src_ids: Sequence[int], tgt_in_ids: Sequence[int]) -> dict[str, list[np.ndarray]]:
    """The attention weights the forward pass uses for one sentence pair (teacher forcing), per kind and layer."""
    _, sown = sown_forward(model, src_ids, tgt_in_ids, capture_attention_weights)
    return {
        kind: [sown[stack][i][module]["attention_weights"] for i in range(len(getattr(model, stack)))]
        for kind, (stack, module, *_) in ATTENTION_KINDS.items()
    }


def encode_pair(tokenizer: Any, source: str, target: str) -> tuple[list[int], list[int]]:
    """(source ids then EOS, BOS then target ids): the model's inputs in training and translation."""
    src_ids = tokenizer.encode_source(source) + [tokenizer.ids.eos]
    return src_ids, [tokenizer.ids.bos] + tokenizer.encode_target(target)


def load_model(workdir: str | Path, config: Any = None, checkpoint: str | int = "latest") -> tuple[Any, Any, Any, int]:
    """(config, model in eval mode, tokenizer, step) of one checkpoint; config None means the saved one."""
    if not Path(workdir).is_dir():
        raise VisualizeError(f"--workdir {workdir}: no such directory")
    try:
        config, model, steps = restore_model(
            str(workdir), CheckpointChoice(str(checkpoint), None if checkpoint == "best" else 1), config=config
        )
        tokenizer = workdir_tokenizer(config, str(workdir))
    except (EvalError, CheckpointError) as e:
        raise VisualizeError(str(e)) from e  # this function's callers expect a VisualizeError
    return config, model, tokenizer, steps[-1]


def check_selection(
    num_enc: int, num_dec: int, num_heads: int, layer: int | None, head: int | None, both: bool = False
) -> None:
    """--layer and --head (None: all) name a layer and a head the model has; both: a layer of encoder and decoder."""
    num_layers = min(num_enc, num_dec) if both else max(num_enc, num_dec)
    if layer is not None and not 0 <= layer < num_layers:
        raise VisualizeError(
            f"--layer {layer}: the model has {num_enc} encoder and {num_dec} decoder layers; "
            f"choose a layer in 0..{num_layers - 1}"
        )
    if head is not None and not 0 <= head < num_heads:
        raise VisualizeError(f"--head {head}: the model has {num_heads} heads; choose a head in 0..{num_heads - 1}")


def attention_figsize(num_panels: int, num_queries: int, num_keys: int) -> tuple[float, float]:
    """Inches: a grid of HEAD_COLUMNS panels a row, each growing with the tokens on its axes (a lone head: larger)."""
    cols = min(num_panels, HEAD_COLUMNS)
    rows = math.ceil(num_panels / cols)
    per_token, smallest = (0.17, 2.6) if num_panels > 1 else (0.3, 4.0)
    panel_w = min(max(smallest, 0.9 + per_token * num_keys), 12.0)
    panel_h = min(max(smallest, 0.9 + per_token * num_queries), 12.0)
    return round(cols * panel_w + 1.6, 1), round(rows * panel_h + 0.9, 1)


def _draw_heads(title: str, w_NTS: np.ndarray, heads: list[int], queries: list[str], keys: list[str], axes_names):
    """A figure with one image per head (weights in [0, 1]) and the pieces on the axes; and the arrays drawn."""
    fig = new_figure(attention_figsize(len(heads), len(queries), len(keys)))
    cols = min(len(heads), HEAD_COLUMNS)
    rows = math.ceil(len(heads) / cols)
    axes = fig.subplots(rows, cols, squeeze=False)
    drawn, image = [], None
    fontsize = 8 if max(len(queries), len(keys)) <= 30 else 6
    for n, ax in enumerate(axes.flat):
        if n >= len(heads):
            ax.set_axis_off()
            continue
        image = ax.imshow(w_NTS[heads[n]], vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest")
        drawn.append(np.asarray(image.get_array()))
        ax.set_title(f"head {heads[n]}", fontsize=10)
        ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=fontsize)
        ax.set_yticks(range(len(queries)), queries, fontsize=fontsize)
        ax.set_xlabel(f"{axes_names[1]} (keys)", fontsize=9)
        if n % cols == 0:
            ax.set_ylabel(f"{axes_names[0]} (queries)", fontsize=9)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    fig.suptitle(title)
    return fig, np.stack(drawn)


def plot_attention(
    maps: AttentionMaps, output_dir: str | Path, *, layer: int | None = None, head: int | None = None
) -> dict[Path, np.ndarray]:
    """One PNG per (kind, layer): a grid of heads, or only `head`. Returns each file with the arrays drawn."""
    w = maps.weights
    check_selection(len(w["encoder"]), len(w["decoder"]), (w["encoder"] or w["decoder"])[0].shape[0], layer, head)
    out = {}
    for kind, (_, _, title, q_name, k_name) in ATTENTION_KINDS.items():
        queries = maps.src_pieces if q_name == "source" else maps.tgt_pieces
        keys = maps.src_pieces if k_name == "source" else maps.tgt_pieces
        for i, w_NTS in enumerate(maps.weights[kind]):
            if layer is not None and i != layer:
                continue
            heads = list(range(w_NTS.shape[0])) if head is None else [head]
            name = f"attention_{kind}_layer{i}" + ("" if head is None else f"_head{head}") + ".png"
            fig, drawn = _draw_heads(f"{title}, layer {i}", w_NTS, heads, queries, keys, (q_name, k_name))
            out[save(fig, Path(output_dir) / name)] = drawn
    return out


def attention(
    workdir: str | Path,
    source: str,
    target: str,
    output_dir: str | Path,
    *,
    config: Any = None,
    checkpoint: str | int = "latest",
    layer: int | None = None,
    head: int | None = None,
) -> AttentionResult:
    """Restores a checkpoint, computes the attention weights of (source, target) and draws them."""
    for name, text in (("--source", source), ("--target", target)):  # before the (slow) restore
        if not text.strip():
            raise VisualizeError(f"{name} is empty; give a sentence")
    _, model, tokenizer, step = load_model(workdir, config, checkpoint)
    src_ids, tgt_in_ids = encode_pair(tokenizer, source, target)
    maps = AttentionMaps(
        tokenizer.source_pieces(src_ids),  # ▁ marks a word start; <0x..> are byte-fallback pieces
        tokenizer.target_pieces(tgt_in_ids),
        attention_weights(model, src_ids, tgt_in_ids),
    )
    drawn = plot_attention(maps, output_dir, layer=layer, head=head)
    return AttentionResult(list(drawn), maps, drawn, step)
