"""WMT14 English->German, the setup of "Attention Is All You Need" (Vaswani et al., 2017).

--config configs/wmt14_ende.py:size=base (default) | size=big | size=tiny (CPU smoke test)
"""

from __future__ import annotations

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = common.parse_arg(arg, size="base")
    size = args["size"]
    config = common.base_config(size)
    config.model.vocab_size = 37000  # shared source-target BPE vocabulary (paper 5.1)
    config.data.source = "tfds"
    config.data.tfds_name = "wmt14_translate/de-en"
    config.data.src_lang = "en"
    config.data.tgt_lang = "de"
    config.data.valid_split = "validation"  # newstest2013
    config.data.test_split = "test"  # newstest2014 (TFDS: the 3,003-line full set)
    config.data.batching = "bucket"
    config.data.tokens_per_batch = 25000  # about 25,000 source (+25,000 target) tokens per step (paper 5.1)
    config.data.max_len = 256
    config.train.num_steps = 300_000 if size == "big" else 100_000  # paper 5.2
    config.eval.average_last = 20 if size == "big" else 5  # paper 6.1
    # Paper 6.1: checkpoints every 10 minutes; at 0.4 s/step (base) and 1.0 s/step (big) on 8 P100s.
    config.ckpt.every_steps = 600 if size == "big" else 1500
    if size == "tiny":
        config.model.vocab_size = 1000
        config.data.tokens_per_batch = 2048
        config.train.num_steps = 20
    return config.lock()
