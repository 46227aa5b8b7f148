"""See the mathematics run: one sentence carried through every equation of a trained model, as an HTML page.

The command line is `python -m transformer_jax.explain`. capture.py runs the model's own modules and keeps their
intermediates, numbers.py measures the figures the page states, page.py writes the page, text.py holds its words.
"""

from transformer_jax.explain.capture import Explanation, Hypothesis, explain
from transformer_jax.explain.page import Figures, figures, render, summary
from transformer_jax.explain.text import LANGUAGES, TEXT

__all__ = ["LANGUAGES", "TEXT", "Explanation", "Figures", "Hypothesis", "explain", "figures", "render", "summary"]
