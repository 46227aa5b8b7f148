"""Fine-tuning on Multi30k from a trained run (continued training, e.g. after a general-domain corpus).

--config configs/finetune.py:init_from=WORKDIR[,direction=en-de]

The source workdir (train.init_from) gives the model's parameters, its architecture and its tokenizer; this file
sets what is the fine-tuning run's own: the Multi30k data and batches, regularisation and a schedule for
continued training. The step, optimizer state, schedule and data order start fresh (training/init_from.py).
"""

from __future__ import annotations

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = common.parse_arg(arg, init_from="", direction="en-de")
    if not args["init_from"]:
        raise ValueError("name the trained run to start from: configs/finetune.py:init_from=WORKDIR")
    if args["direction"] not in ("en-de", "de-en"):
        raise ValueError(f"direction must be en-de or de-en, got {args['direction']!r}")
    # The model keys below are placeholders: every architecture key is replaced by the source's.
    config = common.base_config("small")
    config.train.init_from = args["init_from"]
    config.train.init_step = "latest"
    config.data.source = "multi30k"  # the copy under $TRANSFORMER_JAX_DATA if present, else downloaded and checksummed
    config.data.src_lang, config.data.tgt_lang = args["direction"].split("-")
    config.data.batching = "pack"
    config.data.batch_size = 32  # rows of max_len tokens per side, as configs/multi30k.py
    config.data.max_len = 64
    config.model.dropout_rate = 0.1  # a small in-domain corpus: keep the regularisation of training from scratch
    # Continued training: the parameters are trained already, so a short warmup (the fresh Adam moments need a few
    # hundred steps) to a peak half that of configs/multi30k.py's paper schedule (1e-3), decaying to 0 by the end:
    # a high rate would undo what the source learned before the in-domain data has been seen.
    config.opt.schedule = "cosine"
    config.opt.warmup_steps = 200
    config.opt.learning_rate = 5e-4  # the peak rate (cosine: not a multiplier)
    config.train.num_steps = 2000  # about 2.2 epochs of Multi30k at 32 rows x 64 tokens
    config.train.log_every = 50
    config.train.eval_every = 250
    # Keep the checkpoints that translate validation best, not the last ones: continued training on a small corpus
    # may peak before the schedule ends. 500 of val2016's 1,014 sentences make the ranking steadier than 200.
    config.train.select_metric = "valid_bleu"
    config.train.bleu_sentences = 500
    config.ckpt.keep_best = 3
    config.train.early_stop_patience = 4  # 1,000 steps without a better validation BLEU
    config.ckpt.every_steps = 200
    config.ckpt.keep = 10
    config.eval.average_last = 5  # the last 5 checkpoints: the final 800 steps
    return config.lock()
