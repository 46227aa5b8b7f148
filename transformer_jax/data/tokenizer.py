"""One joint SentencePiece vocabulary for both languages, trained on a sample of the training split and reused.

The reserved ids pad, eos, bos, unk are the config's (`model.*_id`, tokens.SpecialIds): a model trained here reserves
them, and a reused one must reserve the same. The model is trained with identity
normalization, no whitespace folding and byte fallback, so `decode(encode(s)) == s` for any string: BLEU is computed
on exactly the text the tokenizer was given, and no character is ever mapped to <unk>.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import ml_collections
import sentencepiece as spm
from absl import logging

from transformer_jax.data import sources
from transformer_jax.data.download import atomic_write
from transformer_jax.errors import DataError
from transformer_jax.tokens import SpecialIds

MODEL_FILENAME = "spm.model"


class Tokenizer:
    """A SentencePiece model that reserves `ids` (the config's); encode adds no BOS/EOS (the pipeline does)."""

    def __init__(self, model_path: str | os.PathLike, ids: SpecialIds):
        self.path = Path(model_path)
        self.ids = ids
        try:
            proto = self.path.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read tokenizer model {self.path}: {e.strerror or e}") from e
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(proto)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError with a terse message on bad files
            raise DataError(f"{self.path} is not a SentencePiece model: {e}") from e
        found = (self._sp.pad_id(), self._sp.eos_id(), self._sp.bos_id(), self._sp.unk_id())
        reserved = (ids.pad, ids.eos, ids.bos, ids.unk)
        if found != reserved:
            raise DataError(
                f"tokenizer {self.path} reserves (pad, eos, bos, unk) = {found}; the config's model.pad_id, eos_id, "
                f"bos_id, unk_id are {reserved}: use a matching tokenizer or set those keys"
            )

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Encodes many strings in one call; `num_threads` threads inside SentencePiece (1 = this core only)."""
        return self._sp.encode(list(texts), num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids` up to the first EOS; padding and BOS are dropped (model outputs can be passed as is)."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.ids.eos:
                break
            if i not in (self.ids.pad, self.ids.bos):
                out.append(i)
        return self._sp.decode(out)

    def decode_batch(self, batch: Iterable[Iterable[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]


def train_tokenizer(
    sentences: Iterable[str], model_path: str | os.PathLike, *, vocab_size: int, model_type: str, ids: SpecialIds
) -> Tokenizer:
    """Trains a SentencePiece model (unigram or bpe) reserving `ids` on `sentences`; writes it atomically to
    `model_path`."""
    if ids.bos == ids.pad:
        raise DataError(
            f"a SentencePiece model trained here needs model.bos_id ({ids.bos}) other than model.pad_id; "
            "set them apart, or give the workdir a converted model's tokenizer"
        )
    if model_type not in ("unigram", "bpe"):
        raise DataError(f"unknown data.tokenizer_type {model_type!r}; choose unigram or bpe")
    model_path = Path(model_path)
    with atomic_write(model_path) as tmp:
        # SentencePiece writes `prefix.model` and `prefix.vocab`; train under a temporary prefix and rename.
        prefix = f"{tmp}.sp"
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences),
                model_prefix=prefix,
                vocab_size=vocab_size,
                model_type=model_type,
                pad_id=ids.pad,
                eos_id=ids.eos,
                bos_id=ids.bos,
                unk_id=ids.unk,
                # Exact roundtrip: no Unicode normalization, keep every space, spell unknown characters as bytes.
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                byte_fallback=True,
                input_sentence_size=0,  # the caller already sampled
                num_threads=os.cpu_count() or 1,
                minloglevel=2,
            )
        except RuntimeError as e:
            raise DataError(f"SentencePiece training failed (vocab_size={vocab_size}, {model_type}): {e}") from e
        finally:
            Path(f"{prefix}.vocab").unlink(missing_ok=True)
        os.replace(f"{prefix}.model", tmp)
    return Tokenizer(model_path, ids)


def sample_sentences(pairs: sources.TextPairs | sources.TfdsPairs, num_sentences: int, *, seed: int = 0) -> list[str]:
    """About `num_sentences` sentences, both sides of a seeded uniform sample of pairs, empty sides left out.

    The sample is drawn by index from the known number of lines (or records) and read in one streaming pass, so
    a corpus of any size is never held whole; only the sample is.
    """
    num_pairs = min(len(pairs), max(1, num_sentences // 2))
    indices = sorted(random.Random(seed).sample(range(len(pairs)), num_pairs))
    return [s for pair in pairs.pick(indices) for s in pair if s.strip()]


def get_tokenizer(
    config: ml_collections.ConfigDict,
    workdir: str | os.PathLike,
    *,
    vocab_size: int,
    ids: SpecialIds,
    train_if_missing: bool = True,
) -> Tokenizer:
    """The configured tokenizer: `config.tokenizer_model` if set, else `workdir/spm.model`, trained if missing.

    `vocab_size` and `ids` are the model's (config.model.vocab_size, SpecialIds.of(config)). A reused model must
    have exactly that many pieces (a different size means the workdir belongs to another config); a given model may
    be smaller.
    `train_if_missing=False` (multi-host runs: every host must use the same file) fails instead of training.
    """
    if config.tokenizer_model:
        tokenizer = Tokenizer(sources.resolve_path(config.tokenizer_model), ids)
        if tokenizer.vocab_size > vocab_size:
            raise DataError(
                f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} pieces but model.vocab_size is {vocab_size}; "
                "ids would fall outside the embedding table"
            )
        return tokenizer
    path = Path(workdir) / MODEL_FILENAME
    if path.exists():
        tokenizer = Tokenizer(path, ids)
        if tokenizer.vocab_size != vocab_size:
            raise DataError(
                f"{path} has {tokenizer.vocab_size} pieces but model.vocab_size is {vocab_size}; "
                "delete it to train a new one, or use the matching config"
            )
        logging.info("reusing tokenizer %s (%d pieces)", path, vocab_size)
        return tokenizer
    if not train_if_missing:
        raise DataError(
            f"{path} does not exist and this run may not train it (several hosts would each train their own): "
            "create it once with `python -m transformer_jax.data.prepare --config <the same config> --workdir "
            f"{workdir}` on a filesystem every host sees, or set data.tokenizer_model to an existing .model file"
        )
    sentences = sample_sentences(sources.open_stream(config, config.train_split), config.tokenizer_sample_sentences)
    logging.info(
        "training a %s tokenizer with %d pieces on %d sentences", config.tokenizer_type, vocab_size, len(sentences)
    )
    return train_tokenizer(sentences, path, vocab_size=vocab_size, model_type=config.tokenizer_type, ids=ids)
