"""Pictures of a model and its training; the command line is `python -m transformer_jax.visualize`.

Each function writes PNGs under an output directory and returns their paths with the arrays it drew. attention.py
draws a checkpoint's attention weights, figures.py the pictures that need no checkpoint.
"""

from transformer_jax.visualize.attention import attention
from transformer_jax.visualize.figures import curves, positional, schedule

__all__ = ["attention", "curves", "positional", "schedule"]
