"""The pictures that need no checkpoint (the positional encoding, a config's learning-rate schedule, runs' curves)
and what every picture shares: figures of an exact pixel size.

Figures are `matplotlib.figure.Figure`s (Agg canvas, no pyplot state) with an explicit size and DPI and no tight
bounding box, so a PNG is exactly figsize * DPI pixels. Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

from transformer_jax.errors import VisualizeError
from transformer_jax.model.layers import sinusoidal_encoding
from transformer_jax.training.metrics import read_metrics
from transformer_jax.training.step import learning_rate_schedule

DPI = 100  # pixels per inch of every PNG
FIGSIZE = (8.0, 5.0)  # inches: every one-panel picture
CURVE_PANEL = (5.0, 3.8)  # inches per metrics key
CURVE_COLUMNS = 3  # panels per row
DEFAULT_CURVE_KEYS = ("loss", "valid_loss", "valid_perplexity", "valid_bleu")


def new_figure(figsize: tuple[float, float]) -> Figure:
    return Figure(figsize=figsize, dpi=DPI, layout="constrained")


def save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    return path


@dataclasses.dataclass
class PositionalResult:
    paths: list[Path]
    pe_PD: np.ndarray  # the sinusoidal encoding the model adds, positions 0 .. max_len - 1
    offsets: np.ndarray  # k = 0, 1, ...
    dots: dict[int, np.ndarray]  # pos -> PE(pos) . PE(pos + k) for each offset


def sinusoid_table(length: int, d_model: int) -> np.ndarray:
    """PE [P, D] of positions 0..length-1: the model's own sinusoidal_encoding, in the paper's interleaved layout
    (features 2i, 2i+1 are sin, cos of pos ω_i; model.sinusoid_layout=concatenated permutes the same columns)."""
    return np.asarray(sinusoidal_encoding(jnp.arange(length)[None], d_model, "interleaved")[0])


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
    pe_PD = sinusoid_table(max_len, d_model)
    offsets = np.arange(max_len - max(positions))
    dots = {p: pe_PD[p + offsets] @ pe_PD[p] for p in positions}

    fig = new_figure(FIGSIZE)
    ax = fig.subplots()
    image = ax.imshow(pe_PD, aspect="auto", cmap="RdBu", vmin=-1.0, vmax=1.0, interpolation="nearest")
    ax.set_xlabel("dimension (even: sin, odd: cos)")
    ax.set_ylabel("position")
    ax.set_title(f"sinusoidal positional encoding, d_model={d_model}")
    fig.colorbar(image, ax=ax, label="PE(pos, dim)")
    pe_path = save(fig, Path(output_dir) / "positional_encoding.png")

    fig = new_figure(FIGSIZE)
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


@dataclasses.dataclass
class ScheduleResult:
    path: Path
    steps: np.ndarray  # 1 .. num_steps: the update number, as metrics.jsonl logs learning_rate
    learning_rates: np.ndarray  # the rate of that update: schedule(step - 1)


def schedule(config: Any, output_dir: str | Path, num_steps: int | None = None) -> ScheduleResult:
    """The learning rate of every update of a config's training (training.step.learning_rate_schedule)."""
    num_steps = config.train.num_steps if num_steps is None else num_steps
    if num_steps < 1:
        raise VisualizeError(f"--num_steps must be >= 1, got {num_steps}")
    steps = np.arange(1, num_steps + 1)
    rates = np.asarray(learning_rate_schedule(config.opt, num_steps)(jnp.asarray(steps - 1)))
    opt = config.opt

    fig = new_figure(FIGSIZE)
    ax = fig.subplots()
    ax.plot(steps, rates, lw=1.5)
    peak = int(np.argmax(rates))
    ax.plot(steps[peak], rates[peak], "o", color="C3", label=f"peak {rates[peak]:.3g} at step {steps[peak]}")
    if 0 < opt.warmup_steps <= num_steps:
        ax.axvline(opt.warmup_steps, color="0.5", ls=":", label=f"warmup_steps = {opt.warmup_steps}")
    ax.set_xlabel("step (update number)")
    ax.set_ylabel("learning rate")
    ax.set_title(f"opt.schedule = {opt.schedule}, opt.learning_rate = {opt.learning_rate:.3g}, {num_steps} steps")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.grid(alpha=0.3)
    ax.legend()
    return ScheduleResult(save(fig, Path(output_dir) / "schedule.png"), steps, rates)


@dataclasses.dataclass
class CurvesResult:
    path: Path
    keys: list[str]
    data: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]  # key -> run label -> (steps, values)


def _metrics_path(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise VisualizeError(f"--metrics: no such file {path}")
    return path


def _run_labels(paths: list[Path]) -> list[str]:
    """The run directory's name, or its whole path where two runs share a name."""
    names = [p.resolve().parent.name for p in paths]
    if len(set(names)) < len(names):
        return [str(p.parent) for p in paths]
    return names


def curves_figsize(num_keys: int) -> tuple[float, float]:
    cols = min(num_keys, CURVE_COLUMNS)
    return cols * CURVE_PANEL[0], math.ceil(num_keys / cols) * CURVE_PANEL[1]


def curves(
    metrics_files: Sequence[str | Path], output_dir: str | Path, keys: Sequence[str] | None = None
) -> CurvesResult:
    """Training and validation curves: one panel per key, one line per run (records with 'step' and the key)."""
    if not metrics_files:
        raise VisualizeError("--metrics: give at least one metrics.jsonl")
    paths = [_metrics_path(p) for p in metrics_files]
    runs = {}
    for label, path in zip(_run_labels(paths), paths, strict=True):
        try:
            records = read_metrics(path)
        except ValueError as e:
            raise VisualizeError(f"--metrics: {e}") from e
        if not records:
            raise VisualizeError(f"--metrics: {path} has no records")
        runs[label] = records
    available = sorted({k for records in runs.values() for r in records for k in r if k != "step"})
    if keys is None:
        keys = [k for k in DEFAULT_CURVE_KEYS if k in available] or available[:1]
    unknown = [k for k in keys if k not in available]
    if unknown or not keys:
        raise VisualizeError(
            f"--keys: unknown metrics key(s) {unknown} in {[str(p) for p in paths]}; available: {available}"
        )

    data: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    for key in keys:
        data[key] = {}
        for label, records in runs.items():
            # A resumed run logs some steps twice; the later record wins.
            by_step = {r["step"]: r[key] for r in records if key in r and isinstance(r[key], int | float)}
            if by_step:
                steps = np.array(sorted(by_step))
                data[key][label] = (steps, np.array([by_step[s] for s in steps], np.float64))

    fig = new_figure(curves_figsize(len(keys)))
    cols = min(len(keys), CURVE_COLUMNS)
    axes = fig.subplots(math.ceil(len(keys) / cols), cols, squeeze=False)
    for ax in axes.flat[len(keys) :]:
        ax.set_axis_off()
    for ax, key in zip(axes.flat, keys, strict=False):
        for n, (label, (steps, values)) in enumerate(data[key].items()):
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, ms=3, color=f"C{n % 10}", label=label)
        ax.set_title(key)
        ax.set_xlabel("step")
        if "perplexity" in key:
            ax.set_yscale("log")  # from the vocabulary size down to single digits
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return CurvesResult(save(fig, Path(output_dir) / "curves.png"), list(keys), data)
