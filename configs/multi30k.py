"""Multi30k English->German (or German->English) on a CPU: the project's small real-data result.

--config configs/multi30k.py[:size=small,direction=en-de]   (direction=de-en reverses the languages)
"""

from __future__ import annotations

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = common.parse_arg(arg, size="small", direction="en-de")
    if args["direction"] not in ("en-de", "de-en"):
        raise ValueError(f"direction must be en-de or de-en, got {args['direction']!r}")
    config = common.base_config(args["size"])
    config.model.vocab_size = 8000  # joint SentencePiece vocabulary; Multi30k has ~10k distinct words per side
    config.model.max_len = 128  # Multi30k sentences are short
    config.data.source = "multi30k"  # the copy under $TRANSFORMER_JAX_DATA if present, else downloaded and checksummed
    config.data.src_lang, config.data.tgt_lang = args["direction"].split("-")
    config.data.batching = "pack"
    config.data.batch_size = 32  # rows of max_len tokens per side
    config.data.max_len = 64  # a row holds several sentences; the few longer ones are filtered
    config.data.tokenizer_sample_sentences = 58000  # all of train, both sides
    # Many small steps suit a small corpus trained within two hours on a 2-core CPU.
    config.opt.warmup_steps = 800
    config.opt.learning_rate = 1e-3 * config.opt.warmup_steps**0.5  # paper schedule with a peak rate of 1e-3
    config.train.num_steps = 4400  # ends within the two hours on a 2-core CPU (docs/results.md)
    config.train.log_every = 50
    config.train.eval_every = 500
    config.train.bleu_every = 2000
    config.ckpt.every_steps = 200
    config.ckpt.keep = 10
    config.eval.average_last = 5  # the last 5 checkpoints: the final 800 steps
    if args["size"] == "tiny":
        config.model.vocab_size = 1000
        config.train.num_steps = 20
    return config.lock()
