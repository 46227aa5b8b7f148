"""Data pipeline throughput and padding efficiency on Multi30k train, on one CPU core. Prints JSON lines.

  .venv/bin/python -m benchmarks.data_pipeline [--vocab_size 8000] [--epochs 1] [--modes pack,bucket,pad]

Each mode line times the whole path a training run takes: read the text files, tokenize every pair with
SentencePiece's batch encoder (one thread), length-filter, then batch until one epoch of tokens has come out.
tokens_per_s counts real tokens (source + target, EOS/BOS included; padding excluded) per wall-clock second.
The tokenizer (a joint unigram model) is trained first and not timed.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from absl import flags

from configs import common
from transformer_jax import cli
from transformer_jax.data import batching, pipeline, sources
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.model.layers import SpecialIds

DATA = sources.local_data_dir() or Path("$TRANSFORMER_JAX_DATA")  # the local corpora; unset, it skips

_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 8000, "Pieces of the joint SentencePiece model.")
_EPOCHS = flags.DEFINE_float("epochs", 1.0, "Epochs of tokens each mode batches.")
_MODES = flags.DEFINE_list("modes", ["pack", "bucket", "pad"], "Batching modes to time.")
_SRC_LANG = flags.DEFINE_string("src_lang", "en", "Source language of the Multi30k files.")
_TGT_LANG = flags.DEFINE_string("tgt_lang", "de", "Target language of the Multi30k files.")


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def run_mode(config, tokenizer, mode: str, epochs: float) -> dict:
    config.batching = mode
    start = time.perf_counter()
    it, stats = pipeline.make_train_iterator(config, tokenizer, process_index=0, process_count=1, num_threads=1)
    setup_s = time.perf_counter() - start
    target = epochs * (stats["src_tokens"] + stats["tgt_tokens"])
    batches, real = [], 0
    while real < target:
        batch = next(it)
        batches.append(batch)
        real += int((batch["src_segment_ids"] > 0).sum() + (batch["tgt_segment_ids"] > 0).sum())
    total_s = time.perf_counter() - start
    eff = batching.padding_efficiency(batches)
    slots = sum(b["src_segment_ids"].size + b["tgt_segment_ids"].size for b in batches)
    shapes = sorted({(b["src_tokens"].shape[0], b["src_tokens"].shape[1], b["tgt_in"].shape[1]) for b in batches})
    return {
        "benchmark": "data_pipeline",
        "mode": mode,
        "tokens_per_s": round(real / total_s),
        "batching_tokens_per_s": round(real / (total_s - setup_s)),
        "real_tokens": real,
        "seconds": round(total_s, 3),
        "setup_seconds": round(setup_s, 3),
        "batches": len(batches),
        "padding_efficiency_src": round(eff["src"], 4),
        "padding_efficiency_tgt": round(eff["tgt"], 4),
        "padding_efficiency": round(real / slots, 4),
        "shapes_seen": len(shapes),
        "shapes": shapes[:20],
        "kept": stats["kept"],
        "dropped_too_long": stats["dropped_too_long"],
        "max_len": config.max_len,
        "batch_size": config.batch_size,
        "tokens_per_batch": config.tokens_per_batch,
        "batch_window": config.batch_window,
    }


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (transformer_jax.cli.run refuses them)
    if not (DATA / "multi30k" / "train.en").exists():
        emit(benchmark="data_pipeline", skipped=f"shared corpora not found at {DATA} (set TRANSFORMER_JAX_DATA)")
        return
    if hasattr(os, "sched_setaffinity"):  # one core: SentencePiece and numpy both stay on it
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    config = common.data_config()
    config.text_dir = str(DATA / "multi30k")
    config.src_lang, config.tgt_lang = _SRC_LANG.value, _TGT_LANG.value
    with tempfile.TemporaryDirectory() as workdir:
        tokenizer = tokenizer_lib.get_tokenizer(config, workdir, vocab_size=_VOCAB_SIZE.value, ids=SpecialIds.DEFAULT)
        start = time.perf_counter()
        pairs, _ = sources.read_text_split(config.text_dir, "train", config.src_lang, config.tgt_lang)
        examples = batching.tokenize_pairs(pairs, tokenizer, num_threads=1)
        seconds = time.perf_counter() - start
        tokens = int(examples.src_lens.sum() + examples.tgt_lens.sum())
        # Read + tokenize only, to see how much of the mode lines below is SentencePiece.
        emit(
            benchmark="data_pipeline",
            mode="read_and_tokenize",
            tokens_per_s=round(tokens / seconds),
            real_tokens=tokens,
        )
        for mode in _MODES.value:
            emit(**run_mode(config, tokenizer, mode, _EPOCHS.value))


if __name__ == "__main__":
    cli.run(main, "python -m benchmarks.data_pipeline")
