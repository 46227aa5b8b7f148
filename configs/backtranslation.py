"""Back-translation in a simulated low-resource setting (docs/results.md): en-de from 10,000 Multi30k pairs.

--config configs/backtranslation.py:data=DIR[,steps=N,direction=en-de]

DIR holds the files that docs/results.md's commands make from Multi30k train: `real.en`/`real.de` (its first 10,000
pairs), `mono.de` (the German of the other 19,000) and the English back-translations of `mono.de` by a de-en model
trained on `real.*` (`bt_beam.en`, beam 4; `bt_sampled.en`, sampling). `direction=de-en` is that reverse model.
The sweep's four arms (get_sweep): the 10k pairs alone; with the tagged beam or sampled back-translations (Sennrich
et al. 2016; Edunov et al. 2018; the `<BT>` tag of Caswell et al. 2019); all 29,000 real pairs.
"""

from __future__ import annotations

import ml_collections

from configs import ablations_table3, common

TAG = "<BT>"
DEFAULTS = dict(data="", steps="1600", direction="en-de")  # the config-file argument's keys and defaults


def _files(data: str, src: str, tgt: str, stem_src: str, stem_tgt: str | None = None) -> str:
    """The `where` of a data.corpora record of kind files: SRC_FILE+TGT_FILE."""
    return f"{data}/{stem_src}.{src}+{data}/{stem_tgt or stem_src}.{tgt}"


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = common.parse_arg(arg, **DEFAULTS)
    if not args["data"]:
        raise ValueError("configs/backtranslation.py needs data=DIR, the directory of docs/results.md's split files")
    # The mini model and steps of the seeded Table 3 sweep (d_model 128, ~1k tokens a step): each run fits minutes.
    config = ablations_table3.get_config(f"scale=mini,steps={args['steps']}")
    src, tgt = args["direction"].split("-")
    with config.unlocked():
        config.data.src_lang, config.data.tgt_lang = src, tgt
        # 10k real pairs: the run's own tokenizer, smaller than Multi30k's 8,000 (one vocabulary for every arm).
        config.model.vocab_size = 4000
        config.data.corpora = (("real", "files", _files(args["data"], src, tgt, "real"), 1, ""),)
    return config.lock()


def get_sweep(arg: str | None = None) -> list[dict]:
    args = common.parse_arg(arg, **DEFAULTS)
    if args["direction"] != "en-de":
        raise ValueError("the back-translation arms are en-de (mono.de is their monolingual side); drop direction=")
    data = args["data"]
    # data.corpora records (name, kind, where, weight, tag). Weights are the corpora's sizes: every pair, real or
    # synthetic, is drawn equally often.
    real = ("real", "files", _files(data, "en", "de", "real"), 10000, "")

    def bt(stem: str) -> tuple:  # the tagged back-translations STEM.en of mono.de
        return ("bt", "files", _files(data, "en", "de", stem, "mono"), 19000, TAG)

    return [
        {"name": "real10k", "data.corpora": (real,)},
        {"name": "bt_beam", "data.corpora": (real, bt("bt_beam"))},
        {"name": "bt_sampled", "data.corpora": (real, bt("bt_sampled"))},
        {"name": "real29k", "data.corpora": ()},  # data.source: all of Multi30k train
    ]
