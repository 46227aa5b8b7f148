"""Sweeps: a config file's get_sweep(arg) as trained, decoded and compared runs; the command line is
`python -m transformer_jax.sweep` (its --help says what a sweep does).

runner.py: the variants and seeds of a sweep, their directories, training and decoding one run; results.py: the
runs' metrics aggregated over seeds into results.csv/md/png; significance.py: the paired bootstrap of each variant
against the first; splits.py: the split the results report (--split valid|test) and the file and column names it
gives.
"""
