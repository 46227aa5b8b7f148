"""`train.py --plan TOPOLOGY`: compile training's step and validation's decoding for a TPU or GPU slice this host
does not have, and report memory per chip, fit, collectives and estimated times. Nothing runs.

accelerators.py: the chips, the slice names users type, the devices the real compilers accept on a CPU host, and
what a program compiled for them needs per chip (it imports neither training nor decoding); report.py: `run`, the
plans, the searches over batch and mesh, the table. Needs `pip install -r requirements-aot.txt`.
"""
