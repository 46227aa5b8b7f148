"""See the mathematics run: one sentence carried through every equation of a trained model, as an HTML page.

The command line is `python -m transformer_jax.explain`. capture.py runs the model's own modules and keeps their
intermediates, page.py measures the figures the page states and writes the page, text.py holds its words.
"""
