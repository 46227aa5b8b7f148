"""`train.py --plan TOPOLOGY`: compile training's step and validation's decoding for a TPU or GPU slice this host
does not have, and report memory per chip, fit, collectives and estimated times. Nothing runs.

accelerators.py (chips and slice names; the devices the real compilers accept on a CPU host), train_step.py (the
train step, the batch and mesh searches, and the one private jax API the plan uses), report.py (`run`: the train
step's plan with validation's decoding compiled beside it; the table and the one-line refusals). Needs
`pip install -r requirements-aot.txt`.
This package imports nothing here, so that accelerators.py loads without training or decoding.
"""
