"""Fine-tuning from a trained run (continued training, e.g. after a general-domain corpus, or a converted model).

--config configs/finetune.py:init_from=WORKDIR[,direction=en-de][,directions=en-cs+cs-en][,lora=RANK]
    [,num_steps=2000][,eval_every=250][,add=cs[+sk]][,init=mean|LANG]
    direction: en-de or de-en of the Multi30k download (a bilingual source); directions: instead, SRC-TGT names
    joined by '+' (or all, LANG-centric) of a multi-way folder, data.text_dir (default $TRANSFORMER_JAX_DATA/multi30k,
    the 4-way en/de/fr/cs Multi30k), for a multilingual or converted source; lora: opt.lora_rank (0 = full
    fine-tuning); eval_every=0: no validation, so keep-best and early stopping are off too (nothing to select on;
    --config.train.eval_every=0 alone is refused while they are on); add: data.add_languages joined by '+', new
    languages the model gets a row and a code for, each starting as train.new_language_init (init: mean of the
    source's language rows, or a language it has), training/add_languages.py.

The source workdir (train.init_from) gives the model's parameters, its architecture and its tokenizer; this file
sets what is the fine-tuning run's own: the data and batches, regularisation and a schedule for continued training.
The step, optimizer state, schedule and data order start fresh (training/init_from.py).
"""

from __future__ import annotations

import os

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = common.parse_arg(
        arg,
        init_from="",
        direction="en-de",
        directions="",
        lora="0",
        num_steps="2000",
        eval_every="250",
        add="",
        init="mean",
    )
    if not args["init_from"]:
        raise ValueError("name the trained run to start from: configs/finetune.py:init_from=WORKDIR")
    if args["direction"] not in ("en-de", "de-en"):
        raise ValueError(f"direction must be en-de or de-en, got {args['direction']!r}")
    # The model keys below are placeholders: every architecture key is replaced by the source's.
    config = common.base_config("small")
    config.train.init_from = args["init_from"]
    config.train.init_step = "latest"
    if args["directions"]:
        config.data.source = "text"  # a multi-way folder of {split}.{lang} files (data/languages.py)
        data_root = os.environ.get("TRANSFORMER_JAX_DATA", "")
        config.data.text_dir = os.path.join(data_root, "multi30k") if data_root else ""
        config.data.directions = tuple(args["directions"].split("+"))
    else:
        config.data.source = "multi30k"  # the copy under $TRANSFORMER_JAX_DATA if present, else downloaded
        config.data.src_lang, config.data.tgt_lang = args["direction"].split("-")
    config.data.batching = "pack"
    config.data.batch_size = 32  # rows of max_len tokens per side, as configs/multi30k.py
    config.data.max_len = 64
    config.model.dropout_rate = 0.1  # a small in-domain corpus: keep the regularisation of training from scratch
    config.data.add_languages = tuple(filter(None, args["add"].split("+")))
    config.train.new_language_init = args["init"]
    config.opt.lora_rank = int(args["lora"])  # adapters on the frozen source (model/lora.py); 0 = every parameter
    # Continued training: the parameters are trained already, so a short warmup (the fresh Adam moments need a few
    # hundred steps, and at most a tenth of the run, which must leave warmup) to a peak half that of
    # configs/multi30k.py's paper schedule (1e-3), decaying to 0 by the end: a high rate would undo what the source
    # learned before the in-domain data has been seen.
    config.train.num_steps = int(args["num_steps"])  # 2000: about 2.2 epochs of Multi30k at 32 rows x 64 tokens
    config.opt.schedule = "cosine"
    config.opt.warmup_steps = min(200, config.train.num_steps // 10)
    config.opt.learning_rate = 5e-4  # the peak rate (cosine: not a multiplier)
    config.train.log_every = 50
    config.train.eval_every = int(args["eval_every"])
    # Keep the checkpoints that translate validation best, not the last ones: continued training on a small corpus
    # may peak before the schedule ends. 500 of val2016's 1,014 sentences make the ranking steadier than 200.
    # Without validation (eval_every=0) there is nothing to rank: the last checkpoints are kept.
    validated = config.train.eval_every > 0
    config.train.select_metric = "valid_bleu"
    config.train.bleu_sentences = 500
    config.ckpt.keep_best = 3 if validated else 0
    config.train.early_stop_patience = 4 if validated else 0  # 4 validations without a better BLEU
    config.ckpt.every_steps = 200
    config.ckpt.keep = 10
    config.eval.average_last = 5  # the last 5 checkpoints: the final 800 steps
    return config.lock()
