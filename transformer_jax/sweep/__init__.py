"""Sweeps: a config file's get_sweep(arg) as trained, decoded and compared runs; the command line is
`python -m transformer_jax.sweep` (its --help says what a sweep does).

runner.py: the variants and seeds of a sweep, their directories, training and decoding one run, its code version;
launch.py: where runs train (this process, or submitit jobs on this machine or SLURM); results.py: the split the
results report, the runs' metrics aggregated over seeds with the paired bootstrap of each variant against the first,
into results.csv/md/png.
"""
