"""WMT14 English->French, the paper's second task (Vaswani et al., 2017): 36M sentence pairs.

--config configs/wmt14_enfr.py:size=base (default) | size=big | size=tiny (CPU smoke test)

Everything but the data, the vocabulary and big's dropout is the English->German setup (`wmt14_ende.paper_config`).
The training split is tokenized once into a memory-mapped store (data.store), which at this size is what makes a
restart take seconds: run `python -m transformer_jax.data.prepare` with this config first.
"""

from __future__ import annotations

import ml_collections

from configs import common, wmt14_ende

# The paper's BLEU on newstest2014 (Table 2).
PAPER_BLEU = {"base": 38.1, "big": 41.8}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = common.parse_arg(arg, size="base")
    # 32000: the shared word-piece vocabulary (paper 5.1).
    config = wmt14_ende.paper_config(
        args["size"], tfds_name="wmt14_translate/fr-en", src_lang="en", tgt_lang="fr", vocab_size=32000
    )
    if args["size"] == "big":
        config.model.dropout_rate = 0.1  # paper 6.1: "used dropout rate P_drop = 0.1, instead of 0.3"
    return config.lock()
