"""WMT14 English->German, the setup of "Attention Is All You Need" (Vaswani et al., 2017).

--config configs/wmt14_ende.py:size=base (default) | size=big | size=tiny (CPU smoke test)

`paper_config` holds what the paper's two WMT14 tasks share; configs/wmt14_enfr.py builds English->French from it.
"""

from __future__ import annotations

import ml_collections

from configs import common

# The paper's BLEU on newstest2014 (Table 2; tokenized BLEU, see README "Reproducing the paper").
PAPER_BLEU = {"base": 27.3, "big": 28.4}


def paper_config(
    size: str, *, tfds_name: str, src_lang: str, tgt_lang: str, vocab_size: int
) -> ml_collections.ConfigDict:
    """The paper's WMT14 setup for one language pair (unlocked); sizes, schedule and decoding as in its sections."""
    config = common.base_config(size)
    config.model.vocab_size = vocab_size
    config.data.source = "tfds"
    config.data.tfds_name = tfds_name
    config.data.src_lang = src_lang
    config.data.tgt_lang = tgt_lang
    config.data.valid_split = "validation"  # newstest2013
    config.data.test_split = "test"  # newstest2014 (TFDS: the full set)
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
    return config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = common.parse_arg(arg, size="base")
    # 37000: the shared source-target BPE vocabulary (paper 5.1).
    config = paper_config(
        args["size"], tfds_name="wmt14_translate/de-en", src_lang="en", tgt_lang="de", vocab_size=37000
    )
    return config.lock()
