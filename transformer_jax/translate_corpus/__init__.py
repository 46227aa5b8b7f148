"""Translating a corpus, resumably: `python -m transformer_jax.translate_corpus --workdir W --input FILE
--output OUT` (see __main__.py). The library, with its chunk store: run.py."""
