"""The sinusoidal positional encoding (paper 3.5) as the model computes it, and why it encodes relative position.

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from transformer_jax.errors import VisualizeError
from transformer_jax.model.layers import sinusoidal_encoding
from transformer_jax.visualize.figures import new_figure, save

PE_FIGSIZE = (8.0, 5.0)  # inches: the PE matrix
DOTS_FIGSIZE = (8.0, 5.0)  # inches: PE(pos) . PE(pos + k) against k


@dataclasses.dataclass
class PositionalResult:
    paths: list[Path]
    pe_PD: np.ndarray  # the sinusoidal encoding the model adds, positions 0 .. max_len - 1
    offsets: np.ndarray  # k = 0, 1, ...
    dots: dict[int, np.ndarray]  # pos -> PE(pos) . PE(pos + k) for each offset


def positional(
    d_model: int, max_len: int, output_dir: str | Path, positions: Sequence[int] | None = None
) -> PositionalResult:
    """The sinusoidal PE matrix (model.layers.sinusoidal_encoding) and PE(pos) . PE(pos + k) against k.

    sin(a)sin(b) + cos(a)cos(b) = cos(a - b), so PE(pos) . PE(pos + k) = sum_i cos(k w_i): a function of k alone.
    """
    if d_model < 2 or d_model % 2:
        raise VisualizeError(f"--d_model must be even and >= 2, got {d_model}")
    if max_len < 2:
        raise VisualizeError(f"--max_len must be >= 2, got {max_len}")
    if positions is None:
        positions = sorted({0, max_len // 8, max_len // 4, max_len // 2})
    positions = [int(p) for p in positions]
    if not positions or any(not 0 <= p < max_len - 1 for p in positions):
        raise VisualizeError(f"--positions must be in 0..{max_len - 2} (below --max_len - 1), got {positions}")
    pe_PD = np.asarray(sinusoidal_encoding(jnp.arange(max_len)[None], d_model, "interleaved")[0])  # the paper's
    offsets = np.arange(max_len - max(positions))
    dots = {p: pe_PD[p + offsets] @ pe_PD[p] for p in positions}

    fig = new_figure(PE_FIGSIZE)
    ax = fig.subplots()
    image = ax.imshow(pe_PD, aspect="auto", cmap="RdBu", vmin=-1.0, vmax=1.0, interpolation="nearest")
    ax.set_xlabel("dimension (even: sin, odd: cos)")
    ax.set_ylabel("position")
    ax.set_title(f"sinusoidal positional encoding, d_model={d_model}")
    fig.colorbar(image, ax=ax, label="PE(pos, dim)")
    pe_path = save(fig, Path(output_dir) / "positional_encoding.png")

    fig = new_figure(DOTS_FIGSIZE)
    ax = fig.subplots()
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, d_model, 2) / d_model)
    ax.plot(offsets, np.cos(np.outer(offsets, inv_freq)).sum(-1), color="0.75", lw=6, label="Σ_i cos(k ω_i)")
    styles = ["-", "--", ":", "-."]
    for n, p in enumerate(positions):
        ax.plot(offsets, dots[p], ls=styles[n % len(styles)], lw=1.5, label=f"pos = {p}")
    ax.set_xlabel("offset k")
    ax.set_ylabel("PE(pos) · PE(pos + k)")
    ax.set_title("the dot product depends on the offset k only")
    ax.grid(alpha=0.3)
    ax.legend()
    dots_path = save(fig, Path(output_dir) / "positional_dot_products.png")
    return PositionalResult([pe_path, dots_path], pe_PD, offsets, dots)
