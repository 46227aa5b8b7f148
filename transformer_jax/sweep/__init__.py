"""Sweeps: a config file's get_sweep(arg) as trained, decoded and compared runs (`python -m transformer_jax.sweep`).

runner.py: the variants, seeds and runs, training and decoding one run, its code version; launch.py: where runs
train (this process, or submitit jobs on this machine or SLURM); results.py: the results files and statistics.
"""
