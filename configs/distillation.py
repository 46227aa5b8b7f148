"""Sequence-level knowledge distillation (Kim & Rush 2016; docs/results.md): a `tiny` en-de student trained on a
teacher's translations of Multi30k train against one trained on the references, for equal steps.

--config configs/distillation.py:data=DIR[,steps=N]

DIR holds `train.en` (Multi30k train's English) and `teacher.de` (the teacher's beam-4 translation of it, made with
translate_corpus by docs/results.md's commands). Validation and test are Multi30k's, as always.
"""

from __future__ import annotations

import ml_collections

from configs import ablations_table3, common

DEFAULTS = dict(data="", steps="4000")  # the config-file argument's keys and defaults


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = common.parse_arg(arg, **DEFAULTS)
    if not args["data"]:
        raise ValueError("configs/distillation.py needs data=DIR, the directory of docs/results.md's teacher files")
    # The tiny model (d_model 32, 2+2 layers) and Multi30k's packed 32 x 64-token batches.
    config = ablations_table3.get_config(f"scale=tiny,steps={args['steps']}")
    with config.unlocked():
        config.model.vocab_size = 4000  # each arm trains its own tokenizer on its own training pairs
    return config.lock()


def get_sweep(arg: str | None = None) -> list[dict]:
    data = common.parse_arg(arg, **DEFAULTS)["data"]
    return [
        {"name": "references", "data.corpora": ()},  # data.source: Multi30k train as it is
        # A data.corpora record (name, kind, where, weight, tag): the teacher's translations, untagged.
        {"name": "teacher", "data.corpora": (("teacher", "files", f"{data}/train.en+{data}/teacher.de", 1, ""),)},
    ]
