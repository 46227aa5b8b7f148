"""Pictures of a model and its training; the command line is `python -m transformer_jax.visualize`.

Each function writes PNGs under an output directory and returns their paths with the arrays it drew.
"""

from transformer_jax.errors import VisualizeError
from transformer_jax.visualize.attention import (
    ATTENTION_KINDS,
    AttentionMaps,
    AttentionResult,
    attention,
    attention_figsize,
    attention_weights,
    encode_pair,
    load_model,
    plot_attention,
)
from transformer_jax.visualize.figures import DPI
from transformer_jax.visualize.positional import DOTS_FIGSIZE, PE_FIGSIZE, PositionalResult, positional
from transformer_jax.visualize.training import (
    SCHEDULE_FIGSIZE,
    CurvesResult,
    ScheduleResult,
    curves,
    curves_figsize,
    schedule,
)

__all__ = [
    "ATTENTION_KINDS",
    "DOTS_FIGSIZE",
    "DPI",
    "PE_FIGSIZE",
    "SCHEDULE_FIGSIZE",
    "AttentionMaps",
    "AttentionResult",
    "CurvesResult",
    "PositionalResult",
    "ScheduleResult",
    "VisualizeError",
    "attention",
    "attention_figsize",
    "attention_weights",
    "curves",
    "curves_figsize",
    "encode_pair",
    "load_model",
    "plot_attention",
    "positional",
    "schedule",
]
