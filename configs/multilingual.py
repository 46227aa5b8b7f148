"""One model for many directions of the 4-way Multi30k (en, de, fr, cs; line i the same caption in every language).

--config configs/multilingual.py[:size=small,directions=all,lang_token=target,temperature=5]
    directions: all (the 12 ordered pairs), en-centric (to and from English), or SRC-TGT names joined by '+'
    (en-de+de-en); lang_token: source, target or source_and_target (data/languages.py).

The corpus is read from a multi-way folder (data.source=text): data.text_dir defaults to $TRANSFORMER_JAX_DATA/multi30k
and is set with --config.data.text_dir elsewhere; the Multi30k download (data.source=multi30k) fetches English and
German only.
"""

from __future__ import annotations

import os

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = common.parse_arg(arg, size="small", directions="all", lang_token="target", temperature="5")
    config = common.base_config(args["size"])
    config.model.vocab_size = 8000  # joint BPE pieces plus one token per language
    config.model.max_len = 128
    config.model.lang_token = args["lang_token"]
    config.data.source = "text"
    data_root = os.environ.get("TRANSFORMER_JAX_DATA", "")
    config.data.text_dir = os.path.join(data_root, "multi30k") if data_root else ""
    config.data.directions = tuple(args["directions"].split("+"))
    config.data.temperature = float(args["temperature"])
    config.data.tokenizer_type = "bpe"  # the NLLB export writes BPE tokenizers only
    config.data.batching = "pack"
    config.data.batch_size = 32
    config.data.max_len = 64
    config.data.tokenizer_sample_sentences = 116000  # every training line of the four languages
    config.opt.warmup_steps = 800
    config.opt.learning_rate = 1e-3 * config.opt.warmup_steps**0.5
    config.train.num_steps = 6000
    config.train.log_every = 50
    config.train.eval_every = 500
    config.train.bleu_every = 2000
    config.train.bleu_sentences = 100  # per direction: 12 directions translate 1,200 sentences
    config.ckpt.every_steps = 200
    config.ckpt.keep = 10
    config.eval.average_last = 5
    if args["size"] == "tiny":
        config.model.vocab_size = 500
        config.data.tokenizer_sample_sentences = 4000
        config.train.num_steps = 20
        config.train.bleu_sentences = 8
    return config.lock()
