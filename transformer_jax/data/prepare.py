"""Fetch a config's data, train its tokenizer and tokenize the training split into its store, once, before a run.

python -m transformer_jax.data.prepare --config configs/wmt14_ende.py:size=base --workdir runs/base [--verify]

Downloads (or prepares, for TFDS) the train, validation and test splits, writes WORKDIR/spm.model (or uses
data.tokenizer_model) and builds the store of the tokenized training split next to it (`store`; none with
data.store=False; with data.corpora, one per corpus; with data.directions, one per language of the multi-way
folder). Use it on a machine with internet before training on one without, and before every multi-host run:
train.py refuses to build a tokenizer or store on each host. A matching store is reused; `--verify` rereads it and
checks every file's SHA-256. Prints one JSON line: sentences per split, the tokenizer's path and size, and the
store's path and counts.
"""

from __future__ import annotations

import json
import os

from absl import flags
from ml_collections import config_flags

from transformer_jax import cli
from transformer_jax.data import languages, pipeline, sources, store
from transformer_jax.data.tokenizer import model_tokenizer

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (the one the run will use).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Training directory that will hold spm.model.")
_VERIFY = flags.DEFINE_bool("verify", False, "Reread the whole store and check the SHA-256 of every file.")


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (transformer_jax.cli.run refuses them)
    config, data = _CONFIG.value, _CONFIG.value.data
    cli.validate(config)  # before any download, as train.py does
    if data.directions:
        print(json.dumps(_prepare_multilingual(languages.expand_config(config))))
        return
    splits = {split: len(sources.open_split(data, split)) for split in (data.valid_split, data.test_split)}
    mix = sources.corpora(data)
    trains = [sources.open_corpus(data, c) for c in mix] or [sources.open_stream(data, data.train_split)]
    for train in trains:
        len(train)  # text: both sides' lines counted, so mismatched files fail before the tokenizer is trained
    tokenizer = model_tokenizer(config, _WORKDIR.value)
    report = {"sentences": splits, "tokenizer": str(tokenizer.path), "pieces": tokenizer.vocab_size}
    names = [f"{data.train_split}:{c.name}" for c in mix] or [data.train_split]
    if data.store:
        _, paths = store.open_train_examples(data, tokenizer, build_if_missing=True, num_threads=os.cpu_count())
        manifests = [store.verify(path) if _VERIFY.value else store.read_manifest(path) for path in paths]
        splits.update({name: m["counts"]["pairs"] for name, m in zip(names, manifests, strict=True)})
        if mix:  # one store per corpus
            report["stores"] = {str(p): m["counts"] for p, m in zip(paths, manifests, strict=True)}
        else:
            report.update(store=str(paths[0]), store_counts=manifests[0]["counts"])
        report["verified"] = _VERIFY.value
    else:
        for name, train in zip(names, trains, strict=True):
            splits[name] = sum(len(pairs) for _, pairs in train.chunks(store.CHUNK_PAIRS))
    print(json.dumps(report))


def _prepare_multilingual(config) -> dict:
    """A multi-way folder: every split's language files checked, the tokenizer trained, one store per language."""
    data, workdir = config.data, _WORKDIR.value
    langs = languages.languages(data)
    splits = {}
    for split in (data.train_split, data.valid_split, data.test_split):
        files = languages.multiway_sides(data.text_dir, split, langs)  # one line count for all, or a DataError
        splits[split] = sources.count_lines(next(iter(files.values())))
    tokenizer = model_tokenizer(config, workdir)
    report = {"directions": list(data.directions), "lines": splits, "tokenizer": str(tokenizer.path)}
    report.update(pieces=tokenizer.pieces, languages=len(langs))
    if data.store:
        pipeline.multilingual_examples(config, tokenizer, build_if_missing=True, num_threads=os.cpu_count())
        paths = [store.side_path(data, tokenizer, lang) for lang in langs]
        check = store.verify if _VERIFY.value else store.read_manifest
        report["stores"] = {str(p): check(p, store.SIDE_ARRAYS)["counts"] for p in paths}
        report["verified"] = _VERIFY.value
    return report


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "workdir"])
    cli.run(main, "python -m transformer_jax.data.prepare")
