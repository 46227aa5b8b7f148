"""Data: sources of raw sentence pairs, the SentencePiece tokenizer, the tokenized store, and the grain batching
pipeline that ends with the batches on the devices.

Training calls `model_tokenizer(config, workdir)`, `open_train_examples(config.data, tokenizer, ...)` (the training
split, or each corpus of data.corpora, tokenized once into memory-mapped files), then
`make_train_iterator(config.data, tokenizer, examples=...)` and `pipeline.prefetch` (placed on the devices ahead of
the step); validation calls `load_split(config.data, split)` and `eval_batches(...)`. The batch contract is
documented in `batching`.
"""

from transformer_jax.data.sources import load_split
from transformer_jax.data.store import open_train_examples, open_train_store
from transformer_jax.data.tokenizer import get_tokenizer, model_tokenizer

# The grain pipeline is imported when first asked for: importing grain is slow, and evaluate.py and the
# other commands that read a tokenizer or a split through this package never batch with it.
_PIPELINE = ("eval_batches", "make_train_iterator")


def __getattr__(name: str):
    if name in _PIPELINE:
        from transformer_jax.data import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [*_PIPELINE, "get_tokenizer", "load_split", "model_tokenizer", "open_train_examples", "open_train_store"]
