"""Translating a corpus, resumably: `python -m transformer_jax.translate_corpus --workdir W --input FILE
--output OUT` (see __main__.py). The library: run.job_of, run.translate_corpus; the chunk store: chunks.py."""
