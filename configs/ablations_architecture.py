"""Architecture ablations beyond the paper: norms, activations, positional encodings and attention kinds.

--config configs/ablations_architecture.py:scale=small,steps=N   (Multi30k on a CPU; scale=tiny for seconds)
"""

from __future__ import annotations

import ml_collections

from configs import ablations_table3


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    return ablations_table3.get_config(arg)


def get_sweep(arg: str | None = None) -> list[dict]:
    return [
        {"name": "post_ln"},
        {"name": "pre_ln", "model.norm_position": "pre"},
        {"name": "rmsnorm", "model.norm": "rmsnorm"},
        {"name": "gelu", "model.activation": "gelu"},
        {"name": "swiglu", "model.activation": "swiglu"},
        {"name": "learned_pe", "model.positional": "learned"},
        {"name": "no_pe", "model.positional": "none"},
        {"name": "local_attention", "attention.window": 8},
        {"name": "linear_attention", "attention.impl": "linear"},
    ]
