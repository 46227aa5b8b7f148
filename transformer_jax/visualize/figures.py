"""What every picture shares: the error type, a fixed DPI, and figures of an exact pixel size.

Figures are `matplotlib.figure.Figure`s (Agg canvas, no pyplot state) with an explicit size and DPI and no tight
bounding box, so a PNG is exactly figsize * DPI pixels.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

DPI = 100  # pixels per inch of every PNG


def new_figure(figsize: tuple[float, float]):
    return Figure(figsize=figsize, dpi=DPI, layout="constrained")


def save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    return path
