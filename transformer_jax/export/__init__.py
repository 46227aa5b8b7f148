"""Exporting a trained model to other inference engines; `python -m transformer_jax.export` is the command line.

ctranslate2.py: a CTranslate2 model directory (model.bin, shared vocabulary, the SentencePiece model) and a
translate function whose length limits are ours, so that the engine's greedy outputs equal evaluate.py's.
"""
